"""Loading a checkpoint's tokenizer offline, without running code shipped in the checkpoint.

Released dLLM checkpoints name tokenizer classes of their own in ``tokenizer_config.json``
(Dream's ``DreamTokenizer`` through an ``auto_map`` entry, for instance), which transformers
would only load with ``trust_remote_code``. dllm never runs checkpoint code: such a tokenizer is
loaded as the transformers class it copies, or as a plain fast tokenizer over the checkpoint's
``tokenizer.json``; the special tokens and the chat template come from the same files either
way (a ``chat_template.jinja`` beside them included).
"""

from __future__ import annotations

import os
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from dllm.checkpoint import read_json_object

# Tokenizer classes of released checkpoints' own code, and the transformers class each copies.
EQUIVALENT_CLASSES = {
    "DreamTokenizer": "Qwen2TokenizerFast",  # Dream's tokenization_dream.py is Qwen2's
}


def _tokenizer_config(path: str) -> dict[str, Any]:
    return read_json_object(os.path.join(path, "tokenizer_config.json"))


# Files that hold a vocabulary, one of which a tokenizer directory needs (besides the
# tokenizer_config.json that names its class): the fast tokenizer's file first.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


def check_tokenizer_files(path: str) -> None:
    """Raise a one-line ``ValueError`` naming the missing files when ``path`` holds no
    tokenizer (transformers would instead say that it does not recognize the architecture, or
    ask for a library that would not help)."""
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory {path} "
                         f"{'is not a directory' if os.path.exists(path) else 'does not exist'}")
    names = os.listdir(path)
    if any(n in VOCABULARY_FILES or n.endswith(".tiktoken") for n in names):
        return
    missing = ["tokenizer.json"] + ([] if "tokenizer_config.json" in names
                                    else ["tokenizer_config.json"])
    raise ValueError(f"{path} has no tokenizer: missing {' and '.join(missing)} (nor any other "
                     f"vocabulary file: {', '.join(VOCABULARY_FILES[1:])}); copy the "
                     "checkpoint's tokenizer files there, or give a tokenizer directory "
                     "(--tokenizer DIR; the engine argument tokenizer)")


NO_CHAT_TEMPLATE = ("the model has no chat template; give one with --chat-template FILE (the "
                    "engine argument chat_template: a Jinja file or the template itself), or "
                    "send a plain prompt")


def read_chat_template(value: str) -> str:
    """``--chat-template``: the text of a template file, or the value itself when it is a
    Jinja template (it holds ``{{`` or ``{%``)."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value[:100]}: no such file, and not a Jinja template "
                     "(one holds {{ ... }} or {% ... %})")


def check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(NO_CHAT_TEMPLATE)


def load_tokenizer(path: str, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of the checkpoint (or tokenizer directory) ``path``, offline;
    ``chat_template`` (``--chat-template``: a file or the template) replaces its own."""
    tok = _load_tokenizer(path)
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
    return tok


def _load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    check_tokenizer_files(path)
    name = _tokenizer_config(path).get("tokenizer_class")
    if name in EQUIVALENT_CLASSES:
        cls = getattr(transformers, EQUIVALENT_CLASSES[name])
        return cls.from_pretrained(path, local_files_only=True)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except ValueError as err:
        # A class only the checkpoint's own code defines: its tokenizer.json still describes it.
        if "custom code" not in str(err) and "does not exist" not in str(err):
            raise
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ValueError(f"{path}: the tokenizer class {name!r} is defined by code in the "
                             "checkpoint, which dllm does not run, and there is no "
                             "tokenizer.json to load instead") from None
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
