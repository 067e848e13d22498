"""The attention call every model makes. The model computes q/k/v (projections, norms, RoPE);
the backend chosen by the runner (``forward_batch.attn_backend``) writes the KV cache and
attends under the batch's mask. Models never branch on the backend or the hardware."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class KVCacheSpec:
    """What the KV pool must hold for one model: K and V of ``num_kv_heads × head_dim`` per token
    and layer (``v_head_dim`` when V differs from K)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None


@dataclass(frozen=True)
class AttentionLayer:
    """What a backend needs to know about one attention layer."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackendLike(Protocol):
    """The attention a model calls: writes the layer's K/V to the cache and attends."""

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer: AttentionLayer, batch: Any) -> torch.Tensor: ...


class Batch(Protocol):
    """What a model reads of the batch it runs on (the runner's ``ForwardBatch`` is one): the
    attention backend, and a memo the layers of one forward share (e.g. RoPE tables)."""

    attn_backend: AttentionBackendLike
    memo: dict


class StatePoolLike(Protocol):
    """The recurrent-state pool a hybrid model reads and writes (the runner's
    ``MambaStatePool``): per Mamba layer, conv states ``[slots, conv_dim, K − 1]`` and SSM
    states ``[slots, heads, head_dim, d_state]``; slot 0 is the padding slot."""

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv, ssm)`` of Mamba layer ``index`` (counted over the Mamba layers only)."""


class StateBatch(Batch, Protocol):
    """What a hybrid (Mamba2 + attention) model reads of the batch besides ``Batch``: the
    state pool, and per row the slot its state is read from and the slot the state after
    the row is written to (``state_write_slots`` 0, the padding slot, for a forward whose
    state is discarded: a block-diffusion denoise step). ``extend_lens_cpu`` are the rows'
    token counts on the host; ``is_decode``: one token per row (the recurrence's one-step
    form)."""

    state_pool: StatePoolLike | None
    state_read_slots: torch.Tensor | None  # [bs] int64
    state_write_slots: torch.Tensor | None  # [bs] int64
    # Optional: where the state after each row is also written (the prefix cache's track
    # slots; 0 for rows that keep no snapshot), or None.
    state_track_slots: torch.Tensor | None  # [bs] int64
    extend_lens_cpu: list[int]

    @property
    def is_decode(self) -> bool: ...


class Attention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float | None = None):
        super().__init__()
        self.spec = AttentionLayer(
            layer_id, num_heads, num_kv_heads, head_dim,
            head_dim**-0.5 if scaling is None else scaling,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                forward_batch: Batch) -> torch.Tensor:
        """q ``[T, H*D]``, k/v ``[T, Hkv*D]`` → ``[T, H*D]``. k and v None: the layer wrote
        them to the KV cache already (``LayerOps.qkv_rope``)."""
        s = self.spec
        t = q.shape[0]
        out = forward_batch.attn_backend.forward(
            q.view(t, s.num_heads, s.head_dim),
            None if k is None else k.view(t, s.num_kv_heads, s.head_dim),
            None if v is None else v.view(t, s.num_kv_heads, s.head_dim),
            s,
            forward_batch,
        )
        return out.reshape(t, s.num_heads * s.head_dim)
