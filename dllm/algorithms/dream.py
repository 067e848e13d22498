"""Dream's denoising schedules: ``origin``, ``maskgit_plus``, ``topk_margin``, ``entropy``.

Reference: Dream ``generation_utils.py`` (``DreamGenerationMixin._sample``,
``sample_tokens``). Dream decodes the whole canvas as one block in ``steps`` forwards with
``timesteps = linspace(1, eps, steps + 1)`` and ``eps = 1e-3``. At step ``i``
(``t = timesteps[i]``, ``s = timesteps[i + 1]``):

* ``origin``: each masked position is transferred independently with probability
  ``1 - s / t`` (1 on the last step), with a token from the sampler.
* the others transfer ``int(n * (1 - s / t))`` masked positions (``n`` masks left; all of
  them on the last step), ranked by a confidence: ``maskgit_plus`` the probability of the
  sampled token, ``topk_margin`` top-1 minus top-2 probability, ``entropy`` the negative
  entropy ``sum p log(p + 1e-10)``. With ``alg_temp > 0`` the positions are drawn without
  replacement from ``softmax(confidence / alg_temp)`` (as Gumbel-top-k over the counter
  RNG) instead of taken greedily.

The schedule reproduces Dream's float32 arithmetic, with ``linspace`` evaluated as CUDA's
kernel does (``start + step * i`` in the first half, ``end - step * (steps - i)`` in the
second, each a fused multiply-add).

Deviations: every step transfers at least one position while masks remain (Dream's
``int(...)`` is 0 on some steps, e.g. the first step when ``steps`` equals the number of
masks, and ``origin`` may draw no position), so a block can finish in fewer forwards than
Dream takes; Dream's sampler applies top-p before top-k, ours top-k first.

Keys: ``steps`` (int, default 0 = block size), ``alg_temp`` (float >= 0, default 0; not
read by ``origin``). Probabilities are float32 of the tempered, filtered distribution.
Ties: lower position first.
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from dllm.algorithms.base import DenoiseInput, DenoiseOutput, UnmaskingAlgorithm
from dllm.algorithms.reductions import fixed_order_sum
from dllm.algorithms.rng import Stream, gumbel_from_uniform, position_uniform
from dllm.algorithms.sampling import SampleOutput, log_confidence, sample_tokens
from dllm.algorithms.selection import at_least_one, finish, masked_positions, select_top

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
    """``(1 - s / t)`` as float32 and whether this is the last scheduled step, ``[bs]``."""
    steps = x.config["steps"]
    last = x.step >= steps - 1
    index = torch.minimum(x.step, steps - 1)
    t = dream_timestep(index, steps)
    s = dream_timestep(index + 1, steps)
    return 1.0 - s / t, last


class DreamOrigin(UnmaskingAlgorithm):
    """Dream ``alg="origin"``: independent per-position transfers (module docstring).
    The per-position coin is a counter-RNG uniform; if no coin lands, the position with the
    smallest uniform transfers."""

    name = "origin"
    defaults = {"steps": 0}

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        fraction, last = transfer_fraction(x)
        p = torch.where(last, 1.0, fraction)
        u = position_uniform(x.sampling.seed, x.step, x.positions, Stream.POSITION)
        coin = masked & (u < p[:, None])
        fallback = select_top(u, masked, torch.ones_like(x.step), descending=False)
        transfer = torch.where(coin.any(dim=-1, keepdim=True), coin, fallback)
        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step, exclude_id=x.mask_id)
        return finish(x, sample.x0, transfer, masked)


class _DreamRanked(UnmaskingAlgorithm):
    """Shared body of Dream's confidence-ranked schedules."""

    defaults = {"steps": 0, "alg_temp": 0.0}

    def confidence(self, sample: SampleOutput) -> tuple[Tensor, Tensor]:
        """(Dream's confidence, a ranking key with the same order and finer resolution)."""
        raise NotImplementedError

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        num_masked = masked.sum(dim=-1)
        fraction, last = transfer_fraction(x)
        count = (num_masked.to(torch.float32) * fraction).to(torch.int64)
        count = at_least_one(torch.where(last, num_masked, count), num_masked)

        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step, exclude_id=x.mask_id)
        confidence, rank_key = self.confidence(sample)
        alg_temp = x.config["alg_temp"]
        sampled = alg_temp > 0
        gumbel = gumbel_from_uniform(
            position_uniform(x.sampling.seed, x.step, x.positions, Stream.ORDER)
        )
        drawn = confidence / torch.where(sampled, alg_temp, 1.0)[:, None] + gumbel
        key = torch.where(sampled[:, None], drawn, rank_key)
        return finish(x, sample.x0, select_top(key, masked, count), masked)


class DreamMaskGitPlus(_DreamRanked):
    """Dream ``alg="maskgit_plus"``: rank by the sampled token's probability."""

    name = "maskgit_plus"

    def confidence(self, sample: SampleOutput) -> tuple[Tensor, Tensor]:
        return sample.confidence, log_confidence(sample)


class DreamTopkMargin(_DreamRanked):
    """Dream ``alg="topk_margin"``: rank by top-1 minus top-2 probability."""

    name = "topk_margin"

    def confidence(self, sample: SampleOutput) -> tuple[Tensor, Tensor]:
        top2 = sample.logprobs.topk(2, dim=-1).values.exp()
        margin = top2[..., 0] - top2[..., 1]
        return margin, margin


class DreamEntropy(_DreamRanked):
    """Dream ``alg="entropy"``: rank by negative entropy ``sum p log(p + 1e-10)``."""

    name = "entropy"

    def confidence(self, sample: SampleOutput) -> tuple[Tensor, Tensor]:
        p = sample.logprobs.exp()
        neg_entropy = fixed_order_sum(p * torch.log(p + 1e-10))
        return neg_entropy, neg_entropy
