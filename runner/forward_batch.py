"""The runner's batch form: device tensors for one forward pass (DESIGN §3, §7).

The scheduler hands the runner a CPU ``ScheduledBatch``; the runner turns it into a
``ForwardBatch`` whose tensors live on the device (views into the static input registry).
Models read only ``ForwardBatch``; attention backends read the index fields.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

if TYPE_CHECKING:
    from dllm.runner.attention.base import AttentionBackend, KVCache
    from dllm.runner.memory import MambaStatePool


class ForwardMode(enum.Enum):
    """What kind of forward pass a batch is (DESIGN §3)."""

    EXTEND = "extend"  # ragged prefill: prompts, AR prefill, embeddings, exact full recompute
    # One denoise (or commit) step: block_size tokens a row, or 2·block_size for a merged
    # commit (a resolved block's final tokens, then the next block's first denoise step).
    DLLM_EXTEND = "dllm_extend"
    DECODE = "decode"  # one token per request, causal over the cache
    IDLE = "idle"  # no requests on this rank; still joins collectives

    @property
    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.DLLM_EXTEND)


class AttentionMask(enum.Enum):
    """Which keys a query may see. Key and query indices are cache indices (absolute positions
    counted from token 0 of the sequence), so every rule is a function of two integers."""

    CAUSAL = "causal"  # key j visible to query i iff j <= i
    BLOCK_CAUSAL = "block_causal"  # iff (j - block_offset) // B <= (i - block_offset) // B
    FULL = "full"  # every key of the sequence (up to seq_len)


class LogitsMode(enum.Enum):
    ALL = "all"  # logits for every query token (denoise steps)
    LAST = "last"  # logits for the last query token of each request (AR prefill)
    # logits for the last ``block_size`` query tokens of each request: a denoise batch with a
    # merged commit row, whose first block only writes its KV
    BLOCK = "block"
    NONE = "none"  # hidden states only (prompt prefill of a dLLM, embeddings)


@dataclass
class ForwardBatch:
    """One forward pass. Token-axis tensors are ``[T]`` (T = sum of extend_lens), request-axis
    tensors are ``[bs]``. The ``*_cpu`` lists mirror request-axis tensors on the host: the
    scheduler knew them before the batch was built, so reading them costs no device sync.

    Query tokens of request r occupy cache indices ``[prefix_len, prefix_len + extend_len)``
    and attend to keys at cache indices ``[0, seq_len)`` under ``attention_mask``. Normally
    ``seq_len == prefix_len + extend_len``; a dual cache (full-attention dLLMs) also attends to
    a cached suffix, so there ``seq_len`` is larger."""

    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute RoPE positions
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    prefix_lens: torch.Tensor  # [bs] int64, cached tokens this forward attends to but does not write
    extend_lens: torch.Tensor  # [bs] int64, query tokens per request
    seq_lens: torch.Tensor  # [bs] int64, keys attended: cache indices [0, seq_len)
    out_cache_loc: torch.Tensor  # [T] int64, KV slot written for each query token
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    attention_mask: AttentionMask = AttentionMask.CAUSAL
    block_size: int = 1  # for BLOCK_CAUSAL
    block_offset: int = 0  # for BLOCK_CAUSAL: blocks start at this cache index
    logits_mode: LogitsMode = LogitsMode.ALL
    req_to_token: torch.Tensor | None = None  # [max_reqs, max_context] int64 slot table
    kv_pool: KVCache | None = None
    attn_backend: AttentionBackend | None = None
    # Backend-private planning state (e.g. FlashInfer wrappers), built once per forward.
    attn_metadata: object | None = None
    # Post-step inputs copied from ScheduledBatch.row_inputs/token_inputs/row_tensors.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    row_groups: list[str] = field(default_factory=list)
    # Equal for two batches whose attention plan is the same (rows, lengths, mask and the
    # slot table's version); None: plan afresh.
    layout_key: tuple | None = None
    # Values the layers of one forward share (RoPE cos/sin), computed by the first layer
    # that needs them; cleared before every model call (so a graph capture recomputes them).
    memo: dict = field(default_factory=dict)
    # Hybrid models (DESIGN §6): the recurrent-state pool and, per row, the slot each row's
    # state is read from and the slot the state after the row is written to (0, the padding
    # slot: discarded). Views of the input registry, zero-padded; None without a state pool.
    state_pool: MambaStatePool | None = None
    state_read_slots: torch.Tensor | None = None  # [bs] int64
    state_write_slots: torch.Tensor | None = None  # [bs] int64
    # The prefix cache's track slots: each row's state is also written there (0: nowhere
    # that matters, the padding slot). None when no row of the batch tracks (and the mode is
    # not one a CUDA graph captures with them).
    state_track_slots: torch.Tensor | None = None  # [bs] int64
    # Per row, the leading query tokens after which the row's state is written (0: the whole
    # row). A merged commit row writes the state after its first block (the committed state)
    # and discards the state after the rest (its denoise step's). Host list, like
    # ``extend_lens_cpu``; None when no row splits.
    state_split_cpu: list[int] | None = None

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def extend_start_loc_cpu(self) -> list[int]:
        starts, acc = [], 0
        for n in self.extend_lens_cpu:
            starts.append(acc)
            acc += n
        return starts

    @property
    def last_token_index(self) -> torch.Tensor:
        """[bs] index into the token axis of each request's last query token."""
        return torch.cumsum(self.extend_lens, dim=0) - 1

    @property
    def block_token_index(self) -> torch.Tensor:
        """[bs * block_size] index into the token axis of each request's last ``block_size``
        query tokens (``LogitsMode.BLOCK``), on the device."""
        ends = torch.cumsum(self.extend_lens, dim=0) - self.block_size
        offs = torch.arange(self.block_size, device=ends.device)
        return (ends[:, None] + offs[None, :]).reshape(-1)


class StepKind(str, enum.Enum):
    """What a batch's forward is for. The runner picks the device post-step from it (and,
    under the overlap schedule, the part of the output the host reads); the scheduler applies
    the result by it."""

    PREFILL = "prefill"  # prompt KV only, no logits read
    FIRST_TOKEN = "first_token"  # a prefill whose last-token logits give a greedy first token
    DENOISE = "denoise"  # block diffusion: the unmasking algorithm over each row's block
    SAMPLE = "sample"  # autoregressive prefill or decode: the next token of each row
    FULL_STEP = "full_step"  # full-attention diffusion: block logits, then the algorithm
    POOL = "pool"  # embeddings: pooled hidden states


RowT = TypeVar("RowT")


@dataclass
class ScheduledBatch(Generic[RowT]):
    """The scheduler's CPU batch: host lists only, built without touching the device.

    ``row_inputs`` are per-request numbers (``[bs]``) and ``token_inputs`` per-token numbers
    (``[T]``) that the post-forward step (the unmasking algorithm) reads; ``row_tensors`` are
    per-request values that already live on the device (algorithm state), each ``[bs]``.
    The runner copies all of them into its static input registry."""

    mode: ForwardMode
    rids: list[str] = field(default_factory=list)
    req_pool_indices: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    attention_mask: AttentionMask = AttentionMask.CAUSAL
    block_size: int = 1
    block_offset: int = 0
    logits_mode: LogitsMode = LogitsMode.ALL
    row_inputs: dict[str, list[float] | list[int]] = field(default_factory=dict)
    token_inputs: dict[str, list[float] | list[int]] = field(default_factory=dict)
    row_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # Host-side grouping the post step may use (e.g. the algorithm name of each row).
    row_groups: list[str] = field(default_factory=list)
    # ``ReqToTokenPool.version`` when the batch was built (None: unknown, never reuse a plan).
    table_version: int | None = None
    # Overlapped scheduling: ``[n, tokens_per_row]`` device token rows that some rows take
    # their input ids from (an earlier step's output, not yet read by the host); row i takes
    # ``carry[row_inputs["carry_row"][i]]`` where that is >= 0, else its host ``input_ids``.
    # Only for batches whose rows all have ``tokens_per_row`` tokens (denoise, decode).
    carry: torch.Tensor | None = None
    # Hybrid models: each row's state slots (read, write), ``[bs]`` each; empty when the
    # model has no recurrent state (``ForwardBatch.state_read_slots``).
    state_read_slots: list[int] = field(default_factory=list)
    state_write_slots: list[int] = field(default_factory=list)
    # The prefix cache's track slot of each row (0: none): a row that ends on the track grid
    # also writes the state after it there, in the same forward (DESIGN §6).
    state_track_slots: list[int] = field(default_factory=list)
    # ``ForwardBatch.state_split_cpu``: per row, the leading tokens after which its state is
    # written (0: the whole row); empty when no row splits.
    state_split: list[int] = field(default_factory=list)
    # Overlapped scheduling over a hybrid: ``[bs]`` int64 0/1 on the device, or None. Row i
    # writes its state to ``state_write_slots[i]`` only where the gate is 1, else to slot 0
    # (a block-diffusion row whose block may have resolved in the forward still in flight:
    # it is the block's commit forward exactly when that forward finished the block, which
    # only the device knows yet). The registry multiplies the write and track slots by it.
    state_write_gate: torch.Tensor | None = None
    # The scheduler's own object of each row (``RowT``: ``dllm.scheduler.Row``, the request
    # and the block it denoises), handed back with the batch when its result is applied; the
    # runner never reads them. A result applied a step late must not reach a new request
    # that reuses a finished one's id.
    rows: list[RowT] = field(default_factory=list)
    # What the forward is for: its post-step, and how the scheduler applies its result.
    kind: StepKind = StepKind.PREFILL

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def add_row(self, rid: str, req_pool_idx: int, token_ids: list[int], start: int,
                seq_len: int | None = None) -> None:
        """Append one request's query tokens, placed at cache indices (= absolute positions)
        ``[start, start + len(token_ids))`` on top of a cached prefix of ``start`` tokens."""
        n = len(token_ids)
        self.rids.append(rid)
        self.req_pool_indices.append(req_pool_idx)
        self.input_ids.extend(token_ids)
        self.positions.extend(range(start, start + n))
        self.prefix_lens.append(start)
        self.extend_lens.append(n)
        self.seq_lens.append(start + n if seq_len is None else seq_len)

    def add_state(self, read: int | None, write: int | None, track: int = 0) -> None:
        """The state slots of the row just added (hybrid models; None: the model has no
        state pool, nothing is recorded); ``track``: its prefix-cache track slot (0: none)."""
        if read is not None:
            self.state_read_slots.append(read)
            self.state_write_slots.append(0 if write is None else write)
            self.state_track_slots.append(track)

    def state_writers(self) -> list[int]:
        """The rows whose forward may write recurrent state (a write slot other than 0; a
        gated row counts, its gate unknown to the host)."""
        return [i for i, w in enumerate(self.state_write_slots) if w != 0]

    def row(self, i: int) -> ScheduledBatch:
        """Row ``i`` alone (a one-request batch with the same settings)."""
        start = sum(self.extend_lens[:i])
        end = start + self.extend_lens[i]
        one = ScheduledBatch(
            mode=self.mode, kind=self.kind, attention_mask=self.attention_mask,
            block_size=self.block_size,
            block_offset=self.block_offset, logits_mode=self.logits_mode,
            row_inputs={k: v[i : i + 1] for k, v in self.row_inputs.items()},
            token_inputs={k: v[start:end] for k, v in self.token_inputs.items()},
            row_tensors={k: v[i : i + 1] for k, v in self.row_tensors.items()},
            row_groups=self.row_groups[i : i + 1], carry=self.carry,
            state_read_slots=self.state_read_slots[i : i + 1],
            state_write_slots=self.state_write_slots[i : i + 1],
            state_track_slots=self.state_track_slots[i : i + 1],
            state_split=self.state_split[i : i + 1],
            state_write_gate=(None if self.state_write_gate is None
                              else self.state_write_gate[i : i + 1]),
            rows=self.rows[i : i + 1],
        )
        one.add_row(self.rids[i], self.req_pool_indices[i], self.input_ids[start:end],
                    self.prefix_lens[i], self.seq_lens[i])
        return one
