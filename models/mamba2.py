"""The Mamba2 mixer of the hybrid models (Granite 4.0-H, Bamba, Nemotron-H, Mamba2), in plain
torch, with its recurrent state passed in and returned explicitly, so that a state pool can
hold it per request.

The mixer (Dao & Gu, "Transformers are SSMs", 2024, §7 "the Mamba-2 architecture"; the layer
as transformers 4.57 writes it in ``models/mamba2/modeling_mamba2.py``,
``models/bamba/modeling_bamba.py`` and ``models/granitemoehybrid/modeling_granitemoehybrid.py``,
and as NVIDIA's hub file ``modeling_nemotron_h.py`` writes it for Nemotron-H), for one token
``u`` of width ``hidden_size``:

1. ``in_proj(u)`` splits into ``z`` (``I = heads · head_dim``), ``xBC`` (``I + 2·G·N``) and
   ``dt`` (``heads``); ``G`` = ``n_groups``, ``N`` = ``d_state``.
2. A causal depthwise convolution of kernel ``K`` runs over ``xBC`` along time, then SiLU.
   The conv state is the last ``K − 1`` inputs of the row (pre-convolution ``xBC``), oldest
   first, ``[conv_dim, K − 1]``; a fresh row's state is zeros (the zero padding of the conv).
3. ``xBC`` splits into ``x [heads, head_dim]``, ``B [G, N]``, ``C [G, N]``; head ``h`` reads
   group ``h // (heads / G)``.
4. ``dt = clamp(softplus(dt + dt_bias), time_step_limit)`` in fp32, ``A = −exp(A_log)``.
5. The SSM, per head (state ``h [head_dim, N]``, fp32):
   ``h_t = exp(dt_t·A)·h_{t−1} + dt_t·x_t ⊗ B_t``,  ``y_t = h_t·C_t + D·x_t``.
6. ``y = rmsnorm(y · silu(z)) · norm.weight``: a gated RMSNorm over the full width ``I``
   (Granite, Bamba, transformers' Mamba2) or per group of ``I / G`` channels (Nemotron-H:
   ``group_size = intermediate_size // n_groups``, ``norm_before_gate=False``).
7. ``out_proj(y)``.

**A block of tokens from a known state** (the "SSD" form, paper §6; the closed form of
issue 20). For the ``L`` tokens of one chunk and one head, with ``a_t = dt_t·A`` and
``c_t = a_1 + … + a_t``:

    y_t = Σ_{s≤t} exp(c_t − c_s) (C_t·B_s) dt_s x_s  +  exp(c_t) (h0 · C_t)  +  D x_t
    h_L = exp(c_L) h0 + Σ_s exp(c_L − c_s) dt_s x_s ⊗ B_s

``exp(c_t − c_s)`` is formed as ``exp(Σ_{s<k≤t} a_k)`` (a segment sum, not a difference of two
cumulative sums, which loses precision once ``|c|`` is large). A row of ``T`` tokens runs in
chunks of ``chunk_size``, each starting from the state the previous one left, so memory is
``chunk² × heads`` whatever ``T``: exactly the recurrence, re-associated.

Rows are token-major: ``[T_total, ...]`` with ``extend_lens`` tokens per row, as the runner's
``ForwardBatch`` lays them out. Rows of one short length (every denoise step and commit of
block diffusion: ``BATCHED_ROW_TOKENS``) run as one batched pass; other rows (chunked AR
prefill beside decodes, long prompts) one after another. States are per row: ``conv_state [rows, conv_dim, K − 1]``,
``ssm_state [rows, heads, head_dim, N]`` (fp32 unless the caller asks otherwise). Nothing is
written in place: each call returns the new states, and the caller decides where they go
(a denoise step of block diffusion reads the committed state and discards the new one).

**Tensor parallelism** (``dllm.models.parallel``): every head's recurrence is independent of
the others', so a mixer splits by heads (``shard_dims``). Each rank holds its heads' rows of
``z``, ``x`` and ``dt`` in ``in_proj``, the B and C rows of the groups its heads read (split
where the size divides ``n_groups``; a group whose heads two ranks share is held by both),
the matching ``conv1d`` channels, its heads' ``dt_bias``, ``A_log``, ``D`` and norm channels,
and its columns of ``out_proj``, whose output the ranks all-reduce. The gated norm needs the
mean square over each norm group: where a group is not whole on one rank (the full-width norm
always, Nemotron-H's per-group norm when the size does not divide ``n_groups``) the ranks add
their per-group sums of squares (``gated_rms_norm_across``: one all-reduce of ``[T, norm
groups]``, a number per token for the full-width norm). States are per rank: its heads'
SSM state, its ``x | B | C`` channels' conv state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dllm.models.layers import RowLinear
from dllm.models.ops import UsesOps
from dllm.models.parallel import TensorParallel, all_reduce, tensor_parallel

INF = float("inf")
BATCHED_ROW_TOKENS = 64  # rows of one length up to this run as one batched pass


@dataclass(frozen=True)
class Mamba2Dims:
    """The sizes of one Mamba2 mixer. ``norm_group_size`` is the gated norm's group width
    (``intermediate_size`` for a full-width norm)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    chunk_size: int
    norm_eps: float
    norm_group_size: int
    time_step_limit: tuple[float, float] = (0.0, INF)
    use_conv_bias: bool = True
    use_proj_bias: bool = False
    # The heads of each group, in order, where they are not ``num_heads / n_groups`` each (a
    # tensor-parallel rank holding whole groups and parts of groups: ``shard_dims``).
    group_heads: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.group_heads is None and self.num_heads % self.n_groups:
            raise ValueError(f"heads {self.num_heads} not a multiple of groups {self.n_groups}")
        if self.group_heads is not None and (len(self.group_heads) != self.n_groups
                                             or sum(self.group_heads) != self.num_heads):
            raise ValueError(f"group_heads {self.group_heads} do not give {self.num_heads} "
                             f"heads over {self.n_groups} groups")
        if self.intermediate_size % self.norm_group_size:
            raise ValueError("the gated norm's group size must divide intermediate_size")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    @property
    def projection_size(self) -> int:
        return self.intermediate_size + self.conv_dim + self.num_heads

    def conv_state_shape(self, rows: int) -> tuple[int, int, int]:
        return (rows, self.conv_dim, self.conv_kernel - 1)

    def ssm_state_shape(self, rows: int) -> tuple[int, int, int, int]:
        return (rows, self.num_heads, self.head_dim, self.d_state)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Mamba2Dims:
        """The mixer of a ``config.json`` of one of the hybrid architectures (by its keys)."""
        arch = (config.get("architectures") or [""])[0]
        if arch in ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridForBlockDiffusion",
                    "BambaForCausalLM"):
            heads = config["mamba_n_heads"]
            inter = int(config.get("mamba_expand", 2) * config["hidden_size"])
            head_dim = config.get("mamba_d_head", "auto")
            head_dim = inter // heads if head_dim == "auto" else head_dim
            # Both files fix the limit to (0, inf) whatever the config says.
            return cls(config["hidden_size"], heads, head_dim, config.get("mamba_n_groups", 1),
                       config["mamba_d_state"], config.get("mamba_d_conv", 4),
                       config.get("mamba_chunk_size", 256), config.get("rms_norm_eps", 1e-6),
                       heads * head_dim, (0.0, INF), config.get("mamba_conv_bias", True),
                       config.get("mamba_proj_bias", False))
        if arch == "NemotronHForCausalLM":
            heads, head_dim = config["mamba_num_heads"], config["mamba_head_dim"]
            groups = config["n_groups"]
            return cls(config["hidden_size"], heads, head_dim, groups, config["ssm_state_size"],
                       config["conv_kernel"], config["chunk_size"],
                       config.get("layer_norm_epsilon", 1e-5), heads * head_dim // groups,
                       _limit(config.get("time_step_limit")), config.get("use_conv_bias", True),
                       config.get("mamba_proj_bias", config.get("use_bias", False)))
        if arch == "Mamba2ForCausalLM":
            heads, head_dim = config["num_heads"], config["head_dim"]
            return cls(config["hidden_size"], heads, head_dim, config["n_groups"],
                       config["state_size"], config["conv_kernel"], config["chunk_size"],
                       config.get("layer_norm_epsilon", 1e-5), heads * head_dim,
                       _limit(config.get("time_step_limit")), config.get("use_conv_bias", True),
                       config.get("use_bias", False))
        raise ValueError(f"no Mamba2 mixer for architecture {arch!r}")


def _limit(value: Any) -> tuple[float, float]:
    if value is None:
        return (0.0, INF)
    lo, hi = value
    return (float(lo), float(hi))


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: a rank's heads
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mamba2Shard:
    """Where one tensor-parallel rank's part of a mixer sits in the whole one (``full``): its
    heads are ``[head_start, head_start + heads)``, its B/C groups ``[group_start,
    group_start + groups)`` (the groups its heads read: split where the size divides
    ``n_groups``, else a group shared by two ranks' heads is held by both), its gated-norm
    channels those of its heads. ``norm_across``: the norm's groups are not whole on this rank
    (the full-width norm of Granite, Bamba and Mamba2; Nemotron-H's per-group norm when the
    size does not divide ``n_groups``), so the ranks add their sums of squares, one
    all-reduce of ``[tokens, norm groups]``."""

    full: Mamba2Dims
    head_start: int = 0
    group_start: int = 0
    norm_across: bool = False

    @property
    def channel_start(self) -> int:
        """The first of this rank's ``z``, ``x`` and gated-norm channels in the whole mixer."""
        return self.head_start * self.full.head_dim


def shard_dims(dims: Mamba2Dims, rank: int, size: int) -> tuple[Mamba2Dims, Mamba2Shard]:
    """The sizes of rank ``rank``'s part of a mixer split over ``size`` ranks by heads, and
    where that part sits (``Mamba2Shard``). ``ValueError`` when ``size`` does not divide the
    heads."""
    if size == 1:
        return dims, Mamba2Shard(dims)
    if dims.group_heads is not None:
        raise ValueError("a mixer already split cannot be split again")
    if dims.num_heads % size:
        raise ValueError(f"the Mamba2 mixers' heads ({dims.num_heads}) are not divisible by "
                         f"the tensor-parallel size {size}; use a size that divides them")
    heads = dims.num_heads // size
    first = rank * heads
    per_group = dims.num_heads // dims.n_groups
    g0, g1 = first // per_group, (first + heads - 1) // per_group
    counts = tuple(min((g + 1) * per_group, first + heads) - max(g * per_group, first)
                   for g in range(g0, g1 + 1))
    width = heads * dims.head_dim
    across = width % dims.norm_group_size != 0
    local = dataclasses.replace(
        dims, num_heads=heads, n_groups=len(counts),
        norm_group_size=width if across else dims.norm_group_size,
        group_heads=None if len(set(counts)) == 1 else counts)
    return local, Mamba2Shard(dims, first, g0, across)


def per_head(t: torch.Tensor, heads: int, group_heads: tuple[int, ...] | None,
             dim: int) -> torch.Tensor:
    """B or C per group (the groups along ``dim``) → per head (``heads`` along ``dim``): each
    head reads its group's values; ``group_heads`` the heads of each group where they are not
    ``heads / groups`` each (``Mamba2Dims.group_heads``)."""
    if group_heads is None:
        return t.repeat_interleave(heads // t.shape[dim], dim=dim)
    return torch.cat([t.narrow(dim, g, 1).repeat_interleave(n, dim=dim)
                      for g, n in enumerate(group_heads)], dim=dim)


def _take_rows(tensor: torch.Tensor, parts: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
    """This rank's rows of a checkpoint tensor whose rows are the pieces ``parts`` (per piece:
    its rows in the checkpoint, its rows here, the first of them), in order. A tensor of
    another size is returned as it is (the loader's shape check names it)."""
    if tensor.shape[0] != sum(full for full, _, _ in parts) or all(
            full == local for full, local, _ in parts):
        return tensor
    pieces, start = [], 0
    for full, local, first in parts:
        pieces.append(tensor[start + first: start + first + local])
        start += full
    return torch.cat(pieces)


class _ColumnLinear(nn.Linear):
    """``in_proj`` split by its output rows: this rank's rows of each of ``z | x | B | C |
    dt``."""

    def __init__(self, in_features: int, parts: tuple[tuple[int, int, int], ...], bias: bool):
        super().__init__(in_features, sum(local for _, local, _ in parts), bias=bias)
        self.parts = parts

    def localize(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        return _take_rows(tensor, self.parts)


class _ChannelConv(nn.Conv1d):
    """The depthwise ``conv1d`` over this rank's ``x | B | C`` channels."""

    def __init__(self, parts: tuple[tuple[int, int, int], ...], kernel: int, bias: bool):
        channels = sum(local for _, local, _ in parts)
        super().__init__(channels, channels, kernel, groups=channels, padding=kernel - 1,
                         bias=bias)
        self.parts = parts

    def localize(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        return _take_rows(tensor, self.parts)


class _NormWeight(nn.Module):
    """The gated norm's ``weight`` over this rank's channels."""

    def __init__(self, parts: tuple[tuple[int, int, int], ...]):
        super().__init__()
        self.parts = parts
        self.weight = nn.Parameter(torch.ones(parts[0][1]))

    def localize(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        return _take_rows(tensor, self.parts)


# ---------------------------------------------------------------------------------------------
# The pieces
# ---------------------------------------------------------------------------------------------


def split_projection(zxbcdt: torch.Tensor, dims: Mamba2Dims
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``in_proj`` output ``[T, projection_size]`` → ``z [T, I]``, ``xBC [T, conv_dim]``,
    ``dt [T, heads]``."""
    return zxbcdt.split([dims.intermediate_size, dims.conv_dim, dims.num_heads], dim=-1)


def causal_conv(xbc: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution of rows of equal length, then SiLU.

    ``xbc [R, T, C]``; ``conv_state [R, C, K − 1]`` (each row's previous ``K − 1`` inputs,
    oldest first); ``weight [C, K]`` (``conv1d.weight`` without its middle axis), tap ``K − 1``
    multiplying the current input. Returns ``silu(conv) [R, T, C]`` and the new states: the
    last ``K − 1`` inputs of ``[state, xbc]``."""
    k = weight.shape[-1]
    if xbc.shape[1] == 0:
        return xbc, conv_state.clone()
    window = torch.cat([conv_state.to(xbc.dtype).transpose(1, 2), xbc], dim=1)  # [R, K-1+T, C]
    taps = window.unfold(1, k, 1)  # [R, T, C, K]: taps[r, t, c, j] = window[r, t + j, c]
    out = (taps * weight).sum(-1)
    if bias is not None:
        out = out + bias
    new_state = window[:, window.shape[1] - (k - 1):].transpose(1, 2).contiguous()
    return F.silu(out), new_state


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
               limit: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``dt = clamp(softplus(dt + dt_bias), limit)`` and ``A = −exp(A_log)``, both fp32."""
    dt = F.softplus(dt.float() + dt_bias.float())
    dt = torch.clamp(dt, limit[0], limit[1])
    return dt, -torch.exp(a_log.float())


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``a [R, L, H]`` → ``S [R, H, L, L]`` with ``S[r, h, t, s] = Σ_{s<k≤t} a[r, k, h]`` for
    ``s ≤ t`` and ``−inf`` above the diagonal, so ``exp(S)`` is the decay from ``s`` to ``t``."""
    length = a.shape[1]
    x = a.transpose(1, 2)[..., None].expand(-1, -1, length, length)  # x[r, h, k, s] = a[k]
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), -1)
    x = x.masked_fill(~below, 0.0).cumsum(dim=2)  # [r, h, t, s] = Σ_{s<k≤t} a[k]
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return x.masked_fill(~keep, -INF)


def ssd_chunk(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              c: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The closed form over one chunk of ``L`` tokens of each row from its state ``h0``
    (module docstring), without the ``D·x`` term. All fp32: ``x [R, L, H, P]``,
    ``dt [R, L, H]``, ``a [H]``, ``b, c [R, L, H, N]`` (already expanded from groups to
    heads), ``h0 [R, H, P, N]``. Returns ``y [R, L, H, P]`` and ``h_L [R, H, P, N]``."""
    da = dt * a  # [R, L, H]
    cum = da.cumsum(dim=1)  # c_t
    decay = torch.exp(_segsum(da))  # [R, H, t, s]
    scores = torch.einsum("rthn,rshn->rhts", c, b) * decay  # (C_t·B_s) exp(c_t − c_s)
    xdt = x * dt[..., None]  # dt_s x_s
    y = torch.einsum("rhts,rshp->rthp", scores, xdt)
    y = y + torch.einsum("rhpn,rthn->rthp", h0, c) * torch.exp(cum)[..., None]
    to_end = torch.exp(cum[:, -1:] - cum)  # exp(c_L − c_s), [R, L, H]
    h_end = h0 * torch.exp(cum[:, -1])[..., None, None] + torch.einsum(
        "rsh,rshp,rshn->rhpn", to_end, xdt, b)
    return y, h_end


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor, d: torch.Tensor, h0: torch.Tensor, chunk_size: int,
             group_heads: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over rows of ``T`` tokens each, in chunks of ``chunk_size``. ``x [R, T, H, P]``,
    ``dt [R, T, H]`` (discretized), ``a [H]``, ``b, c [R, T, G, N]`` (per group), ``d [H]``,
    ``h0 [R, H, P, N]``; ``group_heads``: the heads of each group where they are not ``H / G``
    each (``Mamba2Dims.group_heads``). Returns ``y [R, T, H, P]`` (fp32, ``D·x`` included)
    and the final states (fp32)."""
    heads = x.shape[2]
    x = x.float()
    b = per_head(b.float(), heads, group_heads, 2)
    c = per_head(c.float(), heads, group_heads, 2)
    state = h0.float()
    out = []
    for s in range(0, x.shape[1], chunk_size):
        e = s + chunk_size
        y, state = ssd_chunk(x[:, s:e], dt[:, s:e], a, b[:, s:e], c[:, s:e], state)
        out.append(y)
    y = torch.cat(out, dim=1) if out else x.new_zeros(x.shape)
    return y + x * d.float()[:, None], state


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int) -> torch.Tensor:
    """``weight · rmsnorm(y · silu(z))`` with the mean square over groups of ``group_size``
    channels (``group_size = I``: the full width), computed in fp32; returned in ``weight``'s
    dtype (the files multiply ``weight`` by the fp32 result cast to the input dtype)."""
    h = y.float() * F.silu(z.float())
    shape = h.shape
    h = h.view(*shape[:-1], shape[-1] // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(shape).to(weight.dtype)


def gated_rms_norm_across(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          group_size: int, first_channel: int, num_groups: int,
                          tp: TensorParallel) -> torch.Tensor:
    """``gated_rms_norm`` of ``y [T, C]`` holding channels ``[first_channel, first_channel +
    C)`` of a norm of ``num_groups`` groups of ``group_size`` channels, whose groups the
    ranks of ``tp`` hold parts of: each rank sums the squares of its channels per group, the
    ranks add those ``[T, num_groups]`` sums (one all-reduce; ``[T, 1]`` for a full-width
    norm) and each normalizes its own channels."""
    h = y.float() * F.silu(z.float())
    group = torch.arange(first_channel, first_channel + h.shape[-1],
                         device=h.device) // group_size
    squares = h.new_zeros(*h.shape[:-1], num_groups).index_add_(-1, group, h.square())
    mean = all_reduce(squares, tp) / group_size
    h = h * torch.rsqrt(mean.index_select(-1, group) + eps)
    return weight * h.to(weight.dtype)


# ---------------------------------------------------------------------------------------------
# The mixer
# ---------------------------------------------------------------------------------------------


class Mamba2Mixer(nn.Module, UsesOps):
    """One Mamba2 mixer with the checkpoints' parameter names (``in_proj``, ``conv1d``,
    ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj``), so a state dict under
    ``…mamba.`` (Granite, Bamba) or ``…mixer.`` (Nemotron-H, Mamba2) loads as it is.

    ``forward`` runs rows of any length from given states (prefill, chunked prefill, a block
    of block diffusion); ``decode`` runs one token per row. Both return
    ``(out, conv_state, ssm_state)`` and leave their inputs untouched. The SSM scan of
    ``forward`` is ``self.ops.ssm_scan`` (``ssd_scan`` unless a runner installs fla-core's
    chunked kernel for long rows: ``dllm.runner.kernels.ssm_scan``)."""

    def __init__(self, dims: Mamba2Dims, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        # Under tensor parallelism (``dllm.models.parallel``) this rank's heads: ``dims`` are
        # the whole mixer's, ``self.dims`` this rank's part (the same with one rank).
        self.tp = tensor_parallel()
        local, self.shard = shard_dims(dims, self.tp.rank, self.tp.size)
        self.dims = local
        sh, d = self.shard, local
        inter = (dims.intermediate_size, local.intermediate_size, sh.channel_start)
        groups = (dims.n_groups * dims.d_state, local.n_groups * local.d_state,
                  sh.group_start * dims.d_state)
        self.head_part = (dims.num_heads, local.num_heads, sh.head_start)
        self.in_proj = _ColumnLinear(d.hidden_size, (inter, inter, groups, groups,
                                                     self.head_part), d.use_proj_bias)
        self.conv1d = _ChannelConv((inter, groups, groups), d.conv_kernel, d.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(d.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(
            sh.head_start + 1, sh.head_start + d.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(d.num_heads))
        self.norm = _NormWeight((inter,))
        self.out_proj = RowLinear(dims.intermediate_size, d.hidden_size, bias=d.use_proj_bias)
        if dtype != torch.float32 or device is not None:
            self.to(dtype=dtype, device=device)

    def localize(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        """This rank's heads of ``dt_bias``, ``A_log`` and ``D``."""
        return _take_rows(tensor, (self.head_part,))

    def zero_states(self, rows: int, ssm_dtype: torch.dtype = torch.float32
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of ``rows`` fresh rows: conv state in the weights' dtype, SSM state in
        ``ssm_dtype`` (fp32 by default, transformers' ``mamba_ssm_cache_dtype``)."""
        w = self.in_proj.weight
        return (torch.zeros(self.dims.conv_state_shape(rows), dtype=w.dtype, device=w.device),
                torch.zeros(self.dims.ssm_state_shape(rows), dtype=ssm_dtype, device=w.device))

    def _finish(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d, sh = self.dims, self.shard
        y = y.reshape(y.shape[0], d.intermediate_size)
        if sh.norm_across:
            full = sh.full
            y = gated_rms_norm_across(y, z, self.norm.weight, d.norm_eps, full.norm_group_size,
                                      sh.channel_start,
                                      full.intermediate_size // full.norm_group_size, self.tp)
        else:
            y = gated_rms_norm(y, z, self.norm.weight, d.norm_eps, d.norm_group_size)
        return all_reduce(self.out_proj(y.to(dtype)), self.tp)

    def forward(self, hidden: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                extend_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden [T_total, hidden_size]``, rows of ``extend_lens`` tokens each, token-major;
        ``conv_state [rows, conv_dim, K−1]`` and ``ssm_state [rows, heads, head_dim, N]`` the
        states before each row. Returns the output ``[T_total, hidden_size]`` and the states
        after each row (a row of 0 tokens keeps its states)."""
        d = self.dims
        if sum(extend_lens) != hidden.shape[0] or len(extend_lens) != conv_state.shape[0]:
            raise ValueError("extend_lens do not match the tokens or the states")
        z, xbc, dt = split_projection(self.in_proj(hidden), d)
        dt, a = discretize(dt, self.dt_bias, self.A_log, d.time_step_limit)
        if len(set(extend_lens)) == 1 and (len(extend_lens) == 1
                                           or extend_lens[0] <= BATCHED_ROW_TOKENS):
            # Rows of one short length (denoise steps and commits of block diffusion) or a
            # lone row: one batched pass, so the launches do not grow with the rows (longer
            # rows go one by one: a pass holds rows x heads x L² scores).
            y, conv, ssm = self._rows(xbc, dt, a, conv_state, ssm_state, extend_lens[0])
            return self._finish(y.reshape(-1, d.num_heads, d.head_dim), z, hidden.dtype), \
                conv, ssm
        ys, convs, ssms = [], [], []
        start = 0
        for r, n in enumerate(extend_lens):
            rows = slice(start, start + n)
            start += n
            y, conv, ssm = self._rows(xbc[rows], dt[rows], a, conv_state[r:r + 1],
                                      ssm_state[r:r + 1], n)
            ys.append(y[0])
            convs.append(conv)
            ssms.append(ssm)
        y = torch.cat(ys, dim=0) if ys else hidden.new_zeros(0, d.num_heads, d.head_dim)
        return (self._finish(y, z, hidden.dtype),
                torch.cat(convs) if convs else conv_state.clone(),
                torch.cat(ssms) if ssms else ssm_state.clone())

    def _rows(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
              conv_state: torch.Tensor, ssm_state: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of ``n`` tokens each (token-major ``xbc [R·n, C]``, ``dt [R·n, H]``) from their
        states → ``y [R, n, H, P]`` and the states after them (in the states' dtypes)."""
        d = self.dims
        rows = conv_state.shape[0]
        xbc, conv = causal_conv(xbc.view(rows, n, xbc.shape[-1]), conv_state,
                                self.conv1d.weight.squeeze(1), self.conv1d.bias)
        x, b, c = xbc.split([d.intermediate_size, d.n_groups * d.d_state,
                             d.n_groups * d.d_state], dim=-1)
        y, h = self.ops.ssm_scan(x.reshape(rows, n, d.num_heads, d.head_dim),
                                 dt.view(rows, n, dt.shape[-1]), a,
                                 b.reshape(rows, n, d.n_groups, d.d_state),
                                 c.reshape(rows, n, d.n_groups, d.d_state), self.D, ssm_state,
                                 d.chunk_size, d.group_heads)
        return y, conv.to(conv_state.dtype), h.to(ssm_state.dtype)

    def decode(self, hidden: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token per row: ``hidden [rows, hidden_size]``. The recurrence itself (module
        docstring, step 5), vectorized over rows."""
        d = self.dims
        z, xbc, dt = split_projection(self.in_proj(hidden), d)
        window = torch.cat([conv_state.to(xbc.dtype), xbc[:, :, None]], dim=-1)  # [R, C, K]
        conv = (window * self.conv1d.weight.squeeze(1)).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        xbc = F.silu(conv)
        x, b, c = xbc.split([d.intermediate_size, d.n_groups * d.d_state,
                             d.n_groups * d.d_state], dim=-1)
        rows = hidden.shape[0]
        x = x.float().view(rows, d.num_heads, d.head_dim)
        b = per_head(b.float().view(rows, d.n_groups, d.d_state), d.num_heads, d.group_heads, 1)
        c = per_head(c.float().view(rows, d.n_groups, d.d_state), d.num_heads, d.group_heads, 1)
        dt, a = discretize(dt, self.dt_bias, self.A_log, d.time_step_limit)  # [R, H], [H]
        h = (ssm_state.float() * torch.exp(dt * a)[:, :, None, None]
             + (dt[:, :, None] * x)[..., None] * b[:, :, None, :])
        y = torch.einsum("rhpn,rhn->rhp", h, c) + x * self.D.float()[:, None]
        return (self._finish(y, z, hidden.dtype), window[:, :, 1:].to(conv_state.dtype),
                h.to(ssm_state.dtype))


def state_bytes(dims: Mamba2Dims, conv_dtype: torch.dtype = torch.bfloat16,
                ssm_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one row's state in one mixer (for sizing a state pool)."""
    conv = math.prod(dims.conv_state_shape(1)) * torch.empty(0, dtype=conv_dtype).element_size()
    ssm = math.prod(dims.ssm_state_shape(1)) * torch.empty(0, dtype=ssm_dtype).element_size()
    return conv + ssm


@dataclass(frozen=True)
class MambaStateSpec:
    """What a state pool must hold for one hybrid model: ``num_layers`` Mamba2 mixers of
    ``dims`` each, the SSM state in ``ssm_dtype`` (fp32: transformers'
    ``mamba_ssm_cache_dtype`` default), the conv state in the model's dtype."""

    num_layers: int
    dims: Mamba2Dims
    ssm_dtype: torch.dtype = torch.float32

    def slot_bytes(self, conv_dtype: torch.dtype) -> int:
        """Bytes of one slot: every layer's conv and SSM state of one request."""
        return self.num_layers * state_bytes(self.dims, conv_dtype, self.ssm_dtype)
