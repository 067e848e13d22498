"""The decoder layer with its residual steps carried into its projections' GEMMs, swapped in for
the models' plain ``DecoderLayer`` when the installed layer ops fuse them (``TritonOps``).

A model's ``DecoderLayer`` reads like the textbook: norm, attention, norm, MLP, each a separate
step. On the GPU the residual add and the RMSNorm that follow a projection are cheaper inside
that projection's kernels: the q/k/v and gate/up GEMMs finish the norm of their input in their
prologue (``norm_linear``, ``norm_gate_up``), and the o_proj and down GEMMs add the residual and
half-normalise for the next norm in their epilogue (``linear_residual`` → ``PreNormed``). That
is a property of the kernels, not of the model, so it lives here: ``fuse_decoder_layers`` swaps
each ``DecoderLayer`` whose attention is the shared ``SelfAttention`` for a ``FusedDecoderLayer``
over the same modules (the parameter names do not change). It computes the same function: the
reference implementations below do exactly the steps of the plain layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dllm.models.attention import Batch
from dllm.models.decoder import DecoderLayer, SelfAttention
from dllm.models.layers import RMSNorm, SwiGLUMLP
from dllm.models.ops import LayerOps


class PreNormed(NamedTuple):
    """The input of a pre-norm projection, half normalised by the kernel that produced it
    (``linear_residual`` of a fused implementation): the stream ``s = residual + y``,
    ``scaled = s * weight`` (rounded), and float32 partial sums of ``s²`` per row from which
    the consuming projection forms ``1 / rms(s)``. ``weight`` is the norm weight it was
    built for."""

    stream: torch.Tensor
    scaled: torch.Tensor
    sum_sq: torch.Tensor
    weight: torch.Tensor


class ResidualFusion(LayerOps):
    """The ops a ``FusedDecoderLayer`` calls, in their reference form (each is the plain
    layer's steps); a fused implementation overrides them with kernels and falls back here."""

    def pre_norm(self, x: torch.Tensor | PreNormed, residual: torch.Tensor | None,
                 weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``LayerOps.pre_norm``, also of the stream a fused ``linear_residual`` formed."""
        if isinstance(x, PreNormed):
            return self.rms_norm(x.stream, weight, eps), x.stream
        return super().pre_norm(x, residual, weight, eps)

    def norm_linear(self, x: torch.Tensor | PreNormed, residual: torch.Tensor | None,
                    weight: torch.Tensor, eps: float,
                    layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(linear(rms_norm(s), layer), s)``: the residual step and the projection after it."""
        h, s = self.pre_norm(x, residual, weight, eps)
        return self.linear(h, layer), s

    def norm_gate_up(self, x: torch.Tensor | PreNormed, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float,
                     gate_up: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(silu_and_mul(linear(rms_norm(s), gate_up)), s)``: the residual step and a
        SwiGLU MLP's packed gate/up projection with its activation."""
        h, s = self.pre_norm(x, residual, weight, eps)
        return self.silu_and_mul(self.linear(h, gate_up)), s

    def linear_residual(self, x: torch.Tensor, layer: nn.Module, residual: torch.Tensor,
                        next_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor | PreNormed, torch.Tensor | None]:
        """A sublayer's output projection, followed by the residual step of the RMSNorm with
        weight ``next_weight``: returns the pair the next ``pre_norm`` takes. The reference
        returns ``(linear(x, layer), residual)`` and leaves the add to that ``pre_norm``; a
        fused implementation may do the add (and part of the norm) in the projection's kernel
        and return ``(PreNormed, None)``."""
        return self.linear(x, layer), residual


class FusedDecoderLayer(nn.Module):
    """A ``DecoderLayer``'s modules, run with the residual steps inside the projections.
    ``next_norm``: the next layer's input norm when that layer is fused too (the pair this
    layer returns may then be ``(PreNormed, None)``); None for the last layer."""

    def __init__(self, layer: DecoderLayer, next_norm: RMSNorm | None):
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp
        self.mlp_fused = isinstance(layer.mlp, SwiGLUMLP)
        self._next_norm = (next_norm,)  # a tuple: the next layer owns it, not a submodule

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PreNormed,
                residual: torch.Tensor | None, forward_batch: Batch
                ) -> tuple[torch.Tensor | PreNormed, torch.Tensor | None]:
        attn, norm, post = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        ops: ResidualFusion = attn.ops
        qkv, s = ops.norm_linear(x, residual, norm.weight, norm.eps, attn.qkv_proj)
        out = attn.attend(qkv, positions, forward_batch)
        if not self.mlp_fused:  # MoE: the block gets its normalised input
            h, s = ops.pre_norm(ops.linear(out, attn.o_proj), s, post.weight, post.eps)
            return self.mlp(h), s
        h, s = ops.linear_residual(out, attn.o_proj, s, post.weight, post.eps)
        act, s = ops.norm_gate_up(h, s, post.weight, post.eps, self.mlp.gate_up_proj)
        nxt = self._next_norm[0]
        if nxt is None:
            return ops.linear(act, self.mlp.down_proj), s
        return ops.linear_residual(act, self.mlp.down_proj, s, nxt.weight, nxt.eps)


def _fusable(layer: nn.Module) -> bool:
    return isinstance(layer, DecoderLayer) and isinstance(layer.self_attn, SelfAttention)


def fuse_decoder_layers(model: nn.Module) -> int:
    """Swap every fusable ``DecoderLayer`` of ``model`` for a ``FusedDecoderLayer`` (after the
    layer ops are installed); returns how many. None under tensor parallelism: the output
    projections' all-reduce sits between the GEMM and the residual step."""
    n = 0
    if any(getattr(m, "tp", None) is not None and m.tp.size > 1 for m in model.modules()):
        return 0
    for module in list(model.modules()):
        layers = getattr(module, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            continue
        fusable = [_fusable(layer) for layer in layers]
        for i, ok in enumerate(fusable):
            if ok:
                nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) and fusable[i + 1] \
                    else None
                layers[i] = FusedDecoderLayer(layers[i], nxt)
                n += 1
    return n
