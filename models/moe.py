"""Mixture-of-experts pieces: stacked SwiGLU experts and the routers of the supported families.

Routers are pure functions of the router logits, so tests can compare the selected experts with
a reference directly. ``StackedExperts.forward_loop`` is the exact eager path (one matmul group
per hit expert, like the HF references); it reads the hit experts on the host, which CUDA-graph
capture forbids. ``StackedExperts.forward_grouped`` computes the same sum with static shapes
and no host read (the token-expert pairs sorted by expert, ``torch.nn.functional.grouped_mm``
over the experts' row ranges); the layer ops choose between them (``LayerOps.moe_experts``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm.models.layers import SwiGLUMLP
from dllm.models.ops import UsesOps
from dllm.models.parallel import all_reduce, tensor_parallel

# ``torch.nn.functional.grouped_mm`` where torch has it public, else the older private name.
grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class StackedExperts(UsesOps, nn.Module):
    """``E`` SwiGLU experts, weights stacked on a leading expert axis:
    ``gate_proj``/``up_proj`` ``[E, I, H]``, ``down_proj`` ``[E, H, I]``. Under tensor
    parallelism each rank holds a slice of every expert's intermediate size; under expert
    parallelism (``TensorParallel.ep``) each rank holds ``E / ep`` whole experts (their
    intermediate size split over the ``tp / ep`` ranks that share them) and computes only the
    token-expert pairs routed to them. Either way its output is a partial sum the MoE block
    all-reduces (one all-reduce per layer)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.full_intermediate = intermediate_size
        self.tp = tensor_parallel()
        self.first_expert, self.local_experts = self.tp.experts(num_experts)
        self.inter_start, intermediate_size = self.tp.expert_slice(intermediate_size)
        e = self.local_experts
        self.gate_proj = nn.Parameter(torch.empty(e, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(e, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, intermediate_size))
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)

    def localize(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        """This rank's slice of one checkpoint expert's projection (``[I, H]`` or ``[H, I]``)."""
        n = self.gate_proj.shape[1]
        axis = 1 if leaf == "down_proj" else 0
        if n == self.full_intermediate or tensor.shape[axis] != self.full_intermediate:
            return tensor
        return tensor.narrow(axis, self.inter_start, n)

    def local_index(self, expert: int) -> int | None:
        """Where checkpoint expert ``expert`` sits in this rank's stack; None: another rank
        holds it (the loader skips it). An index past the experts is kept as it is (the
        loader names it as out of range)."""
        if not 0 <= expert < self.num_experts:
            return expert
        local = expert - self.first_expert
        return local if 0 <= local < self.local_experts else None

    def to_local(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing in this rank's expert numbering: a pair routed to another rank's
        expert gets id ``local_experts`` (past the stack) and weight 0."""
        if self.local_experts == self.num_experts:
            return topk_ids, topk_weights
        local = topk_ids - self.first_expert
        mine = (local >= 0) & (local < self.local_experts)
        return (torch.where(mine, local, self.local_experts),
                torch.where(mine, topk_weights, torch.zeros_like(topk_weights)))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on ``x`` ``[n, H]`` → ``[n, H]``."""
        return F.linear(F.silu(F.linear(x, self.gate_proj[e])) * F.linear(x, self.up_proj[e]),
                        self.down_proj[e])

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``, ``topk_ids``/``topk_weights`` ``[T, K]`` (global expert ids) →
        ``Σ_k w_k·expert_k(x)`` over this rank's experts, by the path the layer ops choose
        (``LayerOps.moe_experts``)."""
        return self.ops.moe_experts(self, x, *self.to_local(topk_ids, topk_weights))

    def forward_loop(self, x: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> torch.Tensor:
        """The reference: each hit expert on its tokens, in ascending expert order, summed into
        the output in ``x``'s dtype (as the HF references). Reads the hit experts on the
        host."""
        out = torch.zeros_like(x)
        weights = topk_weights.to(x.dtype)
        for e in torch.unique(topk_ids).tolist():  # ascending, as the references loop
            if e >= self.local_experts:  # another rank's expert (``to_local``)
                continue
            token, slot = torch.where(topk_ids == e)
            y = self.expert(e, x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out

    def forward_grouped(self, x: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor) -> torch.Tensor:
        """The same sum with static shapes and no host read, so a CUDA graph can capture it:
        the ``T·K`` token-expert pairs sorted by expert (stable: by token, then slot, within
        an expert), one grouped GEMM each for gate, up and down over the experts' row ranges
        (an expert without a pair has an empty range), each pair's output scaled by its
        weight, put back in (token, slot) order and summed over the K slots in float32 (the
        reference sums in ``x``'s dtype in expert order: the two agree within its rounding).
        Needs ``grouped_mm`` (bfloat16 on CUDA)."""
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # another rank's pairs (id ``local_experts``) sort last, past every expert's range
        counts = torch.zeros(self.local_experts + 1, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts[:-1].cumsum(0).to(torch.int32)  # end of each expert's rows
        # [T·K + 1, H], grouped by expert, plus one spare row past the last expert's range
        # (grouped_mm documents offs[-1] as strictly below the rows; the spare is ignored).
        rows = x[torch.cat([order // k, order.new_zeros(1)])]
        gate = grouped_mm(rows, self.gate_proj.transpose(1, 2), offs=offs)
        up = grouped_mm(rows, self.up_proj.transpose(1, 2), offs=offs)
        y = grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)[: t * k]
        y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
        if self.local_experts < self.num_experts:  # rows past the ranges are not computed
            y = torch.where((torch.arange(t * k, device=x.device) < offs[-1])[:, None], y, 0.0)
        pairs = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order
        return pairs.view(t, k, -1).float().sum(dim=1).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Routers
# ---------------------------------------------------------------------------------------------


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / OLMoE routing: float32 softmax over experts, top-k, optional renormalisation.
    ``bias`` (LLaDA-MoE ``expert_bias``) is added to the probabilities before the top-k and the
    biased values are the weights, as in that reference. Returns float32 weights and int64 ids,
    both ``[T, K]``."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    if bias is not None:
        probs = probs + bias.float()
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk_ids(scores: torch.Tensor, top_k: int, n_group: int,
                     topk_group: int) -> torch.Tensor:
    """DeepSeek-V3 style group-limited selection: experts form ``n_group`` contiguous groups, a
    group's score is the sum of its two best experts, only the ``topk_group`` best groups stay
    eligible, then the ``top_k`` best eligible experts are taken. ``scores`` ``[T, E]``."""
    t, e = scores.shape
    if n_group <= 1:
        return torch.topk(scores, top_k, dim=-1).indices
    grouped = scores.view(t, n_group, e // n_group)  # [T, G, E/G]
    group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, e)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return torch.topk(masked, top_k, dim=-1).indices


def sigmoid_grouped_topk(router_logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                         selection_bias: torch.Tensor | None, renormalize: bool,
                         scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2 / Ling routing. Sigmoid scores; ``selection_bias`` (``expert_bias``) only decides
    which experts are chosen; the weights are the unbiased scores of the chosen experts,
    normalised (when ``renormalize`` and ``top_k > 1``) and then multiplied by
    ``scaling_factor``. float32 throughout."""
    scores = torch.sigmoid(router_logits.float())  # [T, E]
    for_choice = scores if selection_bias is None else scores + selection_bias.float()
    ids = grouped_topk_ids(for_choice, top_k, n_group, topk_group)
    weights = torch.gather(scores, 1, ids)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


# ---------------------------------------------------------------------------------------------
# Softmax-routed MoE block (Qwen3-MoE, SDAR-MoE, LLaDA-MoE)
# ---------------------------------------------------------------------------------------------


class SoftmaxMoE(UsesOps, nn.Module):
    """Router ``gate`` (``[E, H]``, no bias) + stacked experts, optional ``expert_bias`` and an
    optional always-on ``shared_expert`` added to the routed output."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, expert_bias: bool = False,
                 shared_intermediate_size: int | None = None):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias = None
        self.shared_expert = (SwiGLUMLP(hidden_size, shared_intermediate_size)
                              if shared_intermediate_size else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 weights and int64 expert ids, ``[T, K]``."""
        return self.ops.moe_route_softmax(self.gate(x), self.top_k, self.renormalize,
                                          self.expert_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.route(x)
        out = all_reduce(self.experts(x, ids, weights), self.experts.tp)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out
