"""Layers shared by every architecture: RMSNorm, rotary embedding, SwiGLU MLP, vocab embedding
and LM head. Plain PyTorch; token-major tensors (``[T, ...]``, no batch axis)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dllm.models.config import ModelConfig
from dllm.models.ops import UsesOps
from dllm.models.parallel import all_reduce, tensor_parallel


class RMSNorm(UsesOps, nn.Module):
    """``weight * x / rms(x)``, the statistics in float32 (as the HF reference models do)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(residual + x), residual + x)``: the pre-norm decoder's residual step, one
        kernel where the layer ops fuse it. ``residual`` None (the first layer): ``(self(x),
        x)``."""
        return self.ops.pre_norm(x, residual, self.weight, self.eps)


# ---------------------------------------------------------------------------------------------
# Rotary embedding
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one attention layer. ``rotary_dim < head_dim`` rotates only the
    leading ``rotary_dim`` channels of each head (partial rotary); the rest pass through.
    ``scaling`` holds the ``rope_scaling`` dict as sorted items (``None``: plain RoPE).
    ``full_precision`` rotates in float32 and casts back (LLaDA); otherwise cos/sin are cast to
    the activation dtype first (HF Llama/Qwen)."""

    head_dim: int
    rotary_dim: int
    theta: float
    scaling: tuple[tuple[str, Any], ...] | None = None
    full_precision: bool = False

    @classmethod
    def from_config(cls, config: ModelConfig, head_dim: int, theta_default: float = 10000.0,
                    full_precision: bool = False) -> RopeSpec:
        if config.get("partial_rotary_factor") is None and config.get("rotary_dim") is not None:
            rotary_dim = config.get_int("rotary_dim")
        else:
            factor = config.get_float("partial_rotary_factor", 1.0)
            if not 0.0 < factor <= 1.0:
                raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
            rotary_dim = int(head_dim * factor)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary dimension {rotary_dim} does not fit head_dim {head_dim}")
        scaling = config.get("rope_scaling")
        items = tuple(sorted(scaling.items())) if isinstance(scaling, dict) else None
        if items is not None and _rope_type(dict(items)) == "default":
            items = None
        return cls(head_dim, rotary_dim, config.get_float("rope_theta", theta_default), items,
                   full_precision)


def _rope_type(scaling: dict[str, Any]) -> str:
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freq(spec: RopeSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """``[rotary_dim // 2]`` float32 inverse frequencies, as HF's ``ROPE_INIT_FUNCTIONS``."""
    dim = spec.rotary_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (spec.theta**exponent)
    if spec.scaling is None:
        return inv_freq
    scaling = dict(spec.scaling)
    kind = _rope_type(scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    # yarn / dynamic / longrope change attention scaling or depend on the sequence length.
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF convention: the two halves of the rotated channels form the (real, imag) pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE at absolute ``positions`` to q ``[T, H*D]`` and k ``[T, Hkv*D]``."""

    def __init__(self, spec: RopeSpec):
        super().__init__()
        self.spec = spec
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the non-persistent buffer (after meta-device construction)."""
        self.register_buffer("inv_freq", rope_inv_freq(self.spec, device), persistent=False)

    def cos_sin_cache(self, max_positions: int) -> torch.Tensor:
        """float32 ``[max_positions, rotary_dim]``: cos of every position in the first half of
        the columns, sin in the second (the table fused RoPE kernels index by position)."""
        pos = torch.arange(max_positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos``/``sin`` ``[T, 1, rotary_dim]``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, rot]
        return emb.cos(), emb.sin()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.spec.head_dim
        x = x.view(t, x.shape[-1] // d, d)  # [T, H, D]
        rot = self.spec.rotary_dim
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        if self.spec.full_precision:
            out = (x_rot.float() * cos + rotate_half(x_rot.float()) * sin).to(x.dtype)
        else:  # cos/sin arrive in the activation dtype (``forward``)
            out = x_rot * cos + rotate_half(x_rot) * sin
        if x_pass.shape[-1]:
            out = torch.cat((out, x_pass), dim=-1)
        return out.reshape(t, x.shape[1] * d)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                 memo: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``memo`` (the forward batch's per-forward memo) shares cos/sin between the layers
        of one forward: every layer rotates the same positions with the same spec."""
        key = ("rope_cos_sin", self.spec, dtype)
        if memo is not None and key in memo:
            return memo[key]
        cos, sin = self.cos_sin(positions)
        if not self.spec.full_precision:
            cos, sin = cos.to(dtype), sin.to(dtype)
        if memo is not None:
            memo[key] = (cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(positions, q.dtype, memo)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


# ---------------------------------------------------------------------------------------------
# MLP, embedding, head
# ---------------------------------------------------------------------------------------------


def check_silu(config: ModelConfig, key: str = "hidden_act") -> None:
    act = config.get_str(key, "silu")
    if act not in ("silu", "swish", "swiglu"):
        raise NotImplementedError(f"activation {act!r} is not supported (only SwiGLU/SiLU)")


class PackedLinear(nn.Linear):
    """One ``nn.Linear`` whose output rows are several checkpoint projections stacked
    (``output_sizes`` rows each, in order): q/k/v, or gate/up. The modules that hold one name
    the checkpoint projections it packs in ``packed_modules`` (checkpoint module name → (packed
    module, shard index)), the weight-mapping data the loader reads to copy each checkpoint
    tensor into its rows; the model then runs one GEMM where the checkpoint has several.

    Under tensor parallelism each shard holds this rank's rows of its projection: ``parts``
    gives per shard ``(rows in the checkpoint, rows here, first checkpoint row here)``."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 parts: list[tuple[int, int, int]] | None = None):
        parts = parts or [(n, n, 0) for n in output_sizes]
        super().__init__(in_features, sum(local for _, local, _ in parts), bias=bias)
        self.parts = tuple(parts)
        self.output_sizes = tuple(local for _, local, _ in parts)

    def shard_rows(self, index: int) -> slice:
        """The rows of shard ``index`` in the packed output."""
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def localize(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        """This rank's rows of checkpoint ``tensor``: one shard's projection (``shard``), or
        the whole packed projection (a checkpoint that stores it packed, e.g. LLaDA2's
        ``query_key_value``)."""
        if shard is not None:
            _, local, first = self.parts[shard]
            return tensor[first : first + local]
        if tensor.shape[0] != sum(full for full, _, _ in self.parts):
            return tensor  # not the checkpoint's packed layout: the shape check names it
        pieces, start = [], 0
        for full, local, first in self.parts:
            pieces.append(tensor[start + first : start + first + local])
            start += full
        return torch.cat(pieces)


def column_parts(*sizes: int) -> list[tuple[int, int, int]]:
    """``PackedLinear`` parts of projections split evenly over the tensor-parallel ranks."""
    tp = tensor_parallel()
    return [(n, tp.split(n, "a projection's rows"), tp.rank * (n // tp.size)) for n in sizes]


class RowLinear(nn.Linear):
    """A projection whose input is split over the tensor-parallel ranks (o_proj, down): each
    rank holds its columns, and the caller all-reduces the output. The bias is added once
    (rank 0 holds it, the others zeros)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp = tensor_parallel()
        super().__init__(tp.split(in_features, "a projection's input"), out_features, bias=bias)
        self.tp = tp

    def localize(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        tp = self.tp
        if leaf == "bias":
            return tensor if tp.rank == 0 else torch.zeros_like(tensor)
        n = self.in_features
        return tensor[:, tp.rank * n : (tp.rank + 1) * n] if tensor.shape[1] == n * tp.size \
            else tensor


class SwiGLUMLP(UsesOps, nn.Module):
    """``down(silu(gate(x)) * up(x))``, the checkpoint's ``gate_proj`` and ``up_proj`` packed
    into one ``gate_up_proj`` GEMM at load."""

    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                         parts=column_parts(intermediate_size, intermediate_size))
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias=bias)
        self.tp = self.down_proj.tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        act = self.ops.linear(x, self.gate_up_proj)
        return all_reduce(self.ops.silu_mul_linear(act, self.down_proj), self.tp)


class VocabEmbedding(nn.Module):
    """The token embedding; under tensor parallelism each rank holds a slice of the
    vocabulary (``TensorParallel.vocab_range``) and the ranks sum their rows."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tensor_parallel()
        self.start, self.end, rows = self.tp.vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size).normal_(std=0.02))

    def localize(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        """This rank's rows of the checkpoint's ``[vocab, hidden]`` table, zero-padded."""
        rows = self.weight.shape[0]
        if tensor.shape[0] != self.vocab_size or rows == self.vocab_size:
            return tensor
        part = tensor[self.start : self.end]
        pad = part.new_zeros(rows - part.shape[0], *part.shape[1:])
        return torch.cat((part, pad))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.weight.shape[0] == self.vocab_size:
            return F.embedding(input_ids, self.weight)
        inside = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(inside, input_ids - self.start, 0)
        return all_reduce(F.embedding(local, self.weight) * inside[:, None], self.tp)


class LMHead(VocabEmbedding):
    """The output projection ``[vocab, hidden]``, split over the vocabulary like the
    embedding (the model gathers the logits: ``DecoderLM.compute_logits``)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        return F.linear(hidden, self.weight)
