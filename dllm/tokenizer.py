"""Loading a checkpoint's tokenizer offline, without running code shipped in the checkpoint.

Released dLLM checkpoints name tokenizer classes of their own in ``tokenizer_config.json``
(Dream's ``DreamTokenizer`` through an ``auto_map`` entry, for instance), which transformers
would only load with ``trust_remote_code``. dllm never runs checkpoint code: such a tokenizer is
loaded as the transformers class it copies, or as a plain fast tokenizer over the checkpoint's
``tokenizer.json``; the special tokens and the chat template come from the same files either
way (a ``chat_template.jinja`` beside them included).
"""

from __future__ import annotations

import json
import os
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Tokenizer classes of released checkpoints' own code, and the transformers class each copies.
EQUIVALENT_CLASSES = {
    "DreamTokenizer": "Qwen2TokenizerFast",  # Dream's tokenization_dream.py is Qwen2's
}


def _tokenizer_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the checkpoint (or tokenizer directory) ``path``, offline."""
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
