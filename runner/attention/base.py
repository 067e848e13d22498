"""The attention-backend interface (DESIGN §8): one object per runner, shared by all layers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from dllm.models.attention import AttentionLayer
from dllm.runner.forward_batch import ForwardBatch

__all__ = ["AttentionBackend", "AttentionLayer", "KVCache"]


class KVCache(Protocol):
    """Per-layer paged KV storage. Slot ``s`` of layer ``l`` holds one token's K and V."""

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, kv_heads, head_dim]`` into slots ``loc`` ``[n]``."""

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers of a layer, ``[num_slots, kv_heads, head_dim]``."""


class AttentionBackend(ABC):
    """Contract: ``prepare`` is called once per forward before the model runs; ``forward`` is
    called by every attention layer with this layer's new ``q`` ``[T, H, D]``, ``k``/``v``
    ``[T, Hkv, D]``. It writes ``k``/``v`` to ``forward_batch.out_cache_loc`` when the batch has
    a KV cache, and returns ``[T, H, D]`` attended under ``forward_batch.attention_mask``.
    ``k``/``v`` None (only with a KV cache): the layer has written them there already (a
    fused kernel, ``LayerOps.qkv_rope``)."""

    name: str = "base"

    def prepare(self, forward_batch: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Plan per-forward metadata (page tables, masks). Default: nothing to plan."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor: ...
