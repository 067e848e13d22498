"""What the engine needs to know about a checkpoint directory, resolved once (DESIGN §4)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllm.config import EngineConfig
from dllm.models.registry import ArchitectureSpec, get_architecture

# Known mask strings, tried in order when the tokenizer declares no mask token of its own.
KNOWN_MASK_STRINGS = ("<|mask|>", "<|mdm_mask|>", "<|MASK|>", "<MASK>", "|<MASK>|", "[MASK]")
BUILTIN_MODEL_DIR = Path(__file__).resolve().parent / "builtin_model"
# The model used when none is given; also selected by the name ``builtin``.
BUILTIN_MODEL_NAME = "builtin"
# The hybrid sibling (Mamba2 + attention, ``GraniteMoeHybridForBlockDiffusion``), selected by
# the model name ``builtin-hybrid``; trained by ``scripts/train_builtin.py --hybrid``.
BUILTIN_HYBRID_NAME = "builtin-hybrid"
BUILTIN_HYBRID_DIR = Path(__file__).resolve().parent / "builtin_hybrid"


@dataclass(frozen=True)
class ModelInfo:
    path: str
    spec: ArchitectureSpec
    config: dict[str, Any]
    mask_token_id: int | None
    block_size: int | None
    eos_token_ids: tuple[int, ...]
    context_length: int
    vocab_size: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return self.spec.name


def resolve_model_path(model: str | None) -> str:
    if model is None or (model == BUILTIN_MODEL_NAME and not os.path.isdir(model)):
        if (BUILTIN_MODEL_DIR / "config.json").is_file():
            return str(BUILTIN_MODEL_DIR)
        raise ValueError("no model given and no built-in model is shipped; pass model=DIR")
    if model == BUILTIN_HYBRID_NAME and not os.path.isdir(model):
        if (BUILTIN_HYBRID_DIR / "config.json").is_file():
            return str(BUILTIN_HYBRID_DIR)
        raise ValueError(f"the built-in hybrid model is not packaged in this install "
                         f"({BUILTIN_HYBRID_DIR} is missing); train it with `python "
                         f"scripts/train_builtin.py --hybrid --out dllm/builtin_hybrid`")
    path = os.path.expanduser(model)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{model!r} is not a checkpoint directory (no config.json); dllm "
                         "loads local checkpoints only and never downloads")
    return path


def read_json_object(path: str) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict ({} when absent); ``ValueError`` naming the file
    when it is not a JSON object."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            obj = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} is not a JSON object (got {type(obj).__name__})")
    return obj


def _as_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


def resolve_mask_token_id(engine_value: int | None, config: dict, tokenizer,
                          spec: ArchitectureSpec, vocab_size: int) -> int | None:
    """Engine argument, then ``mask_token_id`` in config.json, then the tokenizer's mask token
    (its own ``mask_token``, else a known mask string), then the architecture's default."""
    candidates: list[tuple[str, int | None]] = [
        ("engine argument mask_token_id", engine_value),
        ("config.json mask_token_id", config.get("mask_token_id")),
    ]
    tok_id = None
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token", None):
            tok_id = tokenizer.convert_tokens_to_ids(tokenizer.mask_token)
        if tok_id is None:
            vocab = tokenizer.get_vocab()
            strings = (*spec.mask_token_strings, *KNOWN_MASK_STRINGS)
            tok_id = next((vocab[s] for s in strings if s in vocab), None)
    candidates.append(("the tokenizer's mask token", tok_id))
    candidates.append((f"the {spec.name} default", spec.default_mask_id))
    for source, value in candidates:
        if value is None:
            continue
        if not 0 <= int(value) < vocab_size:
            raise ValueError(f"mask token id {value} (from {source}) is outside the vocabulary "
                             f"of {vocab_size} tokens")
        return int(value)
    return None


def load_model_info(engine: EngineConfig, tokenizer) -> ModelInfo:
    path = resolve_model_path(engine.model)
    config = read_json_object(os.path.join(path, "config.json"))
    archs = config.get("architectures") or []
    if not archs:
        raise ValueError(f"{path}/config.json has no 'architectures' entry")
    spec = get_architecture(archs[0])
    try:
        vocab_size = int(config["vocab_size"])
    except KeyError:
        raise ValueError(f"{path}/config.json has no 'vocab_size' entry") from None
    except (TypeError, ValueError):
        raise ValueError(f"{path}/config.json: 'vocab_size' must be an integer, got "
                         f"{config['vocab_size']!r}") from None
    gen = read_json_object(os.path.join(path, "generation_config.json"))
    is_diffusion = spec.kind != "causal_lm"
    mask_id = resolve_mask_token_id(engine.mask_token_id, config, tokenizer, spec,
                                    vocab_size) if is_diffusion else None
    from_config = next((config[k] for k in spec.block_size_keys if config.get(k)), None)
    block_size = engine.block_size or from_config or spec.default_block_size
    eos = set(_as_tuple(config.get("eos_token_id"))) | set(_as_tuple(gen.get("eos_token_id")))
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        vocab = tokenizer.get_vocab()
        eos.update(vocab[t] for t in spec.turn_end_tokens if t in vocab)
    model_ctx = int(config.get("max_position_embeddings")
                    or config.get("max_sequence_length") or 4096)
    context = min(engine.context_length or model_ctx, model_ctx)
    return ModelInfo(
        path=path, spec=spec, config=config, mask_token_id=mask_id,
        block_size=int(block_size) if block_size else None,
        eos_token_ids=tuple(sorted(eos)), context_length=context, vocab_size=vocab_size,
        generation_defaults=dict(gen.get("dllm", {})),
    )
