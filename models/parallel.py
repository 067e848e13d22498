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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed process group; None: the default one
    # Expert parallelism inside the group: the MoE experts split into ``ep`` sets, each held
    # whole (over ``size / ep`` ranks, which split its intermediate size) by consecutive ranks.
    ep: int = 1

    def __post_init__(self) -> None:
        if self.ep < 1 or self.size % self.ep:
            raise ValueError(f"the expert-parallel size {self.ep} must divide the "
                             f"tensor-parallel size {self.size} (the experts split over the "
                             "tensor-parallel ranks)")

    def experts(self, num_experts: int) -> tuple[int, int]:
        """``(first, count)``: the experts this rank holds (all of them without expert
        parallelism)."""
        if num_experts % self.ep:
            raise ValueError(f"num_experts ({num_experts}) is not divisible by the "
                             f"expert-parallel size {self.ep}")
        count = num_experts // self.ep
        return self.rank // (self.size // self.ep) * count, count

    def expert_slice(self, n: int) -> tuple[int, int]:
        """``(first, count)`` of an expert's intermediate size ``n`` on this rank: the ranks
        holding the same experts split it."""
        ways = self.size // self.ep
        if n % ways:
            raise ValueError(f"the expert size ({n}) is not divisible by {ways} (tensor-"
                             f"parallel size {self.size} / expert-parallel size {self.ep})")
        return self.rank % ways * (n // ways), n // ways

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


class DataParallel:
    """Data-parallel attention (DESIGN §9): ``size`` ranks each attend over their own requests
    (attention, embedding and LM head replicated: built under a one-rank ``TensorParallel``),
    while the MLP / MoE layers are split over all of them (``mlp``: tensor and expert parallel
    over the ``size`` ranks). Before each MLP the ranks' token rows are gathered (padded to the
    largest rank's count), the MLP runs on every rank's rows, and each rank keeps its own.

    ``counts`` is every rank's token count in the forward now running, exchanged once per
    forward on the host (``exchange``) over ``cpu_group`` (a Gloo group; None: the default
    group, Gloo on CPU), so no layer reads a device value. A rank with no rows (an ``IDLE``
    forward, count 0) still joins each layer's gather and the MLP's collectives.

    ``stage`` follows the forward now running (``begin`` → "started", ``exchange`` → "open",
    ``close`` → "done") and ``layers_done`` its MLPs that have run, so that a forward that
    fails part way can still take part in the collectives its peers run (the runner's
    ``finish_failed``)."""

    def __init__(self, rank: int = 0, size: int = 1, mlp: TensorParallel | None = None,
                 cpu_group: object | None = None):
        self.rank, self.size = rank, size
        self.mlp = mlp if mlp is not None else TensorParallel()
        self.cpu_group = cpu_group
        self.counts: list[int] = [0] * size
        self.stage, self.layers_done = "done", 0

    def begin(self) -> None:
        self.stage = "started"

    def close(self) -> None:
        self.stage = "done"

    def exchange(self, tokens: int) -> list[int]:
        """Every rank's token count for the forward about to run (a collective: every rank
        calls it once per forward, ``IDLE`` ones with 0)."""
        if self.size > 1:
            out = torch.zeros(self.size, dtype=torch.int64)
            dist.all_gather(list(out.unbind(0)), torch.tensor(tokens, dtype=torch.int64),
                            group=self.cpu_group)
            self.counts = out.tolist()
        else:
            self.counts = [tokens]
        self.stage, self.layers_done = "open", 0
        return self.counts

    def run_mlp(self, mlp: Callable[[torch.Tensor], torch.Tensor],
                x: torch.Tensor) -> torch.Tensor:
        """``mlp`` over every rank's rows of this layer; this rank's rows of its output."""
        if self.size == 1:
            return mlp(x)
        counts = self.counts
        if x.shape[0] != counts[self.rank]:
            raise RuntimeError(f"data-parallel rank {self.rank}: {x.shape[0]} rows, "
                               f"{counts[self.rank]} announced")
        most = max(counts)
        padded = x if x.shape[0] == most else torch.cat(
            [x, x.new_zeros(most - x.shape[0], *x.shape[1:])])
        ranks = all_gather_stack(padded, self.mlp)  # [size, most, H]
        rows = torch.cat([ranks[r, :n] for r, n in enumerate(counts)])
        start = sum(counts[: self.rank])
        out = mlp(rows)[start : start + counts[self.rank]]
        self.layers_done += 1
        return out


_DP = DataParallel()


def set_data_parallel(dp: DataParallel) -> None:
    global _DP
    _DP = dp


def data_parallel() -> DataParallel:
    """The data-parallel ranks the modules built now run over (one: none)."""
    return _DP


@contextmanager
def building_under(tp: TensorParallel) -> Iterator[None]:
    """Build modules split over ``tp`` (the MLPs under data-parallel attention)."""
    before = tensor_parallel()
    set_tensor_parallel(tp)
    try:
        yield
    finally:
        set_tensor_parallel(before)


_RECORDS: list[list[tuple[str, tuple[int, ...]]]] = []


@contextmanager
def record_collectives() -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """Every collective this process runs inside the block, as ``(op, shape of its input)``
    (the tests read the sizes: logits never cross ranks whole)."""
    log: list[tuple[str, tuple[int, ...]]] = []
    _RECORDS.append(log)
    try:
        yield log
    finally:
        _RECORDS.remove(log)


def _record(op: str, x: torch.Tensor) -> None:
    for log in _RECORDS:
        log.append((op, tuple(x.shape)))


def all_reduce(x: torch.Tensor, tp: TensorParallel, op: str = "sum") -> torch.Tensor:
    """The sum (``op="max"``: the maximum) of ``x`` over the ranks of ``tp`` (in place; ``x``
    itself with one). Modules keep the ``TensorParallel`` they were built under and pass it,
    so engines of other sizes built later in the same process do not change them."""
    if tp.size > 1:
        _record(f"all_reduce_{op}", x)
        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                        group=tp.group)
    return x


def all_gather_stack(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """``[size, *x.shape]``: every rank's ``x``, in rank order."""
    if tp.size == 1:
        return x[None]
    _record("all_gather", x)
    out = x.new_empty(tp.size, *x.shape)
    dist.all_gather(list(out.unbind(0)), x.contiguous(), group=tp.group)
    return out


def all_gather_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The ranks' ``x`` concatenated along the last axis, in rank order."""
    if tp.size == 1:
        return x
    return torch.cat(all_gather_stack(x, tp).unbind(0), dim=-1)


class ShardedLogits:
    """Logits split over the vocabulary: this rank's columns ``[start, start + width)`` of a
    ``[..., vocab_size]`` tensor (``local``; the padding columns past ``vocab_size`` hold
    ``-inf``, so they are never chosen and weigh nothing). What a model's ``compute_logits``
    returns under tensor parallelism, instead of gathering ``N x vocab`` values.

    It supports what the post-steps do to logits before they reduce them: indexing, views and
    ``index_select`` over the leading axes, and elementwise ``+ - *`` with another
    ``ShardedLogits`` of the same split or with a tensor that does not span the vocabulary
    (CFG). Reductions over the vocabulary live in ``dllm.algorithms.vocab_parallel`` (the
    per-shard statistics the ranks exchange); anything else raises. ``gather()`` is the whole
    tensor, for tests and debugging."""

    def __init__(self, local: torch.Tensor, start: int, vocab_size: int, tp: TensorParallel):
        self.local, self.start, self.vocab_size, self.tp = local, start, vocab_size, tp

    def _like(self, local: torch.Tensor) -> ShardedLogits:
        return ShardedLogits(local, self.start, self.vocab_size, self.tp)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.local.shape[:-1], self.vocab_size))

    @property
    def ndim(self) -> int:
        return self.local.ndim

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def width(self) -> int:
        return self.local.shape[-1]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ShardedLogits:
        """``fn`` (which must leave the last axis alone) applied to the local columns."""
        out = fn(self.local)
        if out.shape[-1] != self.width:
            raise ValueError("ShardedLogits.map: the function changed the vocabulary axis")
        return self._like(out)

    def __getitem__(self, key) -> ShardedLogits:
        key = key if isinstance(key, tuple) else (key,)
        full = slice(None)
        axes = [k for k in key if k is not None and k is not Ellipsis]
        if key and isinstance(key[-1], slice) and key[-1] == full:
            pass  # the vocabulary axis kept whole
        elif Ellipsis in key or len(axes) >= self.ndim:
            raise IndexError("ShardedLogits: indexing the vocabulary axis of split logits")
        return self._like(self.local[key])

    def view(self, *shape: int) -> ShardedLogits:
        if shape[-1] not in (-1, self.vocab_size):
            raise ValueError("ShardedLogits.view: the last axis is the vocabulary")
        return self._like(self.local.view(*shape[:-1], self.width))

    reshape = view

    def index_select(self, dim: int, index: torch.Tensor) -> ShardedLogits:
        if dim % self.ndim == self.ndim - 1:
            raise IndexError("ShardedLogits: selecting along the vocabulary axis")
        return self._like(self.local.index_select(dim, index))

    def float(self) -> ShardedLogits:
        return self._like(self.local.float())

    def to(self, dtype: torch.dtype) -> ShardedLogits:
        return self._like(self.local.to(dtype))

    def _operand(self, other):
        if isinstance(other, ShardedLogits):
            if (other.start, other.width, other.tp) != (self.start, self.width, self.tp):
                raise ValueError("ShardedLogits: operands of different splits")
            return other.local
        if isinstance(other, torch.Tensor) and other.ndim and other.shape[-1] != 1:
            raise ValueError("ShardedLogits: a tensor spanning the vocabulary axis")
        return other

    def __add__(self, other) -> ShardedLogits:
        return self._like(self.local + self._operand(other))

    def __sub__(self, other) -> ShardedLogits:
        return self._like(self.local - self._operand(other))

    def __mul__(self, other) -> ShardedLogits:
        return self._like(self.local * self._operand(other))

    __radd__ = __add__
    __rmul__ = __mul__

    def __rsub__(self, other) -> ShardedLogits:
        return self._like(self._operand(other) - self.local)

    def argmax(self, dim: int = -1) -> torch.Tensor:
        """The global index of each row's first maximum (ties to the lowest vocabulary id, as
        ``torch.argmax`` on the whole tensor): each rank's maximum and its index cross the
        ranks, two numbers per row."""
        if dim % self.ndim != self.ndim - 1:
            raise ValueError("ShardedLogits.argmax: only over the vocabulary axis")
        value, index = self.local.float().max(dim=-1)
        both = torch.stack([value.double(), (index + self.start).double()], dim=-1)
        ranks = all_gather_stack(both, self.tp)  # [size, ..., 2]
        winner = ranks[..., 0].argmax(dim=0, keepdim=True)  # first rank holding the maximum
        return ranks[..., 1].gather(0, winner)[0].to(torch.int64)

    def gather(self) -> torch.Tensor:
        """The whole ``[..., vocab_size]`` tensor (every rank's columns): tests only."""
        return all_gather_last(self.local, self.tp)[..., : self.vocab_size]


def map_leading(logits, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``fn`` over the leading axes of logits, whole (a tensor) or split (``ShardedLogits``)."""
    return logits.map(fn) if isinstance(logits, ShardedLogits) else fn(logits)


def full_logits(logits) -> torch.Tensor:
    """The whole logits tensor, gathering split logits (tests and debugging only)."""
    return logits.gather() if isinstance(logits, ShardedLogits) else logits
