"""Per-position token sampling for a denoise step: temperature, top-k, top-p, and a
counter-based Gumbel-max draw (see :mod:`dllm.algorithms.rng`).

Rules, per row (request):

* Temperature 0 is greedy: ``x0 = argmax(logits)``, ties to the lowest vocab id; top-k and
  top-p are ignored (they never remove the argmax). Confidence is the plain softmax.
* Temperature > 0: logits are divided by the temperature, then top-k, then top-p filter
  them (the SDAR / LLaDA2 order; Dream applies top-p first), then ``x0`` is the argmax of
  ``filtered + Gumbel`` with Gumbel noise from the counter RNG. Confidence is the
  probability of ``x0`` under the temperature-scaled, filtered, renormalised softmax.
* Filters are value based: top-k keeps every logit ``>=`` the k-th largest and top-p keeps
  the sorted prefix whose exclusive cumulative probability is ``<= p`` plus every logit tied
  with its last member, so ties never depend on sort order.
* ``gumbel_fp64`` rows (LLaDA's sampler): the draw is LLaDA's
  ``argmax(exp(logits) / (-log u) ** T)`` over the un-scaled logits (restricted to the
  top-k/top-p set) with a 52-bit ``u``, evaluated in float64 as its logarithm
  ``logits - T * log(-log u)`` (same argmax, no overflow, cheaper), and confidence is the
  plain (un-tempered, unfiltered) softmax, as in LLaDA's low-confidence remasking.

Precision: softmax statistics are float32. Log-probabilities are ``(l - max) - log1p(S)``
(``log_probs``), so the argmax's is ``-log1p(S)`` to float32 precision: a confidence of
``1 - 1e-9`` keeps a distinct, ordered log-probability even though it rounds to 1.0 as a
float32 probability; algorithms rank by the log-probability. Sums and prefix sums run in a fixed order
(:mod:`dllm.algorithms.reductions`), so every output of a row is bit-identical whether the
row runs alone or in any batch, on CPU and CUDA.

Cost: with ``SamplingTensors.may_filter`` the vocabulary is sorted per position; with
``may_sample`` a 32-bit hash is computed per (position, vocab id). A batch whose host-side
flags are False skips that work. A batch with no sampling row on CUDA (with Triton) takes the
greedy draw and its confidence in one pass over the logits
(:mod:`dllm.runner.kernels.greedy_kernel`: the same function, its sum in another fixed order, so
it agrees with the reference to float32 rounding and is still independent of the batch);
``logprobs`` are then computed only if an algorithm reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dllm.algorithms.base import SamplingTensors
from dllm.algorithms.reductions import fixed_order_cumsum, fixed_order_sum
from dllm.algorithms.rng import (
    Stream,
    counter_key,
    gumbel_from_uniform,
    unit_float32,
    unit_float64,
    vocab_bits,
)
from dllm.models.parallel import ShardedLogits
from dllm.runner.kernels import kernel_module

_NEG_INF = float("-inf")


class SampleOutput:
    """``x0 [bs, B]`` int64 proposed token per position; ``log_conf [bs, B]`` float32 its
    log-probability (the ranking key); ``confidence`` its probability; ``logprobs
    [bs, B, V]`` float32 the log-probabilities of the distribution ``confidence`` uses,
    computed on first use where the draw did not need them (the fused greedy draw); over
    logits split by vocabulary (tensor parallelism) they are not available: use ``log_conf``,
    ``entropy()`` or ``vocab_parallel.token_logprob``."""

    def __init__(self, x0: Tensor, log_conf: Tensor,
                 logprobs: Tensor | Callable[[], Tensor]):
        self.x0 = x0
        self.log_conf = log_conf
        self.confidence = log_conf.exp()
        self._logprobs = logprobs

    @property
    def logprobs(self) -> Tensor:
        if callable(self._logprobs):
            self._logprobs = self._logprobs()
        return self._logprobs

    def entropy(self) -> Tensor:
        """``[bs, B]`` entropy (nats) of the distribution ``confidence`` uses."""
        return entropy(self.logprobs)


def sample_tokens(
    logits: Tensor,
    sampling: SamplingTensors,
    positions: Tensor,
    step: Tensor,
    *,
    exclude_id: int | None = None,
    gumbel_fp64: Tensor | None = None,
    unfiltered_confidence: Tensor | None = None,
) -> SampleOutput:
    """Sample one token per position. ``logits [bs, B, V]`` (any float dtype),
    ``positions [bs, B]`` absolute positions, ``step [bs]`` denoise step.

    ``exclude_id`` (a token) is never proposed; the algorithms named after a reference pass
    none (the references keep the mask token in the vocabulary). ``gumbel_fp64 [bs] bool``
    switches rows to LLaDA's float64 sampler (module docstring). ``unfiltered_confidence
    [bs] bool`` rows take their confidence (and ``logprobs``) from the tempered softmax before
    top-k / top-p, the token still drawn from the filtered one (SDAR's evaluation
    wrapper).

    Logits split over the vocabulary (``ShardedLogits``, tensor parallelism) take the same
    rules without gathering them (:mod:`dllm.algorithms.vocab_parallel`)."""
    if isinstance(logits, ShardedLogits):
        from dllm.algorithms import vocab_parallel  # it builds on this module

        return vocab_parallel.sample_tokens(logits, sampling, positions, step, exclude_id,
                                            gumbel_fp64, unfiltered_confidence)
    if not sampling.may_sample and (fused := _greedy_kernel(logits)) is not None:
        x0, log_conf = fused(logits, exclude_id)
        return SampleOutput(x0, log_conf, lambda: _plain_logprobs(logits, exclude_id))
    raw = logits.float()
    bs, block, vocab = raw.shape
    sample_row = sampling.temperature > 0
    temperature = torch.where(sample_row, sampling.temperature.float(), 1.0)
    top_k = torch.where(sample_row, sampling.top_k, 0)
    top_p = torch.where(sample_row, sampling.top_p.float(), 1.0)

    # Greedy rows divide by 1 (exact); a batch with no sampling row skips that pass (and
    # copies only float32 logits, which ``float()`` does not: the mask column is set below).
    if sampling.may_sample:
        scaled = raw / temperature[:, None, None]
    else:
        scaled = raw.clone() if raw is logits else raw
    if exclude_id is not None:
        scaled[..., exclude_id] = _NEG_INF
    filtered = scaled
    if sampling.may_filter:
        filtered = scaled.masked_fill(~_filter_mask(scaled, top_k, top_p), _NEG_INF)
    logprobs = log_probs(filtered)
    if unfiltered_confidence is not None and sampling.may_filter:
        logprobs = torch.where(unfiltered_confidence[:, None, None], log_probs(scaled), logprobs)

    if not sampling.may_sample:
        x0 = filtered.argmax(dim=-1)
    else:
        bits = vocab_bits(counter_key(sampling.seed, step, positions, Stream.TOKEN), vocab)
        gumbel = gumbel_from_uniform(unit_float32(bits))
        x0 = (filtered + gumbel * sample_row[:, None, None]).argmax(dim=-1)
        if gumbel_fp64 is not None:
            x0, logprobs = _llada_fp64(
                raw, filtered, bits, sampling, positions, step, temperature, exclude_id,
                gumbel_fp64 & sample_row, x0, logprobs,
            )  # fmt: skip

    return SampleOutput(x0, logprobs.gather(-1, x0[..., None]).squeeze(-1), logprobs)


def _greedy_kernel(logits: Tensor) -> Callable | None:
    """The one-pass greedy draw for CUDA logits when Triton is installed; None elsewhere
    (the reference path below)."""
    kernel = kernel_module("greedy_kernel") if logits.is_cuda else None
    return kernel.greedy_log_confidence if kernel and kernel.supports(logits) else None


def _plain_logprobs(logits: Tensor, exclude_id: int | None) -> Tensor:
    """The greedy rows' log-probabilities (plain softmax, ``exclude_id`` removed)."""
    x = logits.float().clone()
    if exclude_id is not None:
        x[..., exclude_id] = _NEG_INF
    return log_probs(x)


def log_confidence(sample: SampleOutput) -> Tensor:
    """``[bs, B]`` float32 log-probability of ``x0``: the ranking key for confidence."""
    return sample.log_conf


def entropy(logprobs: Tensor) -> Tensor:
    """``[bs, B]`` Shannon entropy (nats) of each position's distribution."""
    return fixed_order_sum(torch.special.entr(logprobs.exp()))


def _shifted_and_log1p(logits: Tensor) -> tuple[Tensor, Tensor]:
    """``(logits - max, log1p(S))`` with ``S`` the sum of ``exp(logit - max)`` over every id
    but the (first) argmax, summed in a fixed order."""
    top, top_idx = logits.max(dim=-1, keepdim=True)
    shifted = logits - top
    rest = torch.exp(shifted)
    rest.scatter_(-1, top_idx, 0.0)
    return shifted, torch.log1p(fixed_order_sum(rest))


def log_probs(logits: Tensor) -> Tensor:
    """Log-softmax over the last dim as ``(l - max) - log1p(S)``. The argmax's
    log-probability is ``-log1p(S)`` exactly: a confidence of ``1 - 1e-9`` keeps its own
    value. (``l - (max + log1p(S))`` would round ``log1p(S)`` to a multiple of ``ulp(max)``,
    so every confidence within ~1e-6 of 1 would tie.)"""
    shifted, log1p = _shifted_and_log1p(logits)
    return shifted - log1p[..., None]


def log_normalizer(logits: Tensor) -> Tensor:
    """``logsumexp`` over the last dim as ``max + log1p(sum of the rest)``."""
    shifted, log1p = _shifted_and_log1p(logits)
    return logits.max(dim=-1).values + log1p


def _filter_mask(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """``[bs, B, V]`` bool: the top-k then top-p support of each row (value based)."""
    bs, block, vocab = scaled.shape
    ordered = torch.sort(scaled, dim=-1, descending=True).values
    k = top_k.clamp(0, vocab)
    kth_index = (k.clamp(min=1) - 1)[:, None, None].expand(bs, block, 1)
    kth = torch.where((k > 0)[:, None, None], ordered.gather(-1, kth_index), _NEG_INF)
    in_k = ordered >= kth
    mass = torch.exp(ordered - ordered[..., :1]) * in_k
    cumulative = fixed_order_cumsum(mass)
    before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
    p = top_p[:, None, None]
    in_p = (before <= p * cumulative[..., -1:]) | (p >= 1.0)
    kept = (in_k & in_p).sum(dim=-1, keepdim=True)
    cutoff = ordered.gather(-1, kept - 1)
    return scaled >= cutoff


def _llada_fp64(
    raw: Tensor,
    filtered: Tensor,
    bits: Tensor,
    sampling: SamplingTensors,
    positions: Tensor,
    step: Tensor,
    temperature: Tensor,
    exclude_id: int | None,
    rows: Tensor,
    x0: Tensor,
    logprobs: Tensor,
) -> tuple[Tensor, Tensor]:
    """LLaDA's ``add_gumbel_noise`` draw and plain-softmax confidence for ``rows``."""
    low = vocab_bits(counter_key(sampling.seed, step, positions, Stream.TOKEN_LOW), raw.shape[-1])
    u = unit_float64(bits, low)
    t = temperature.double()[:, None, None]
    score = raw.double() - t * torch.log(-torch.log(u))
    score = torch.where(filtered > _NEG_INF, score, _NEG_INF)
    x0 = torch.where(rows[:, None], score.argmax(dim=-1), x0)
    plain = raw.clone()
    if exclude_id is not None:
        plain[..., exclude_id] = _NEG_INF
    plain_logprobs = log_probs(plain)
    return x0, torch.where(rows[:, None, None], plain_logprobs, logprobs)
