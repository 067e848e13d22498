"""The per-layer math that a runner may swap for fused kernels: RMSNorm (plain, with the
residual add, per head), SwiGLU's ``silu(gate) * up``, rotary embedding, the linear
projections of the shared decoder layers, the MoE routers and experts and the SSM scan of the
Mamba2 mixers.

``LayerOps`` is the plain-PyTorch reference (the CPU path and the numerics tests compare
against). A runner installs a faster implementation of the same interface on every module of a
model with ``install_ops`` (``dllm.runner.layer_ops.FlashInferOps`` on CUDA): the models call
``self.ops.<op>`` and never branch on the hardware themselves. A fused implementation computes
the same function up to the rounding of the activation dtype (it keeps float32 inside a
kernel where the reference rounds between steps). Fusions across a layer's steps (the residual
add and the next norm carried into the neighbouring projections' GEMMs) are not ops the models
call: the runner swaps whole decoder layers for those (``dllm.runner.fused_layer``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from dllm.models.attention import Attention, Batch
    from dllm.models.decoder import AttentionSpec
    from dllm.models.layers import RotaryEmbedding
    from dllm.models.moe import StackedExperts


class QKVAttention(Protocol):
    """What ``LayerOps.qkv_rope`` reads of an attention module with one packed q/k/v
    projection (``SelfAttention``)."""

    spec: AttentionSpec
    rotary_emb: RotaryEmbedding | None  # None: no positional encoding
    attn: Attention
    ops: LayerOps

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The per-head q and k RMSNorm weights, ``(None, None)`` without qk-norm."""


class LayerOps:
    """The reference implementation, in plain PyTorch. ``grouped_moe``: MoE experts through
    the static-shape grouped path (``StackedExperts.forward_grouped``), which CUDA graphs can
    capture, instead of the per-expert loop."""

    name = "torch"
    grouped_moe = False
    fla_scan = False  # fla-core's scan for long Mamba2 rows (``runner.kernels.ssm_scan``)

    def __init__(self, grouped_moe: bool = False):
        self.grouped_moe = grouped_moe

    def moe_experts(self, experts: StackedExperts, x: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        """``Σ_k w_k · expert_{id_k}(x)`` of routed tokens ``x`` ``[T, H]`` over ``[T, K]``
        expert ids and weights."""
        if self.grouped_moe:
            return experts.forward_grouped(x, topk_ids, topk_weights)
        return experts.forward_loop(x, topk_ids, topk_weights)

    def moe_route_sigmoid(self, logits: torch.Tensor, top_k: int, n_group: int,
                          topk_group: int, bias: torch.Tensor | None, renormalize: bool,
                          scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """LLaDA2 / Ling / Nemotron-H routing of router logits ``[T, E]``: float32 weights and int64
        expert ids ``[T, K]``, as ``dllm.models.moe.sigmoid_grouped_topk`` computes them."""
        from dllm.models.moe import sigmoid_grouped_topk

        return sigmoid_grouped_topk(logits, top_k, n_group, topk_group, bias, renormalize,
                                    scaling_factor)

    def moe_route_softmax(self, logits: torch.Tensor, top_k: int, renormalize: bool,
                          bias: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax top-k routing of router logits ``[T, E]`` (Qwen3-MoE, SDAR-MoE,
        LLaDA-MoE): float32 weights and int64 expert ids ``[T, K]``, as
        ``dllm.models.moe.softmax_topk`` computes them."""
        from dllm.models.moe import softmax_topk

        return softmax_topk(logits, top_k, renormalize, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / rms(x)`` over the last axis, the statistics in float32 (as the HF
        reference models do). ``F.rms_norm`` is one fused kernel where torch has one."""
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
        return weight * y.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``. An implementation may reuse the
        storage of ``x`` and ``residual`` (the decoder passes tensors it owns)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Per-head RMSNorm of ``x`` ``[T, N, D]`` (a strided view is fine) → ``[T, N, D]``."""
        return self.rms_norm(x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :d]) * x[..., d:]`` of ``[..., 2d]`` → ``[..., d]``."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def qkv_rope(self, attn: QKVAttention, qkv: torch.Tensor, positions: torch.Tensor,
                 forward_batch: Batch
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """From the fused q/k/v projection ``[T, (H + 2·Hkv)·D]`` of ``attn`` to attention's
        inputs: q ``[T, H, D]`` and k ``[T, Hkv, D]`` after the per-head norms (where the
        layer has them) and RoPE, v ``[T, Hkv, D]``. An implementation may instead write K
        and V into the batch's KV cache itself (its slots ``out_cache_loc``) and return
        ``(q, None, None)``, which tells the attention backend the cache is written."""
        s = attn.spec
        t = qkv.shape[0]
        q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = q.view(t, s.num_heads, s.head_dim)  # [T, H, D], rows strided
        k = k.view(t, s.num_kv_heads, s.head_dim)
        q_weight, k_weight = attn.qk_norm_weights()
        if q_weight is not None:
            q = self.head_rms_norm(q, q_weight, s.norm_eps)
            k = self.head_rms_norm(k, k_weight, s.norm_eps)
        if attn.rotary_emb is not None:
            q, k = self.rope(attn.rotary_emb, positions, q, k, forward_batch.memo)
        return (q.view(t, s.num_heads, s.head_dim), k.view(t, s.num_kv_heads, s.head_dim),
                v.view(t, s.num_kv_heads, s.head_dim))

    def linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        """``x @ layer.weight.T (+ layer.bias)`` of ``x`` ``[T, K]`` (an ``nn.Linear``, or a
        module with a ``weight`` and no bias: the LM head, a tied embedding)."""
        return F.linear(x, layer.weight, getattr(layer, "bias", None))

    def silu_mul_linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """``layer(silu_and_mul(x))``: SwiGLU's down projection of the fused gate/up output."""
        return self.linear(self.silu_and_mul(x), layer)

    def pre_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                 weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm decoder's residual step: ``(rms_norm(s), s)`` with the stream
        ``s = residual + x``, or ``s = x`` at the first layer (``residual`` None)."""
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        return self.add_rms_norm(x, residual, weight, eps)

    def ssm_scan(self, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 c: torch.Tensor, d: torch.Tensor, h0: torch.Tensor, chunk_size: int,
                 group_heads: tuple[int, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mamba2's SSM over rows of ``T`` tokens each from their states: the arguments and
        results of ``dllm.models.mamba2.ssd_scan`` (``y [R, T, H, P]`` with ``D·x``, and the
        final states, both float32)."""
        from dllm.models.mamba2 import ssd_scan

        return ssd_scan(x, dt, a, b, c, d, h0, chunk_size, group_heads)

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
             k: torch.Tensor, memo: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE at ``positions`` of q ``[T, H, D]`` and k ``[T, Hkv, D]`` (strided views are
        fine) → rotated ``[T, H*D]``, ``[T, Hkv*D]``."""
        t, h, d = q.shape
        return rotary(positions, q.reshape(t, h * d), k.reshape(t, k.shape[1] * d), memo)


TORCH_OPS = LayerOps()


class UsesOps:
    """Mixin of the modules that call ``self.ops`` (the reference until a runner installs
    another implementation)."""

    ops: LayerOps = TORCH_OPS


def install_ops(model: nn.Module, ops: LayerOps) -> int:
    """Point every module of ``model`` that uses layer ops at ``ops``; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, UsesOps):
            m.ops = ops
            n += 1
    return n
