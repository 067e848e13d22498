"""Tensor parallelism as the models see it: this process's rank among the ranks that split each
layer, the split arithmetic, and the two collectives a split layer needs.

The runner sets the group (``set_tensor_parallel``) before it builds the model; the modules
read it when they are built and shape their parameters to their part: column-split projections
(q/k/v by heads, gate/up by rows) hold a contiguous slice of each output, row-split ones
(o_proj, down) a slice of the input and all-reduce their output, the embedding and the LM head
a slice of the vocabulary (padded to a multiple of the group size). With one rank (the
default) every split is the whole and every collective returns its input, so single-process
code pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed process group; None: the default one

    def split(self, n: int, what: str) -> int:
        """This rank's share of ``n`` evenly split parts (``ValueError`` when uneven)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size "
                             f"{self.size}")
        return n // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """``(local, first)``: this rank's KV heads and the first one's global index. With
        more ranks than KV heads each head is replicated on ``size / num_kv_heads`` ranks."""
        if num_kv_heads >= self.size:
            local = self.split(num_kv_heads, "num_key_value_heads")
            return local, self.rank * local
        if self.size % num_kv_heads:
            raise ValueError(f"the tensor-parallel size {self.size} is neither a divisor nor a "
                             f"multiple of num_key_value_heads ({num_kv_heads})")
        return 1, self.rank // (self.size // num_kv_heads)

    def vocab_range(self, vocab_size: int) -> tuple[int, int, int]:
        """``(start, end, rows)``: this rank's slice of the vocabulary padded to a multiple of
        the group size; rows past ``vocab_size`` are padding (zeros, never chosen)."""
        rows = -(-vocab_size // self.size)
        start = self.rank * rows
        return start, min(start + rows, vocab_size), rows


_TP = TensorParallel()


def set_tensor_parallel(tp: TensorParallel) -> None:
    global _TP
    _TP = tp


def tensor_parallel() -> TensorParallel:
    """The group the modules built now split over."""
    return _TP


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``tp`` (in place; ``x`` itself with one). Modules
    keep the ``TensorParallel`` they were built under and pass it, so engines of other sizes
    built later in the same process do not change them."""
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The ranks' ``x`` concatenated along the last axis, in rank order."""
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)
