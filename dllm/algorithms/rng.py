"""Counter-based random numbers computed on the device.

A random value is a pure function of (seed, step, absolute position, stream[, vocab id]):
no ``torch.Generator``, no host round trip, no state. A request therefore draws the same
numbers whether it runs alone or inside any batch, and the draw can live inside a CUDA
graph.

All arithmetic runs on int64 tensors holding values in ``[0, 2**32)``. Every product is
kept below ``2**63`` (32-bit multiplies are split into 16-bit limbs when the constant
needs it) and every right shift acts on non-negative values, so nothing depends on
signed overflow or on arithmetic-shift behaviour. The mixer is Chris Wellons'
``lowbias32`` (hash-prospector), a bijection on 32-bit words.
"""

from __future__ import annotations

from enum import IntEnum

import torch
from torch import Tensor

from dllm.runner.kernels import kernel_module

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


class Stream(IntEnum):
    """Independent random streams; each use of randomness takes its own."""

    TOKEN = 0  # per (position, vocab id): Gumbel noise for token sampling
    POSITION = 1  # per position: random remasking, Dream ``origin`` transfer coin
    ORDER = 2  # per position: Gumbel-top-k over positions (Dream ``alg_temp``)
    TOKEN_LOW = 3  # per (position, vocab id): low bits of the float64 uniform


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for ``x`` in ``[0, 2**32)`` without int64 overflow."""
    if c < 2**31:
        return (x * c) & MASK32
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def hash32(x: Tensor) -> Tensor:
    """lowbias32 on int64 tensors holding 32-bit words."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_key(seed: Tensor, step: Tensor, positions: Tensor, stream: int) -> Tensor:
    """32-bit key per (row, position): ``seed [bs]``, ``step [bs]``, ``positions [bs, B]``."""
    seed = seed.to(torch.int64)
    h = hash32((seed & MASK32) ^ ((int(stream) * _GOLDEN) & MASK32))
    h = hash32(h ^ ((seed >> 32) & MASK32))
    h = hash32(h ^ (step.to(torch.int64) & MASK32))
    return hash32(h[:, None] ^ (positions.to(torch.int64) & MASK32))


def vocab_bits(key: Tensor, vocab_size: int, start: int = 0) -> Tensor:
    """32 random bits per (row, position, vocab id) from a ``[bs, B]`` key, for the ids
    ``start .. start + vocab_size - 1`` (a rank's shard of a split vocabulary: the bits of an
    id do not depend on the split)."""
    ids = torch.arange(start, start + vocab_size, device=key.device, dtype=torch.int64)
    salt = hash32(ids ^ _GOLDEN)
    return hash32(key[..., None] ^ salt)


def unit_float32(bits: Tensor) -> Tensor:
    """Uniform in the open interval (0, 1) from 32-bit words: 23 bits, exact in float32."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)


def unit_float64(high: Tensor, low: Tensor) -> Tensor:
    """Uniform in (0, 1) with 52 random bits: the top 32 from ``high``, 20 from ``low``.

    Its leading bits are those of :func:`unit_float32` on ``high``, so the float32 and
    float64 draws of one (seed, step, position, vocab id) agree to float32 precision."""
    k = (high << 20) | (low >> 12)
    return (k.to(torch.float64) + 0.5) * (2.0**-52)


def position_uniform(seed: Tensor, step: Tensor, positions: Tensor, stream: int) -> Tensor:
    """One float32 uniform in (0, 1) per (row, position): ``[bs, B]``. On CUDA with Triton
    installed, the same bits from one kernel (:mod:`dllm.runner.kernels.rng_kernel`)."""
    kernel = kernel_module("rng_kernel") if positions.is_cuda else None
    if kernel is not None and kernel.supports(seed, step, positions):
        return kernel.position_uniform(seed, step, positions, stream)
    return unit_float32(counter_key(seed, step, positions, stream))


def gumbel_from_uniform(u: Tensor) -> Tensor:
    """Standard Gumbel noise ``-log(-log u)``."""
    return -torch.log(-torch.log(u))
