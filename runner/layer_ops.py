"""Fused layer kernels from FlashInfer and Triton (GPU only; imported lazily, like the attention
backend).

``FlashInferOps`` implements ``dllm.models.ops.LayerOps`` with one kernel per op where the
reference takes several: RMSNorm, residual add + RMSNorm (in place), per-head RMSNorm of the
strided q/k slices of the fused projection, ``silu(gate) * up``, and RoPE of q and k together
from a float32 cos/sin table indexed by position. Each kernel keeps float32 inside and rounds
once, so results match the reference within the activation dtype's rounding. Dtypes
FlashInfer has no kernel for (float32) take the reference path.

Where the model has Mamba2 mixers and fla-core is installed, ``ssm_scan`` takes fla's chunked
kernel for long rows (``dllm.runner.kernels.ssm_scan``; ``DLLM_FLA_SCAN=0`` keeps the reference).

``TritonOps`` adds the project's Triton kernels (``dllm.runner.kernels``) where Triton is
installed: the q/k head norms, RoPE and the KV-cache write of a layer as one launch
(``fused_qkv``), and a weight-streaming GEMM for at most 16 tokens, and up to 64 for the
shapes its row tiles list (``skinny_gemm``; cuBLAS splits K for some of those shapes and adds
a reduction kernel) that also takes the residual add + RMSNorm before the q/k/v and gate/up
projections and the SiLU-and-multiply after gate/up. From ``wide_gemm.MIN_M`` tokens (the
batch-128 step) gate/up, and the output projections whose K is at most their N (o_proj;
``wide_gemm.residual_pays``), are ``wide_gemm``'s kernels with the same fused neighbours;
q/k/v and (in real models, whose MLP is wider than the hidden size) down stay with cuBLAS and
FlashInfer's add + RMSNorm.
The MoE routers are ``moe_route``'s kernel and, where the grouped MoE path is on, the routed
experts ``fused_moe``'s (``DLLM_FUSED_MOE=0`` keeps the torch routers and ``grouped_mm``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flashinfer
import torch
import torch.nn.functional as F
from flashinfer.rope import _apply_rope_pos_ids_cos_sin_cache
from torch import nn

from dllm.models.layers import RotaryEmbedding
from dllm.runner.fused_layer import PreNormed, ResidualFusion
from dllm.runner.kernels.hardware import capability
from dllm.runner.kernels.settings import KernelSettings
from dllm.runner.kernels.ssm_scan import FlaScanOps

if TYPE_CHECKING:
    from dllm.models.moe import StackedExperts

_HALF = (torch.float16, torch.bfloat16)


def grouped_moe_enabled(model: nn.Module, device: torch.device,
                        settings: KernelSettings) -> bool:
    """MoE experts through ``StackedExperts.forward_grouped`` (static shapes, no host read, so
    CUDA graphs capture MoE models): the default for bfloat16 experts on Hopper and Blackwell
    datacenter GPUs (compute capability 9.x, 10.x: torch's ``grouped_mm`` kernels; elsewhere
    its fallback reads the group offsets on the host, which a graph capture forbids);
    ``settings.moe_grouped`` off (``DLLM_MOE_GROUPED=0``) keeps the per-expert loop. On an H200
    the grouped path ran LLaDA2.0-mini's eager step 4.8× (batch 1) and 29× (batch 32) faster
    than the loop (bench/NOTES.md, session 8)."""
    from dllm.models.moe import StackedExperts, grouped_mm

    if not settings.moe_grouped:
        return False
    experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
    if grouped_mm is None or not experts:
        return False
    if device.type != "cuda" or capability(device)[0] not in (9, 10):
        return False
    # grouped_mm's operands need 16-byte strides: hidden and expert sizes multiples of 8.
    return all(m.gate_proj.dtype == torch.bfloat16 and m.gate_proj.shape[1] % 8 == 0
               and m.gate_proj.shape[2] % 8 == 0 for m in experts)


class FlashInferOps(FlaScanOps):
    """``settings``: the environment knobs, read once here when not given."""

    name = "flashinfer"
    # Programmatic dependent launch (a kernel's prologue overlaps its predecessor's tail, Hopper
    # and newer; the skinny GEMM prefetches weights meanwhile) stays off for every kernel the
    # runner launches, passed as False (FlashInfer's own default would turn it on): it was
    # slower, SDAR-8B batch 1 5.42 ms a step with it against 4.96 without; with the launch let
    # go once a kernel's input is ready 5.49 against 4.65 ms, after the GEMM's main loop 4.66
    # (bench/NOTES.md, sessions 5 and 6; bench/layer_chain.py has the GEMM chain alone).
    pdl = False

    def __init__(self, model: nn.Module, max_positions: int, device: torch.device,
                 settings: KernelSettings | None = None):
        self.settings = settings if settings is not None else KernelSettings.from_env()
        # fla-core's chunked scan for the long rows of Mamba2 mixers, where it is installed.
        super().__init__(model, self.settings.fla_scan,
                         grouped_moe=grouped_moe_enabled(model, device, self.settings))
        # One cos/sin table per distinct rotary spec (every layer of a model shares one).
        self.cos_sin: dict[object, torch.Tensor] = {}
        for m in model.modules():
            if isinstance(m, RotaryEmbedding) and m.spec not in self.cos_sin:
                self.cos_sin[m.spec] = m.cos_sin_cache(max_positions).to(device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype not in _HALF or x.dim() != 2 or weight.dtype != x.dtype:
            return super().rms_norm(x, weight, eps)
        return flashinfer.norm.rmsnorm(x, weight, eps, enable_pdl=self.pdl)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if (x.dtype not in _HALF or weight.dtype != x.dtype or residual.dtype != x.dtype
                or x.dim() != 2 or not (x.is_contiguous() and residual.is_contiguous())):
            return super().add_rms_norm(x, residual, weight, eps)
        # In place: residual += x, then x = rms_norm(residual) * weight.
        flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps, enable_pdl=self.pdl)
        return x, residual

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype not in _HALF or weight.dtype != x.dtype or x.stride(-1) != 1:
            return super().head_rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        flashinfer.norm.rmsnorm(x, weight, eps, out=out, enable_pdl=self.pdl)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _HALF or x.shape[-1] * x.element_size() % 32:
            return super().silu_and_mul(x)
        return flashinfer.activation.silu_and_mul(x, enable_pdl=self.pdl)

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
             k: torch.Tensor, memo: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.cos_sin.get(rotary.spec)
        if table is None or q.dtype not in _HALF or q.stride(-1) != 1 or k.stride(-1) != 1:
            return super().rope(rotary, positions, q, k, memo)
        t, h, d = q.shape
        q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        if t:
            # Non-interleaved (NeoX/HF ``rotate_half``) pairs; rotary_dim is the table's width.
            _apply_rope_pos_ids_cos_sin_cache(q, k, q_out, k_out, table, positions, False)
        return q_out.view(t, h * d), k_out.view(t, k.shape[1] * d)


class TritonOps(ResidualFusion, FlashInferOps):
    name = "triton"

    def __init__(self, model: nn.Module, max_positions: int, device: torch.device,
                 settings: KernelSettings | None = None):
        super().__init__(model, max_positions, device, settings)
        from dllm.runner.kernels import fused_moe, fused_qkv, moe_route, skinny_gemm, wide_gemm

        self._qkv = fused_qkv
        self._gemm = skinny_gemm
        self._wide = wide_gemm
        # MoE routing and experts in Triton (``settings.fused_moe`` off: the torch routers and
        # ``StackedExperts.forward_grouped``).
        self._moe = fused_moe if self.settings.fused_moe else None
        self._route = moe_route if self.settings.fused_moe else None
        # The residual steps in the skinny and wide GEMMs' epilogues (``linear_residual``);
        # ``settings.fuse_residual`` off keeps them as separate add + RMSNorm kernels (the wide
        # gate/up keeps SiLU-and-mul in its epilogue either way).
        self.fuse_residual = self.settings.fuse_residual

    def moe_experts(self, experts: StackedExperts, x: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        # Only where the static-shape grouped path is on: with it off the model runs the
        # per-expert loop eagerly (``DLLM_MOE_GROUPED=0``, ``supports_cuda_graph``).
        w = (experts.gate_proj, experts.up_proj, experts.down_proj)
        if (self._moe is not None and self.grouped_moe
                and self._moe.supports(x, *w, topk_ids, topk_weights)):
            return self._moe.fused_experts(x, *w, topk_ids, topk_weights)
        return super().moe_experts(experts, x, topk_ids, topk_weights)

    def moe_route_sigmoid(self, logits: torch.Tensor, top_k: int, n_group: int,
                          topk_group: int, bias: torch.Tensor | None, renormalize: bool,
                          scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self._route is not None and self._route.supports_sigmoid(logits, top_k, n_group,
                                                                    topk_group, bias):
            return self._route.route_sigmoid(logits, top_k, n_group, topk_group, bias,
                                           renormalize, scaling_factor)
        return super().moe_route_sigmoid(logits, top_k, n_group, topk_group, bias, renormalize,
                                         scaling_factor)

    def moe_route_softmax(self, logits: torch.Tensor, top_k: int, renormalize: bool,
                          bias: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._route is not None and self._route.supports_softmax(logits, top_k, bias):
            return self._route.route_softmax(logits, top_k, renormalize, bias)
        return super().moe_route_softmax(logits, top_k, renormalize, bias)

    def linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        weight, bias = layer.weight, getattr(layer, "bias", None)
        if self._gemm.supports(x, weight, bias):
            return self._gemm.skinny_linear(x, weight, bias, pdl=self.pdl)
        return F.linear(x, weight, bias)

    def norm_linear(self, x, residual, weight, eps, layer):
        w, b = layer.weight, getattr(layer, "bias", None)
        if self._takes(x, weight, w, b):
            y = self._gemm.skinny_linear(x.scaled, w, b, sum_sq=x.sum_sq, eps=eps, pdl=self.pdl)
            return y, x.stream
        return super().norm_linear(x, residual, weight, eps, layer)

    def norm_gate_up(self, x, residual, weight, eps, gate_up):
        w, b = gate_up.weight, getattr(gate_up, "bias", None)
        if self._takes(x, weight, w, b) and w.shape[0] % 2 == 0:
            # else a separate SiLU kernel is faster
            fused = self._gemm.silu_fused(*w.shape, w.device, x.scaled.shape[0])
            y = self._gemm.skinny_linear(x.scaled, w, b, sum_sq=x.sum_sq, eps=eps, silu=fused,
                                         pdl=self.pdl)
            return (y if fused else self.silu_and_mul(y)), x.stream
        if (isinstance(x, PreNormed) and x.weight is weight
                and self._wide.supports_gate_up(x.scaled, w, b, x.sum_sq)):
            return self._wide.gate_up_silu(x.scaled, w, x.sum_sq, eps), x.stream
        h, s = self.pre_norm(x, residual, weight, eps)
        if self._wide.supports_gate_up(h, w, b):
            return self._wide.gate_up_silu(h, w), s
        if (self._gemm.supports(h, w, b) and w.shape[0] % 2 == 0
                and self._gemm.silu_fused(*w.shape, w.device, h.shape[0])):
            # the norm came separately (its producer was not the skinny GEMM): SiLU still rides
            return self._gemm.skinny_linear(h, w, b, silu=True, pdl=self.pdl), s
        return self.silu_and_mul(self.linear(h, gate_up)), s

    def linear_residual(self, x, layer, residual, next_weight, eps):
        w, b = layer.weight, getattr(layer, "bias", None)
        if self.fuse_residual and isinstance(residual, torch.Tensor):
            if self._gemm.supports_residual(x, w, b, residual, next_weight):
                s, scaled, sum_sq = self._gemm.skinny_linear_residual(
                    x, w, b, residual, next_weight, pdl=self.pdl)
                return PreNormed(s, scaled, sum_sq, next_weight), None
            if (self._wide.supports_residual(x, w, b, residual, next_weight)
                    and self._wide.residual_pays(*w.shape)):
                s, scaled, sum_sq = self._wide.linear_residual(x, w, residual, next_weight)
                return PreNormed(s, scaled, sum_sq, next_weight), None
        return super().linear_residual(x, layer, residual, next_weight, eps)

    def _takes(self, x, norm_weight, w, b) -> bool:
        """Whether ``x`` is a ``PreNormed`` built for this norm that the skinny GEMM can
        finish (else the reference ``pre_norm`` forms the norm from its stream)."""
        return (isinstance(x, PreNormed) and x.weight is norm_weight
                and self._gemm.supports(x.scaled, w, b))

    def qkv_rope(self, attn, qkv, positions, forward_batch):
        s = attn.spec
        fb = forward_batch
        table = None if attn.rotary_emb is None else self.cos_sin.get(attn.rotary_emb.spec)
        if table is None or not self._qkv.supports(qkv, s.num_heads, s.num_kv_heads,
                                                   s.head_dim, table.shape[-1]):
            return super().qkv_rope(attn, qkv, positions, fb)
        args = (qkv, s.num_heads, s.num_kv_heads, s.head_dim, *attn.qk_norm_weights(),
                s.norm_eps, table, positions)
        if fb.kv_pool is not None and fb.out_cache_loc.shape[0] == qkv.shape[0]:
            k_buf, v_buf = fb.kv_pool.get_kv(attn.attn.spec.layer_id)
            if self._qkv.supports_store(qkv, s.num_heads, s.num_kv_heads, s.head_dim,
                                        table.shape[-1], k_buf, v_buf):
                # K and V go straight into the cache: the backend skips its own write.
                q = self._qkv.qk_norm_rope_store(*args, k_buf, v_buf, fb.out_cache_loc,
                                                 pdl=self.pdl)
                return q, None, None
        q, k = self._qkv.qk_norm_rope(*args)
        t = qkv.shape[0]
        v = qkv[:, (s.num_heads + s.num_kv_heads) * s.head_dim:]
        return q, k, v.view(t, s.num_kv_heads, s.head_dim)
