"""dllm: a serving runtime for diffusion language models.

The public names are imported lazily, so ``import dllm.models`` or ``import dllm.runner``
does not load the engine (or transformers)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "EngineConfig", "RequestOutput", "SamplingParams", "StreamChunk"]

_WHERE = {
    "LLM": "dllm.llm",
    "AsyncLLM": "dllm.async_llm",
    "EngineConfig": "dllm.config",
    "RequestOutput": "dllm.outputs",
    "StreamChunk": "dllm.outputs",
    "SamplingParams": "dllm.sampling_params",
}

if TYPE_CHECKING:
    from dllm.async_llm import AsyncLLM
    from dllm.config import EngineConfig
    from dllm.llm import LLM
    from dllm.outputs import RequestOutput, StreamChunk
    from dllm.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'dllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's own names and the lazily imported public ones (so ``dir(dllm)`` and
    tab completion list them before first use)."""
    return sorted(set(globals()) | set(__all__))
