"""``dllm.runner.kernels.rng_kernel``: the one-launch ``position_uniform`` gives the reference's
bits exactly, for seeds and steps across the whole int64 range, every stream and widths that
are not powers of two; and ``rng.position_uniform`` takes it on CUDA.

GPU tests (marker ``gpu``). With ``TRITON_INTERPRET=1`` they also run on the CPU under Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch

from dllm.algorithms import rng
from dllm.algorithms.rng import Stream
from tests.triton_marks import DEV, INTERPRET, MARKS

pytestmark = MARKS

SEEDS = [0, 1, 12345, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 7, 2**63 - 1, -1, -2**63]


def _reference(seed, step, positions, stream):
    return rng.unit_float32(rng.counter_key(seed, step, positions, stream))


@pytest.mark.parametrize("stream", list(Stream))
@pytest.mark.parametrize("width", [1, 4, 5, 32, 100])
def test_kernel_equals_reference_bit_for_bit(stream, width):
    from dllm.runner.kernels import rng_kernel

    g = torch.Generator().manual_seed(width)
    bs = len(SEEDS)
    seed = torch.tensor(SEEDS, dtype=torch.int64)
    step = torch.randint(0, 2**62, (bs,), generator=g)
    step[:3] = torch.tensor([0, 2**32 + 3, 7])
    positions = torch.randint(0, 2**40, (bs, width), generator=g)
    positions[0] = torch.arange(width)
    seed, step, positions = seed.to(DEV), step.to(DEV), positions.to(DEV)
    assert rng_kernel.supports(seed, step, positions)
    got = rng_kernel.position_uniform(seed, step, positions, stream)
    want = _reference(seed, step, positions, stream)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert ((got > 0) & (got < 1)).all()


def test_strided_positions_and_int32_inputs():
    from dllm.runner.kernels import rng_kernel

    seed = torch.tensor([5, 6, 7], dtype=torch.int64, device=DEV)
    step = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    wide = torch.arange(3 * 12, dtype=torch.int32, device=DEV).view(3, 12)
    positions = wide[:, 2:9]  # a row stride of 12, width 7
    got = rng_kernel.position_uniform(seed, step, positions, Stream.POSITION)
    assert torch.equal(got, _reference(seed, step, positions, Stream.POSITION))


@pytest.mark.skipif(INTERPRET, reason="the dispatch in rng.position_uniform is CUDA-only")
def test_position_uniform_takes_the_kernel_on_cuda():
    seed = torch.tensor([3, 2**40], device="cuda")
    step = torch.tensor([9, 10], device="cuda")
    positions = torch.arange(8, device="cuda").view(2, 4)
    assert rng.kernel_module("rng_kernel") is not None
    got = rng.position_uniform(seed, step, positions, Stream.ORDER)
    assert torch.equal(got, _reference(seed.cpu(), step.cpu(), positions.cpu(),
                                       Stream.ORDER).cuda())
