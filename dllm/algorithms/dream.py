"""Dream's denoising schedules: ``origin``, ``maskgit_plus``, ``topk_margin``, ``entropy``, and
Fast-dLLM's ``confidence_threshold``.

Reference: Dream ``generation_utils.py`` (``DreamGenerationMixin._sample``,
``sample_tokens``), as Fast-dLLM ships it (``dream/model/generation_utils.py``). Dream decodes
the whole canvas as one block in exactly ``steps`` forwards with
``timesteps = linspace(1, eps, steps + 1)`` and ``eps = 1e-3``. At step ``i``
(``t = timesteps[i]``, ``s = timesteps[i + 1]``):

* ``origin``: each masked position is transferred independently with probability
  ``1 - s / t`` (1 on the last step), with a token from the sampler.
* the others transfer ``int(n * (1 - s / t))`` masked positions (``n`` masks left; all of
  them on the last step), ranked by a confidence: ``maskgit_plus`` the probability of the
  proposed token, ``topk_margin`` top-1 minus top-2 probability, ``entropy`` the negative
  entropy ``sum p log(p + 1e-10)``. The count may be 0 (no position moves that step; e.g. the
  first step when ``steps`` equals the number of masks). With ``alg_temp > 0`` the positions
  are drawn without replacement from ``softmax(confidence / alg_temp)`` (as Gumbel-top-k
  over the counter RNG) instead of taken greedily.

Dream's distribution (``dream_probs``): the logits divided by the temperature when it is
positive, then top-p, then top-k (filtered logits set to the float32 minimum), then a float32
softmax over the whole vocabulary: the filters apply at temperature 0 too, and the mask
token is a token like any other (a position whose proposal is the mask id stays masked).
The greedy proposal is the first maximum. Confidences are ranked as float32 values (the
reference's own quantity), ties to the lower position.

The schedule reproduces Dream's float32 arithmetic, with ``linspace`` evaluated as CUDA's
kernel does (``start + step * i`` in the first half, ``end - step * (steps - i)`` in the
second, each a fused multiply-add; the CPU kernel gives the same values for every step count
the vector tests use).

On CUDA with Triton, a batch whose rows are all greedy and unfiltered takes the proposal and
its confidence (the top probability for ``origin``, ``maskgit_plus`` and
``confidence_threshold``, the negative entropy for ``entropy``) from
:mod:`dllm.runner.kernels.dream_kernel`: the reference's element-wise float32 arithmetic,
its two sums in another fixed order (agreeing to float32 rounding, each row independent of
the batch), without the float32 ``[positions, vocab]`` tensors of the path below.

Deviation: the reference shares one count over a batch (from the batch-mean mask count);
here each request gets its own count, which is the reference's whenever the rows have equal
mask counts. Sampled draws use the counter RNG, not torch's.

Keys: ``steps`` (int, default 0 = block size), ``alg_temp`` (float >= 0, default 0; not
read by ``origin``); ``confidence_threshold`` reads ``steps`` and ``threshold``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from dllm.algorithms import vocab_parallel
from dllm.algorithms.base import DenoiseInput, DenoiseOutput, SamplingTensors, UnmaskingAlgorithm
from dllm.algorithms.rng import (
    Stream,
    counter_key,
    gumbel_from_uniform,
    position_uniform,
    unit_float32,
    vocab_bits,
)
from dllm.algorithms.selection import finish, masked_positions, rank_positions, select_top
from dllm.models.parallel import ShardedLogits
from dllm.runner.kernels import kernel_module

EPS = 1e-3


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


_END = _float32(EPS)
_SPAN = _float32(_END - 1.0)  # float32(end) - float32(start), rounded as float32 arithmetic


def dream_timestep(index: Tensor, steps: Tensor) -> Tensor:
    """``torch.linspace(1, EPS, steps + 1)[index]`` per row, as float32.

    CUDA's kernel computes ``start + step * i`` (first half) or ``end - step * (n - 1 - i)``
    with a fused multiply-add; float64 evaluation is exact here, so rounding it once to
    float32 reproduces the fused result."""
    # float32 division, correctly rounded (via float64), as the kernel's host code does it;
    # tensor/tensor keeps CUDA from multiplying by a reciprocal
    span = torch.full_like(steps, _SPAN, dtype=torch.float64)
    step = (span / steps.double()).to(torch.float32).double()
    first_half = index < (steps + 1) // 2
    value = torch.where(
        first_half, 1.0 + step * index.double(), _END - step * (steps - index).double()
    )
    return value.to(torch.float32)


def transfer_fraction(x: DenoiseInput) -> tuple[Tensor, Tensor]:
    """``(1 - s / t)`` as float32 and whether this is the last scheduled step, ``[bs]``. A
    step past the schedule moves nothing (fraction 0): Fast-dLLM's Dream block cache, whose
    block-start forward is step 0, ends a block of one scheduled step with such a forward.
    On CUDA with Triton, one launch of ``dream_kernel.dream_schedule`` (the same bits)."""
    steps = x.config["steps"]
    kernel = kernel_module("dream_kernel") if x.step.is_cuda else None
    if kernel is not None:
        return kernel.dream_schedule(x.step.contiguous(), steps.contiguous(), _SPAN, _END)
    last = x.step == steps - 1
    index = torch.minimum(x.step, steps - 1)
    t, s = dream_timestep(torch.stack([index, index + 1]), steps)  # one pass for both
    return torch.where(x.step >= steps, 0.0, 1.0 - s / t), last


def schedule_over(x: DenoiseInput) -> Tensor:
    """``[bs]`` bool: this is the last step of the schedule (or past it)."""
    return x.step + 1 >= x.config["steps"]


class _Scheduled(UnmaskingAlgorithm):
    """Dream's fixed schedules: the block ends at its last step (``schedule_over``)."""

    def surely_done(self, config: Mapping[str, Any], step: int) -> bool:
        return step + 1 >= config["steps"]

    def surely_continues(self, config: Mapping[str, Any], step: int, block_len: int) -> bool:
        return step + 1 < config["steps"]


def dream_probs(logits: Tensor, sampling: SamplingTensors) -> Tensor:
    """Dream's ``sample_tokens`` distribution per position (module docstring), float32;
    split logits give split probabilities (:mod:`dllm.algorithms.vocab_parallel`)."""
    if isinstance(logits, ShardedLogits):
        return vocab_parallel.dream_probs(logits, sampling)
    x = logits.float()
    bs = x.shape[0]
    t = sampling.temperature.float()
    x = x / torch.where(t > 0, t, 1.0).view(bs, 1, 1)
    if not sampling.may_filter_any:
        return torch.softmax(x, dim=-1)
    lowest = torch.finfo(torch.float32).min
    ordered, order = torch.sort(x, dim=-1, descending=True)
    top_p = sampling.top_p.float().view(bs, 1, 1)
    cumulative = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1)
    drop = torch.cat([torch.zeros_like(cumulative[..., :1], dtype=torch.bool),
                      cumulative[..., :-1] > top_p], dim=-1) & (top_p < 1)
    x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), lowest)
    # top-k over the top-p-filtered logits: their k-th largest, read off the same sort
    k = sampling.top_k.clamp(0, x.shape[-1]).view(bs, 1, 1)
    kth_at = (k - 1).clamp(min=0).expand(bs, x.shape[1], 1)
    kth = torch.where(drop.gather(-1, kth_at), lowest, ordered.gather(-1, kth_at))
    x = x.masked_fill((x < kth) & (k > 0), lowest)
    return torch.softmax(x, dim=-1)


def dream_propose(probs: Tensor, sampling: SamplingTensors, step: Tensor,
                  positions: Tensor) -> Tensor:
    """``[bs, B]`` the proposed token: the first maximum of ``probs``, or for a sampling
    row a Gumbel-max draw from them with the counter RNG."""
    if isinstance(probs, ShardedLogits):
        return vocab_parallel.dream_propose(probs, sampling, step, positions)
    greedy = probs.argmax(dim=-1)
    if not sampling.may_sample:
        return greedy
    bits = vocab_bits(counter_key(sampling.seed, step, positions, Stream.TOKEN),
                      probs.shape[-1])
    drawn = (torch.log(probs) + gumbel_from_uniform(unit_float32(bits))).argmax(dim=-1)
    return torch.where((sampling.temperature > 0)[:, None], drawn, greedy)


def _propose(x: DenoiseInput) -> tuple[Tensor, Tensor]:
    probs = dream_probs(x.logits, x.sampling)
    return probs, dream_propose(probs, x.sampling, x.step, x.positions)


def _greedy_kernel(x: DenoiseInput, entropy: bool
                   ) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """``(x0, p(x0), neg entropy or None)`` from one pass of launches over CUDA logits when
    every row is greedy and unfiltered and Triton is installed
    (:mod:`dllm.runner.kernels.dream_kernel`: the reference's element-wise arithmetic, its
    sums in another fixed order); None elsewhere (``dream_probs`` and the reductions)."""
    logits, sampling = x.logits, x.sampling
    if (isinstance(logits, ShardedLogits) or not logits.is_cuda or sampling.may_sample
            or sampling.may_filter_any):
        return None
    kernel = kernel_module("dream_kernel")
    if kernel is None or not kernel.supports(logits):
        return None
    return kernel.dream_greedy(logits, entropy)


def _propose_ranked(x: DenoiseInput, fused: str | None,
                    confidence: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """``(x0, confidence)``: the greedy kernel's proposal and its ``fused`` output (``"top"``,
    the proposal's probability, or ``"entropy"``) where the kernel applies, else (and for
    ``fused`` None) the reference path's proposal and ``confidence(probs, x0)``."""
    if fused and (out := _greedy_kernel(x, fused == "entropy")) is not None:
        x0, top, negent = out
        return x0, negent if fused == "entropy" else top
    probs, x0 = _propose(x)
    return x0, confidence(probs, x0)


class DreamOrigin(_Scheduled):
    """Dream ``alg="origin"``: independent per-position transfers (module docstring), the
    per-position coin a counter-RNG uniform; a step may transfer nothing."""

    name = "origin"
    defaults = {"steps": 0}

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        fraction, last = transfer_fraction(x)
        p = torch.where(last, 1.0, fraction)
        u = position_uniform(x.sampling.seed, x.step, x.positions, Stream.POSITION)
        transfer = masked & (u < p[:, None])
        x0, top = _propose_ranked(x, "top", vocab_parallel.prob_of)
        out = finish(x, x0, transfer, masked, confidence=top)
        out.done = schedule_over(x)
        return out


class _DreamRanked(_Scheduled):
    """Shared body of Dream's confidence-ranked schedules."""

    defaults = {"steps": 0, "alg_temp": 0.0}
    # which of the greedy kernel's outputs is ``confidence`` (None: the kernel has none)
    fused: str | None = None

    def confidence(self, probs: Tensor, x0: Tensor) -> Tensor:
        """Dream's confidence of each position, ``[bs, B]`` float32."""
        raise NotImplementedError

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        num_masked = masked.sum(dim=-1)
        fraction, last = transfer_fraction(x)
        count = (num_masked.to(torch.float32) * fraction).to(torch.int64)
        count = torch.where(last, num_masked, count)

        x0, confidence = _propose_ranked(x, self.fused, self.confidence)
        alg_temp = x.config["alg_temp"]
        sampled = alg_temp > 0
        gumbel = gumbel_from_uniform(
            position_uniform(x.sampling.seed, x.step, x.positions, Stream.ORDER)
        )
        drawn = confidence / torch.where(sampled, alg_temp, 1.0)[:, None] + gumbel
        key = torch.where(sampled[:, None], drawn, confidence)
        out = finish(x, x0, select_top(key, masked, count), masked, confidence=confidence)
        out.done = schedule_over(x)
        return out


class DreamMaskGitPlus(_DreamRanked):
    """Dream ``alg="maskgit_plus"``: rank by the proposed token's probability."""

    name = "maskgit_plus"
    fused = "top"

    def confidence(self, probs: Tensor, x0: Tensor) -> Tensor:
        return vocab_parallel.prob_of(probs, x0)


class DreamTopkMargin(_DreamRanked):
    """Dream ``alg="topk_margin"``: rank by top-1 minus top-2 probability."""

    name = "topk_margin"

    def confidence(self, probs: Tensor, x0: Tensor) -> Tensor:
        return vocab_parallel.top2_margin(probs)


class DreamEntropy(_DreamRanked):
    """Dream ``alg="entropy"``: rank by negative entropy ``sum p log(p + 1e-10)``."""

    name = "entropy"
    fused = "entropy"

    def confidence(self, probs: Tensor, x0: Tensor) -> Tensor:
        return vocab_parallel.neg_entropy(probs)


class DreamConfidenceThreshold(UnmaskingAlgorithm):
    """Fast-dLLM's Dream ``alg="confidence_threshold"`` (``generation_utils.py``): a quota of
    ``masks // steps`` per step (``masks`` counted at the start); each step takes the
    ``quota + carried`` most confident masked positions (Dream's ``maskgit_plus``
    confidence), commits the best always and the others unless ``conf < threshold``, and
    carries the rest to the next step. A rejection on the last scheduled step sets the quota
    to 0 from then on and adds exactly one step (the carried positions are then the whole
    quota); the block ends when the (extended) steps are used up.

    Keys: ``steps`` (int, default 0 = block size), ``threshold`` (float in [0, 1], default
    0.9). State: ``carry`` (positions deferred by the last step), ``extra_steps`` (steps
    added; the quota is 0 once it is positive). Ties: lower position first.
    """

    name = "confidence_threshold"
    defaults = {"steps": 0, "threshold": 0.9}
    state_keys = ("carry", "extra_steps")

    def surely_continues(self, config: Mapping[str, Any], step: int, block_len: int) -> bool:
        return step + 1 < config["steps"]  # added steps only come after the scheduled ones

    def validate(self, config: Mapping[str, Any], block_size: int) -> dict:
        out = super().validate(config, block_size)
        if block_size % out["steps"]:
            raise ValueError(f"'steps' = {out['steps']} must divide the block's {block_size} "
                             "masks for confidence_threshold (as its reference asserts)")
        return out

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        steps = x.config["steps"] + x.state["extra_steps"]
        base = x.num_initial_masks // x.config["steps"].clamp(min=1)
        quota = torch.where(x.state["extra_steps"] > 0, 0, base) + x.state["carry"]
        x0, confidence = _propose_ranked(x, "top", vocab_parallel.prob_of)
        rank = rank_positions(confidence, masked)
        chosen = (rank < quota[:, None]) & masked
        rejected = chosen & (rank > 0) & (confidence < x.config["threshold"][:, None])
        deferred = rejected.sum(dim=-1)
        extend = (x.step >= steps - 1) & (deferred > 0)
        extra = x.state["extra_steps"] + extend.to(torch.int64)
        out = finish(x, x0, chosen & ~rejected, masked,
                     done=x.step + 1 >= x.config["steps"] + extra,
                     state={"carry": deferred, "extra_steps": extra}, confidence=confidence)
        return out
