"""``rng.position_uniform`` in one launch (Triton; CUDA only).

The reference builds the counter key from about sixty elementwise int64 kernels (four
``lowbias32`` rounds, each a handful of shifts, multiplies and masks); at batch 1 those
launches cost more than the rest of the unmasking step. Here one program per row computes the
same 32-bit words in ``uint32`` arithmetic (multiplies wrap modulo 2**32, shifts are logical:
exactly the reference's masked int64 arithmetic) and the same float32 uniform, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ``dllm.algorithms.rng``'s constants (the runner imports nothing above it; the bit-exact tests
# compare the two).
MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


@triton.jit
def _hash32(x):
    # lowbias32 on uint32 (rng.hash32); the constants are uint32 literals
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _position_uniform_kernel(seed_ptr, step_ptr, pos_ptr, out_ptr, width, pos_stride,
                             salt, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    step = tl.load(step_ptr + row).to(tl.int64)
    h = _hash32((seed & 0xFFFFFFFF).to(tl.uint32) ^ salt.to(tl.uint32))
    h = _hash32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _hash32(h ^ (step & 0xFFFFFFFF).to(tl.uint32))
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    pos = tl.load(pos_ptr + row.to(tl.int64) * pos_stride + cols, mask=ok, other=0)
    key = _hash32(h ^ (pos.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32))
    u = ((key >> 9).to(tl.float32) + 0.5) * (2.0**-23)
    tl.store(out_ptr + row * width + cols, u, mask=ok)


def supports(seed: torch.Tensor, step: torch.Tensor, positions: torch.Tensor) -> bool:
    return (positions.dim() == 2 and positions.stride(-1) == 1 and seed.dim() == 1
            and step.dim() == 1 and seed.shape[0] == step.shape[0] == positions.shape[0]
            and not positions.dtype.is_floating_point and positions.shape[1] <= 4096
            and seed.device == step.device == positions.device)


def position_uniform(seed: torch.Tensor, step: torch.Tensor, positions: torch.Tensor,
                     stream: int) -> torch.Tensor:
    """``rng.position_uniform(seed, step, positions, stream)``, bit for bit: float32
    ``[bs, B]`` (check ``supports`` first)."""
    bs, width = positions.shape
    out = torch.empty((bs, width), dtype=torch.float32, device=positions.device)
    if bs and width:
        _position_uniform_kernel[(bs,)](
            seed, step, positions, out, width, positions.stride(0),
            (int(stream) * _GOLDEN) & MASK32, BLOCK=triton.next_power_of_2(width),
            num_warps=1)
    return out
