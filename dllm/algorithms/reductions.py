"""Float sums in a fixed order, built from elementwise adds.

``torch.sum`` and ``torch.cumsum`` choose their reduction order from the tensor's shape: on
CUDA a row summed alone and the same row inside a batch differ in the last bits, so a
threshold on a confidence could flip with the batch a request runs in. These helpers fix
the order (a pairwise tree for sums, a blocked Hillis-Steele scan for prefix sums), so a
row's result depends on that row alone, on any device and in any batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_CHUNK = 256


def fixed_order_sum(x: Tensor) -> Tensor:
    """Sum over the last dim as a pairwise tree: each level adds the second half of the
    entries to the first, an odd last entry carried up as it is. The tree depends on the
    length alone. (No padding to a power of two: for a 151936-token vocabulary that would
    move 1.7× the data through every level.)"""
    if x.shape[-1] == 0:
        return x.sum(-1)
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        head = x[..., :half] + x[..., half : 2 * half]
        x = head if n % 2 == 0 else torch.cat([head, x[..., 2 * half :]], dim=-1)
    return x[..., 0]


def _scan(x: Tensor) -> Tensor:
    """Inclusive Hillis-Steele scan over the last dim."""
    shift = 1
    while shift < x.shape[-1]:
        x = torch.cat([x[..., :shift], x[..., shift:] + x[..., :-shift]], dim=-1)
        shift *= 2
    return x


def fixed_order_cumsum(x: Tensor) -> Tensor:
    """Inclusive prefix sum over the last dim: scans within chunks, then over chunk totals."""
    n = x.shape[-1]
    if n <= _CHUNK:
        return _scan(x)
    chunks = -(-n // _CHUNK)
    x = _scan(F.pad(x, (0, chunks * _CHUNK - n)).unflatten(-1, (chunks, _CHUNK)))
    totals = _scan(x[..., -1])
    carry = torch.cat([torch.zeros_like(totals[..., :1]), totals[..., :-1]], dim=-1)
    return (x + carry[..., None]).flatten(-2)[..., :n]
