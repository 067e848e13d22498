"""Unmasking over logits split by vocabulary (tensor parallelism), without gathering them.

Under tensor parallelism each rank's LM head gives its own columns of the logits
(:class:`dllm.models.parallel.ShardedLogits`). Every quantity an unmasking algorithm reads is
a reduction over the vocabulary, so each rank reduces its columns to a few numbers per
position and the ranks exchange those (one ``all_gather`` of ``[bs, B, F]`` with ``F`` ≤ 15),
never the ``bs × B × vocab`` logits:

* **Softmax statistics** of a distribution ``y``: the rank's maximum ``m``, its first argmax
  (a global vocabulary id) and ``s``, the sum of ``exp(y - m)`` over its other columns. The
  global maximum ``M`` is the largest ``m``; the argmax is the first rank's that holds it
  (shards are contiguous in rank order, so ties go to the lowest vocabulary id, as
  ``torch.argmax``); the sum over every id but the argmax is
  ``S = Σ_r exp(m_r - M) (s_r + [r is not the winner])``. A token's log-probability is
  ``(y_tok - M) - log1p(S)``, the single-process form (``sampling.log_probs``), so a
  confidence of ``1 - 1e-9`` keeps its own value here too.
* **The draw**: the Gumbel noise of a column is keyed on its *global* id (``vocab_bits`` with
  the shard's offset), so each rank's ``argmax(filtered + noise)`` over its columns, and the
  value there, decide the global draw exactly as the whole-vocabulary argmax would: the
  tokens do not depend on the tensor-parallel size.
* **Entropy** ``H = log1p(S) - A / (1 + S)`` with ``A = Σ exp(y - M)(y - M)``: one
  ``all_reduce`` of ``[bs, B]`` after the statistics (computed only when an algorithm asks).
* **Top-k / top-p** need order statistics of the whole vocabulary. They are found exactly by
  a search over the float32 values' order-preserving 32-bit keys: the ``k``-th largest value
  is the smallest ``t`` with fewer than ``k`` values above it, and the top-p cutoff (the
  filters are value based, :mod:`dllm.algorithms.sampling`) is the smallest value ``t`` whose
  strictly-larger mass is at most ``p`` times the total (the same set as the sorted prefix
  whose exclusive cumulative mass is ``<= p``). Each round tries 7 thresholds and is one
  ``all_reduce`` of ``[bs, B, 7]`` counts or sums; 11 rounds settle the 2**32 keys, so
  top-k then top-p cost 22 small exchanges (plus the maximum and the total), run only when
  the host knows a sampled row filters (``SamplingTensors.may_filter``).
* **Dream's** distribution (:func:`dllm.algorithms.dream.dream_probs`) is the same filters
  then a softmax: each rank keeps its columns of the probabilities (another split tensor) and
  the confidences (the proposal's probability, the top-2 margin: each rank's two largest
  probabilities, the negative entropy) are per-row reductions of it.

Sums differ from the single-process ones in their order (by float32 rounding, as the tensor-
parallel logits themselves do); ties and decisions that do not sit on a rounding boundary come
out the same, which the tests check for every algorithm at 2 and 3 ranks. The one-pass greedy
CUDA kernel is not used on split logits. ``token_logprob`` is the log-probability of given
tokens (the plain softmax) over whole or split logits, for callers that report them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dllm.algorithms.base import SamplingTensors
from dllm.algorithms.reductions import fixed_order_sum
from dllm.algorithms.rng import (
    Stream,
    counter_key,
    gumbel_from_uniform,
    unit_float32,
    unit_float64,
    vocab_bits,
)
from dllm.algorithms.sampling import SampleOutput, log_probs
from dllm.models.parallel import ShardedLogits, TensorParallel, all_gather_stack, all_reduce

_NEG_INF = float("-inf")
_KEY_LOW, _KEY_HIGH = -(2**31), 2**31 - 1


# ---- the exchange ---------------------------------------------------------------------------
def _exchange(fields: list[Tensor], tp: TensorParallel) -> list[Tensor]:
    """``[bs, B]`` per-rank fields → ``[size, bs, B]`` each (float64 carries float32 values
    and vocabulary ids exactly), in one ``all_gather``."""
    ranks = all_gather_stack(torch.stack([f.double() for f in fields], dim=-1), tp)
    return list(ranks.unbind(-1))


def _pick(ranks: Tensor, winner: Tensor) -> Tensor:
    """``ranks [size, bs, B]`` at each position's ``winner [bs, B]`` rank."""
    return ranks.gather(0, winner[None])[0]


def _local_stats(y: Tensor, start: int) -> list[Tensor]:
    """``[m, global argmax, s]`` of this rank's columns of ``y [bs, B, W]`` (float32)."""
    m, a = y.max(dim=-1)
    finite = m > _NEG_INF
    rest = torch.exp(y - torch.where(finite, m, 0.0)[..., None])
    rest.scatter_(-1, a[..., None], 0.0)
    return [m, a + start, torch.where(finite, fixed_order_sum(rest), 0.0)]


class Stats:
    """Global softmax statistics of one distribution from the ranks' ``[m, argmax, s]``:
    ``max``, ``argmax`` (int64, ties to the lowest id) and ``log1p`` (of the sum of
    ``exp(y - max)`` over every id but the argmax), each ``[bs, B]``."""

    def __init__(self, m: Tensor, a: Tensor, s: Tensor):
        m, s = m.float(), s.float()
        self.max = m.max(dim=0).values
        winner = m.argmax(dim=0)  # the first rank holding the maximum
        self.argmax = _pick(a, winner).to(torch.int64)
        finite = (m > _NEG_INF) & (self.max > _NEG_INF)
        weight = torch.where(finite, torch.exp(m - torch.where(finite, self.max, 0.0)), 0.0)
        ranks = torch.arange(m.shape[0], device=m.device)[:, None, None]
        others = (ranks != winner[None]).to(s.dtype)
        self.log1p = torch.log1p((weight * (s + others)).sum(dim=0))

    def log_prob(self, value: Tensor) -> Tensor:
        """Log-probability of a token whose value in ``y`` is ``value [bs, B]``."""
        return (value.float() - self.max) - self.log1p


def _local_argmax(z: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """Value and global id of each position's first maximum over this rank's columns."""
    value, index = z.max(dim=-1)
    return value, index + start


def _at(y: Tensor, local_index: Tensor) -> Tensor:
    return y.gather(-1, local_index[..., None]).squeeze(-1)


# ---- order statistics by bisection -----------------------------------------------------------
def _float_key(x: Tensor) -> Tensor:
    """float32 → int64 keys in ``[-2**31, 2**31)`` with the same order (an involution on the
    negative half)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -bits + _KEY_LOW - 1, bits)


def _key_float(key: Tensor) -> Tensor:
    bits = torch.where(key < 0, -key + _KEY_LOW - 1, key)
    return bits.to(torch.int32).view(torch.float32)


_WAYS = 8  # thresholds tried per exchange: 7 per round, 11 rounds over the 2**32 keys
_ROUNDS = 11


def _smallest_key(key: Tensor, weight: Tensor | None, bound: Tensor,
                  tp: TensorParallel) -> Tensor:
    """``[bs, B]`` int64: the smallest key ``t`` whose strictly-larger entries over the whole
    vocabulary weigh at most ``bound`` (``weight`` None: count). ``_WAYS - 1`` thresholds per
    round and one ``all_reduce`` of ``[bs, B, _WAYS - 1]`` each: the interval shrinks
    ``_WAYS``-fold a round (``hi - lo`` becomes at most ``(hi - lo) // _WAYS``)."""
    lo = torch.full(bound.shape, _KEY_LOW, dtype=torch.int64, device=key.device)
    hi = torch.full_like(lo, _KEY_HIGH)
    j = torch.arange(1, _WAYS, device=key.device)
    for _ in range(_ROUNDS):
        t = lo[..., None] + ((hi - lo)[..., None] * j) // _WAYS  # [bs, B, ways - 1]
        parts = []
        for i in range(_WAYS - 1):
            above = key > t[..., i, None]
            parts.append(above.sum(dim=-1) if weight is None
                         else fixed_order_sum(weight * above))
        ok = all_reduce(torch.stack(parts, dim=-1), tp) <= bound[..., None]  # monotone in j
        first = torch.where(ok.any(dim=-1), ok.to(torch.int64).argmax(dim=-1), _WAYS - 1)
        last_false = first - 1  # the threshold before the first true one (-1: none)
        hi = torch.where(first < _WAYS - 1, t.gather(-1, first.clamp(max=_WAYS - 2)[..., None])
                         [..., 0], hi)
        lo = torch.where(last_false >= 0, t.gather(-1, last_false.clamp(min=0)[..., None])
                         [..., 0] + 1, lo)
    return lo


def _kth_largest(key: Tensor, k: Tensor, tp: TensorParallel) -> Tensor:
    """``[bs, B]`` float32: the ``k``-th largest value over the whole vocabulary (``-inf``
    where ``k`` is 0): the smallest key with fewer than ``k`` entries above it."""
    k = k[:, None].expand(key.shape[:-1])
    found = _key_float(_smallest_key(key, None, k - 1, tp))
    return torch.where(k > 0, found, _NEG_INF)


def _mass_cutoff(key: Tensor, mass: Tensor, bound: Tensor, tp: TensorParallel) -> Tensor:
    """``[bs, B]`` float32: the smallest value ``t`` whose strictly-larger ``mass`` (summed
    over the whole vocabulary) is at most ``bound``: a value of the support, and exactly the
    last value of the sorted prefix whose exclusive cumulative mass is ``<= bound``."""
    return _key_float(_smallest_key(key, mass, bound, tp))


def _global_max(y: Tensor, tp: TensorParallel) -> Tensor:
    return all_reduce(y.max(dim=-1).values.contiguous(), tp, op="max")


def filter_mask(scaled: Tensor, top_k: Tensor, top_p: Tensor, vocab_size: int,
                tp: TensorParallel) -> Tensor:
    """This rank's columns of ``sampling._filter_mask`` (top-k then top-p, value based)."""
    key = _float_key(scaled)
    kth = _kth_largest(key, top_k.clamp(0, vocab_size), tp)
    in_k = scaled >= kth[..., None]
    mass = torch.exp(scaled - _global_max(scaled, tp)[..., None]) * in_k
    total = all_reduce(fixed_order_sum(mass), tp)
    p = top_p.float()[:, None]
    cutoff = torch.where(p >= 1.0, kth, torch.maximum(kth, _mass_cutoff(key, mass, p * total, tp)))
    return scaled >= cutoff[..., None]


# ---- the shared sampler ----------------------------------------------------------------------
class ShardedSample(SampleOutput):
    """``sample_tokens``' output over split logits: ``x0`` and ``log_conf`` as there; the
    entropy of the distribution ``confidence`` uses from one more ``all_reduce``; the whole
    ``logprobs`` are not available (they would be the gathered logits)."""

    def __init__(self, x0: Tensor, log_conf: Tensor, dists: list[tuple[Tensor, Tensor, Stats]],
                 tp: TensorParallel):
        super().__init__(x0, log_conf, self._no_logprobs)
        self._dists, self._tp = dists, tp

    @staticmethod
    def _no_logprobs() -> Tensor:
        raise RuntimeError("the whole log-probabilities are not gathered under tensor "
                           "parallelism; use SampleOutput.entropy() or "
                           "vocab_parallel.token_logprob")

    def entropy(self) -> Tensor:
        """``[bs, B]`` nats: ``log1p(S) - A / (1 + S)`` of each row's distribution."""
        parts = []
        for _, y, st in self._dists:
            shifted = y - st.max[..., None]
            finite = y > _NEG_INF
            parts.append(fixed_order_sum(torch.where(finite, torch.exp(shifted) * shifted, 0.0)))
        a = all_reduce(torch.stack(parts), self._tp)
        h = None
        for (rows, _, st), ai in zip(self._dists, a, strict=True):
            hi = st.log1p - ai / torch.exp(st.log1p)
            h = hi if h is None else torch.where(rows[:, None], hi, h)
        return h


def sample_tokens(logits: ShardedLogits, sampling: SamplingTensors, positions: Tensor,
                  step: Tensor, exclude_id: int | None, gumbel_fp64: Tensor | None,
                  unfiltered_confidence: Tensor | None) -> ShardedSample:
    """``dllm.algorithms.sampling.sample_tokens`` over split logits (same arguments, same
    rules): the filters by bisection, one exchange of statistics and local draws."""
    tp, start = logits.tp, logits.start
    raw = logits.local.float()
    bs, block, width = raw.shape
    sample_row = sampling.temperature > 0
    temperature = torch.where(sample_row, sampling.temperature.float(), 1.0)
    scaled = raw / temperature[:, None, None] if sampling.may_sample else raw.clone()
    plain = raw
    local_exclude = None
    if exclude_id is not None and start <= exclude_id < start + width:
        local_exclude = exclude_id - start
        scaled[..., local_exclude] = _NEG_INF
    filtered = scaled
    if sampling.may_filter:
        top_k = torch.where(sample_row, sampling.top_k, 0)
        top_p = torch.where(sample_row, sampling.top_p.float(), 1.0)
        filtered = scaled.masked_fill(
            ~filter_mask(scaled, top_k, top_p, logits.vocab_size, tp), _NEG_INF)

    fields = _local_stats(filtered, start)  # 0-2
    unfiltered = unfiltered_confidence is not None and sampling.may_filter
    if unfiltered:
        fields += _local_stats(scaled, start)  # 3-5
    fp64 = gumbel_fp64 is not None and sampling.may_sample
    if fp64:
        plain = raw.clone()
        if local_exclude is not None:
            plain[..., local_exclude] = _NEG_INF
        fields += _local_stats(plain, start)  # 6-8 (or 3-5)
    draw_at = len(fields)
    if sampling.may_sample:
        key = counter_key(sampling.seed, step, positions, Stream.TOKEN)
        bits = vocab_bits(key, width, start)
        z = filtered + gumbel_from_uniform(unit_float32(bits)) * sample_row[:, None, None]
        value, index = _local_argmax(z, start)
        fields += [value, index, _at(filtered, index - start)]
        if fp64:
            low = vocab_bits(counter_key(sampling.seed, step, positions, Stream.TOKEN_LOW),
                             width, start)
            score = raw.double() - temperature.double()[:, None, None] * torch.log(
                -torch.log(unit_float64(bits, low)))
            score = torch.where(filtered > _NEG_INF, score, _NEG_INF)
            value, index = _local_argmax(score, start)
            fields += [value, index, _at(plain, index - start)]

    ranks = _exchange(fields, tp)
    filt = Stats(*ranks[0:3])
    dists = [(torch.ones(bs, dtype=torch.bool, device=raw.device), filtered, filt)]
    if not sampling.may_sample:  # the greedy draw: the argmax, whose log-probability is -log1p
        x0, value = filt.argmax, filt.max
    else:
        winner = ranks[draw_at].argmax(dim=0)
        x0 = _pick(ranks[draw_at + 1], winner).to(torch.int64)
        value = _pick(ranks[draw_at + 2], winner)
    log_conf = filt.log_prob(value)
    if unfiltered:  # a kept token has the same value in ``scaled``
        st = Stats(*ranks[3:6])
        log_conf = torch.where(unfiltered_confidence[:, None], st.log_prob(value), log_conf)
        dists.append((unfiltered_confidence, scaled, st))
    if fp64:
        st = Stats(*ranks[draw_at - 3 : draw_at])
        winner = ranks[draw_at + 3].argmax(dim=0)
        rows = (gumbel_fp64 & sample_row)[:, None]
        x0 = torch.where(rows, _pick(ranks[draw_at + 4], winner).to(torch.int64), x0)
        plain_conf = st.log_prob(_pick(ranks[draw_at + 5], winner))
        log_conf = torch.where(rows, plain_conf, log_conf)
        dists.append((gumbel_fp64 & sample_row, plain, st))
    return ShardedSample(x0, log_conf, dists, tp)


def token_logprob(logits: Tensor | ShardedLogits, tokens: Tensor,
                  exclude_id: int | None = None) -> Tensor:
    """``[bs, B]`` float32 log-probability of ``tokens [bs, B]`` under the plain softmax of
    ``logits [bs, B, V]`` (``exclude_id`` removed), whole or split: ``logit[tok] - logsumexp``
    in ``sampling.log_probs``' form; split logits exchange ``[m, argmax, s, logit[tok]]``."""
    if not isinstance(logits, ShardedLogits):
        x = logits.float().clone()
        if exclude_id is not None:
            x[..., exclude_id] = _NEG_INF
        return log_probs(x).gather(-1, tokens[..., None]).squeeze(-1)
    start, width = logits.start, logits.width
    x = logits.local.float().clone()
    if exclude_id is not None and start <= exclude_id < start + width:
        x[..., exclude_id - start] = _NEG_INF
    inside = (tokens >= start) & (tokens < start + width)
    value = torch.where(inside, _at(x, (tokens - start).clamp(0, width - 1)), _NEG_INF)
    ranks = _exchange([*_local_stats(x, start), value], logits.tp)
    return Stats(*ranks[:3]).log_prob(ranks[3].max(dim=0).values)


# ---- Dream's distribution --------------------------------------------------------------------
def _max_and_sum(x: Tensor, tp: TensorParallel) -> tuple[Tensor, Tensor]:
    """Global ``max`` and ``Σ exp(x - max)`` (float32 ``[bs, B]``)."""
    m = x.max(dim=-1).values
    s = fixed_order_sum(torch.exp(x - m[..., None]))
    ms, ss = (r.float() for r in _exchange([m, s], tp))
    top = ms.max(dim=0).values
    return top, (torch.exp(ms - top) * ss).sum(dim=0)


def dream_probs(logits: ShardedLogits, sampling: SamplingTensors) -> ShardedLogits:
    """This rank's columns of ``dream.dream_probs`` (temperature, top-p, then top-k, filtered
    logits set to the float32 minimum, softmax), as a split tensor of probabilities. Top-p
    keeps every value tied with the last kept one (value based); Dream's sort keeps the first
    of them in sort order, so the two differ only when a tie straddles the cutoff."""
    tp = logits.tp
    x = logits.local.float()
    bs = x.shape[0]
    t = sampling.temperature.float()
    x = x / torch.where(t > 0, t, 1.0).view(bs, 1, 1)
    top, total = _max_and_sum(x, tp)
    if sampling.may_filter_any:
        key = _float_key(x)
        p = sampling.top_p.float()[:, None]
        mass = torch.exp(x - top[..., None])
        cut_p = torch.where(p < 1, _mass_cutoff(key, mass, p * total, tp), _NEG_INF)
        kth = _kth_largest(key, sampling.top_k.clamp(0, logits.vocab_size), tp)
        lowest = torch.finfo(torch.float32).min
        x = x.masked_fill(x < torch.maximum(cut_p, kth)[..., None], lowest)
        top, total = _max_and_sum(x, tp)
    probs = torch.exp(x - top[..., None]) / total[..., None]
    return ShardedLogits(probs, logits.start, logits.vocab_size, tp)


def dream_propose(probs: ShardedLogits, sampling: SamplingTensors, step: Tensor,
                  positions: Tensor) -> Tensor:
    """``dream.dream_propose`` over split probabilities: the first maximum, or for a sampling
    row the Gumbel-max draw keyed on the global vocabulary id."""
    start, p = probs.start, probs.local
    fields = list(_local_argmax(p, start))
    if sampling.may_sample:
        bits = vocab_bits(counter_key(sampling.seed, step, positions, Stream.TOKEN),
                          probs.width, start)
        fields += list(_local_argmax(torch.log(p) + gumbel_from_uniform(unit_float32(bits)),
                                     start))
    ranks = _exchange(fields, probs.tp)
    greedy = _pick(ranks[1], ranks[0].argmax(dim=0)).to(torch.int64)
    if not sampling.may_sample:
        return greedy
    drawn = _pick(ranks[3], ranks[2].argmax(dim=0)).to(torch.int64)
    return torch.where((sampling.temperature > 0)[:, None], drawn, greedy)


def prob_of(probs: Tensor | ShardedLogits, tokens: Tensor) -> Tensor:
    """``[bs, B]`` the probability of ``tokens`` (the owning rank's value, summed with zeros)."""
    if not isinstance(probs, ShardedLogits):
        return probs.gather(-1, tokens[..., None]).squeeze(-1)
    start, width = probs.start, probs.width
    inside = (tokens >= start) & (tokens < start + width)
    value = _at(probs.local, (tokens - start).clamp(0, width - 1))
    return all_reduce(torch.where(inside, value, 0.0).contiguous(), probs.tp)


def top2_margin(probs: Tensor | ShardedLogits) -> Tensor:
    """``[bs, B]`` top-1 minus top-2 probability (each rank's two largest cross the ranks)."""
    if not isinstance(probs, ShardedLogits):
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    local = probs.local
    if local.shape[-1] < 2:
        local = torch.cat([local, torch.zeros_like(local)], dim=-1)
    mine = local.topk(2, dim=-1).values  # [bs, B, 2]
    ranks = all_gather_stack(mine, probs.tp)  # [size, bs, B, 2]
    top2 = ranks.movedim(0, -2).flatten(-2).topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def neg_entropy(probs: Tensor | ShardedLogits) -> Tensor:
    """``[bs, B]`` Dream's ``sum p log(p + 1e-10)`` (the ranks' partial sums added)."""
    if not isinstance(probs, ShardedLogits):
        return fixed_order_sum(probs * torch.log(probs + 1e-10))
    p = probs.local
    return all_reduce(fixed_order_sum(p * torch.log(p + 1e-10)), probs.tp)
