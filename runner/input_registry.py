"""The static input registry (DESIGN §7).

Fixed-size device buffers, sized for the largest batch, filled from a live ``ScheduledBatch``
with a padding rule per field and sliced back into a ``ForwardBatch`` view. The eager runner
fills them unpadded; the CUDA-graph runner pads to a captured size, so a replay reads the same
addresses every time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dllm.runner.forward_batch import ForwardBatch, ForwardMode, ScheduledBatch
from dllm.runner.kernels import kernel_module


@dataclass(frozen=True)
class Field:
    axis: str  # "tokens" or "reqs"
    dtype: torch.dtype
    pad: float  # value written into padding entries


# Padding rules: index buffers point at slot/row 0 (the reserved padding page and request
# row), lengths get a safe 1 so no attention row is empty.
CORE_FIELDS: dict[str, Field] = {
    "input_ids": Field("tokens", torch.int64, 0),
    "positions": Field("tokens", torch.int64, 0),
    "out_cache_loc": Field("tokens", torch.int64, 0),
    "req_pool_indices": Field("reqs", torch.int64, 0),
    "prefix_lens": Field("reqs", torch.int64, 0),
    "extend_lens": Field("reqs", torch.int64, 1),
    "seq_lens": Field("reqs", torch.int64, 1),
}
# Hybrid models' state slots per row (read, write, and the prefix cache's track slot);
# padding rows, and rows that track nothing, use slot 0, the padding slot.
STATE_FIELDS: dict[str, Field] = {
    "state_read_slots": Field("reqs", torch.int64, 0),
    "state_write_slots": Field("reqs", torch.int64, 0),
    "state_track_slots": Field("reqs", torch.int64, 0),
}


class InputRegistry:
    """Fields of one axis and dtype are rows of one device tensor (an arena); the arenas are
    views of one device byte buffer, mirrored by a pinned host byte buffer: ``load`` writes
    the host values and padding into the mirror and moves everything with one asynchronous
    copy, instead of one small copy per field (each copy-engine transfer also leaves the GPU
    idle ~5 µs before the kernel that waits on it). Two mirrors take turns, so a load waits
    only for the copy of the load before the last one (with two forwards queued per step, the
    last copy may still wait behind a running forward)."""

    def __init__(self, max_bs: int, max_tokens: int, device: torch.device):
        self.max_bs = max_bs
        self.max_tokens = max_tokens
        self.device = device
        # ``ScheduledBatch.carry``'s row index per request (-1: the host's input ids), and
        # where a batch gives them, the query index of the first carried token and how many
        # there are (else the row's first ``carry.shape[1]``).
        self.fields: dict[str, Field] = {**CORE_FIELDS, **STATE_FIELDS,
                                         "carry_row": Field("reqs", torch.int64, -1),
                                         "carry_at": Field("reqs", torch.int64, 0),
                                         "carry_len": Field("reqs", torch.int64, 0)}
        self.buffers: dict[str, torch.Tensor] = {}
        self._host_bytes: list[torch.Tensor] = []  # the two pinned host mirrors
        self._dev_bytes: torch.Tensor | None = None
        self._host_rows: list[dict[str, np.ndarray]] = [{}, {}]  # numpy views, per mirror
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each mirror's last copy
        self._mirror = 0  # the mirror the next load writes
        self._alloc()

    def _alloc(self) -> None:
        """(Re)build the arenas for the registered fields, every entry at its padding value."""
        groups: dict[tuple[str, torch.dtype], list[str]] = {}
        for name, f in self.fields.items():
            groups.setdefault((f.axis, f.dtype), []).append(name)
        layout, total = [], 0
        for (axis, dtype), names in groups.items():
            n = self.max_tokens if axis == "tokens" else self.max_bs
            total = -(-total // 16) * 16  # every arena 16-byte aligned
            size = len(names) * n * dtype.itemsize
            layout.append((names, dtype, n, total, size))
            total += size
        pin = self.device.type == "cuda"
        self._host_bytes = [torch.empty(total, dtype=torch.uint8, pin_memory=pin)
                            for _ in range(2)]
        for names, dtype, n, off, size in layout:
            host = self._host_bytes[0][off : off + size].view(dtype).view(len(names), n)
            for i, name in enumerate(names):
                host[i].fill_(self.fields[name].pad)
        self._host_bytes[1].copy_(self._host_bytes[0])
        self._dev_bytes = self._host_bytes[0].to(self.device, copy=True)
        for names, dtype, n, off, size in layout:
            dev = self._dev_bytes[off : off + size].view(dtype).view(len(names), n)
            hosts = [h[off : off + size].view(dtype).view(len(names), n)
                     for h in self._host_bytes]
            for i, name in enumerate(names):
                self.buffers[name] = dev[i]
                for m in (0, 1):
                    self._host_rows[m][name] = hosts[m][i].numpy()

    def register(self, name: str, axis: str, dtype: torch.dtype, pad: float = 0) -> None:
        """Declare a post-step input (e.g. an algorithm setting) before the first ``load``
        (buffers move when a field is added)."""
        if name not in self.fields:
            self.fields[name] = Field(axis, dtype, pad)
            self._alloc()

    def ensure_capacity(self, bs: int, tokens: int) -> None:
        """Grow the buffers (eager only: captured graphs are built within the initial size)."""
        if bs <= self.max_bs and tokens <= self.max_tokens:
            return
        self.max_bs, self.max_tokens = max(bs, self.max_bs), max(tokens, self.max_tokens)
        self._alloc()

    def _stage(self, name: str, values: list, padded: int) -> None:
        """Write host ``values`` and padding up to ``padded`` into the field's host row
        (through numpy: a list converts several times faster than through a tensor)."""
        row = self._host_rows[self._mirror][name]
        n = len(values)
        if n:
            row[:n] = values
        if padded > n:
            row[n:padded] = self.fields[name].pad

    def _fill(self, name: str, values: torch.Tensor, padded: int) -> torch.Tensor:
        """A device tensor's values into the field's buffer (padding written on the host)."""
        buf = self.buffers[name]
        n = len(values)
        if n:
            buf[:n].copy_(values, non_blocking=True)
        return buf[:padded]

    @staticmethod
    def _check_carry(batch: ScheduledBatch) -> None:
        width = batch.carry.shape[1]
        inp = batch.row_inputs
        if "carry_row" not in inp:
            raise ValueError("a carried batch needs a carry_row per row")
        if "carry_at" in inp:
            if any(r >= 0 and not (0 <= at and at + n <= min(width + at, lens))
                   for r, at, n, lens in zip(inp["carry_row"], inp["carry_at"],
                                             inp["carry_len"], batch.extend_lens, strict=True)):
                raise ValueError("a carried row's tokens must lie inside the row and the carry")
        elif any(n < width for n in batch.extend_lens):
            raise ValueError(f"a carried batch needs at least {width} tokens in every row")

    @staticmethod
    def _offset_carry(batch: ScheduledBatch) -> bool:
        """Whether the batch places carried tokens other than at each row's start, or fewer
        than the carry's width (``carry_at`` / ``carry_len``)."""
        inp = batch.row_inputs
        width = batch.carry.shape[1]
        return "carry_at" in inp and any(
            r >= 0 and (at or n != width)
            for r, at, n in zip(inp["carry_row"], inp["carry_at"], inp["carry_len"], strict=True))

    def _gather_carry(self, batch: ScheduledBatch, input_ids: torch.Tensor) -> None:
        """Rows with a ``carry_row`` take their first ``width`` input ids (all of them but in
        a merged commit row, which is never carried) from ``batch.carry`` (on the device,
        after the host values landed: the copy and this gather are stream-ordered)."""
        bs, width = batch.batch_size, batch.carry.shape[1]
        src = self.buffers["carry_row"][:bs]
        if self._offset_carry(batch):  # token by token: row r's tokens [at, at + len)
            lens = self.buffers["extend_lens"][:bs]
            t = batch.num_tokens
            row = torch.repeat_interleave(torch.arange(bs, device=lens.device), lens,
                                          output_size=t)
            j = (torch.arange(t, device=lens.device) - (torch.cumsum(lens, 0) - lens)[row]
                 - self.buffers["carry_at"][:bs][row])
            take = (src[row] >= 0) & (j >= 0) & (j < self.buffers["carry_len"][:bs][row])
            ids = input_ids[:t]
            carried = batch.carry[src[row].clamp(min=0), j.clamp(0, width - 1)]
            ids.copy_(torch.where(take, carried, ids))
            return
        if batch.num_tokens == bs * width:
            ids = input_ids[: bs * width].view(bs, width)
            ids.copy_(torch.where((src >= 0)[:, None], batch.carry[src.clamp(min=0)], ids))
            return
        lens = self.buffers["extend_lens"][:bs]
        at = ((torch.cumsum(lens, 0) - lens)[:, None]
              + torch.arange(width, device=lens.device)[None, :])  # [bs, width]
        ids = input_ids[at]
        input_ids[at] = torch.where((src >= 0)[:, None], batch.carry[src.clamp(min=0)], ids)

    def _staged_on_device(self, batch: ScheduledBatch, views: dict[str, torch.Tensor],
                          req_to_token: torch.Tensor, loc: bool) -> bool:
        """The carry gather and (``loc``) the cache slots in one Triton launch
        (``dllm.runner.kernels.stage_kernel``) for the step kinds a CUDA graph replays
        (``DLLM_EXTEND``: whole blocks; ``DECODE``: one token a row), on CUDA with Triton;
        False where the torch path must run instead. Only those kinds: the kernel compiles
        one variant per power-of-two row width, and a prompt chunk's width would compile
        new ones while a server runs."""
        bs, t = batch.batch_size, batch.num_tokens
        width = t // bs if bs else 0
        carry = batch.carry
        if (self.device.type != "cuda" or not width or t != bs * width
                or width != (batch.block_size if batch.mode is ForwardMode.DLLM_EXTEND
                             else 1 if batch.mode is ForwardMode.DECODE else 0)
                or any(n != width for n in batch.extend_lens)
                or req_to_token.dtype != torch.int64 or req_to_token.stride(1) != 1
                or (carry is not None and (carry.dtype != torch.int64 or carry.shape[1] != width
                                           or self._offset_carry(batch)))):
            return False
        stage = kernel_module("stage_kernel")
        if stage is None:
            return False
        stage.stage_rows(bs, width, views["input_ids"], views["positions"],
                         views["req_pool_indices"], req_to_token,
                         views["out_cache_loc"] if loc else None, carry,
                         self.buffers["carry_row"] if carry is not None else None)
        return True

    def load(self, batch: ScheduledBatch, req_to_token: torch.Tensor,
             padded_bs: int | None = None, padded_tokens: int | None = None,
             out_cache_loc: list[int] | None = None) -> ForwardBatch:
        """Copy ``batch`` into the buffers and return a ``ForwardBatch`` of views.

        ``out_cache_loc`` defaults to ``req_to_token[row, position]`` of each token, gathered
        on the device (cache index == absolute position)."""
        bs, t = batch.batch_size, batch.num_tokens
        pbs, pt = padded_bs or bs, padded_tokens or t
        self.ensure_capacity(pbs, pt)
        m = self._mirror
        if self._copied[m] is not None:  # the host mirror is free once its last copy is done
            self._copied[m].synchronize()
        host_values: dict[str, list] = {
            "input_ids": batch.input_ids, "positions": batch.positions,
            "req_pool_indices": batch.req_pool_indices, "prefix_lens": batch.prefix_lens,
            "extend_lens": batch.extend_lens, "seq_lens": batch.seq_lens,
            "state_read_slots": batch.state_read_slots,
            "state_write_slots": batch.state_write_slots,
            "state_track_slots": batch.state_track_slots,
        }
        if out_cache_loc is not None:
            host_values["out_cache_loc"] = out_cache_loc
        for source in (batch.row_inputs, batch.token_inputs):
            host_values.update(source)
        for name in batch.row_tensors:  # device values; their padding comes from the host
            host_values.setdefault(name, [])
        if out_cache_loc is None:
            host_values["out_cache_loc"] = []
        for name, values in host_values.items():
            if name not in self.fields:
                raise KeyError(f"post-step input {name!r} was not registered")
            self._stage(name, values, pt if self.fields[name].axis == "tokens" else pbs)
        self._dev_bytes.copy_(self._host_bytes[m], non_blocking=True)  # every arena at once
        if self.device.type == "cuda":
            self._copied[m] = torch.cuda.Event()
            self._copied[m].record()
        self._mirror = 1 - m
        views = {name: self.buffers[name][: pt if self.fields[name].axis == "tokens" else pbs]
                 for name in CORE_FIELDS}
        if batch.carry is not None:
            self._check_carry(batch)
        if batch.state_write_gate is not None:  # after the host values landed (stream order)
            gate = batch.state_write_gate
            self.buffers["state_write_slots"][: len(gate)].mul_(gate)
            self.buffers["state_track_slots"][: len(gate)].mul_(gate)
        if not self._staged_on_device(batch, views, req_to_token, out_cache_loc is None):
            if batch.carry is not None:
                self._gather_carry(batch, views["input_ids"])
            if out_cache_loc is None and t:
                rows = torch.repeat_interleave(
                    views["req_pool_indices"][:bs], views["extend_lens"][:bs], output_size=t)
                views["out_cache_loc"][:t].copy_(req_to_token[rows, views["positions"][:t]])
        extras = {name: self.buffers[name][: pt if self.fields[name].axis == "tokens" else pbs]
                  for source in (batch.row_inputs, batch.token_inputs) for name in source}
        for name, values in batch.row_tensors.items():
            extras[name] = self._fill(name, values, pbs)
        pad_rows = pbs - bs
        key = None if batch.table_version is None else (
            batch.mode, batch.attention_mask, batch.block_size, batch.block_offset, pbs,
            tuple(batch.req_pool_indices), tuple(batch.prefix_lens),
            tuple(batch.extend_lens), tuple(batch.seq_lens), batch.table_version)
        return ForwardBatch(
            mode=batch.mode,
            batch_size=pbs,
            input_ids=views["input_ids"],
            positions=views["positions"],
            req_pool_indices=views["req_pool_indices"],
            prefix_lens=views["prefix_lens"],
            extend_lens=views["extend_lens"],
            seq_lens=views["seq_lens"],
            out_cache_loc=views["out_cache_loc"],
            prefix_lens_cpu=batch.prefix_lens + [0] * pad_rows,
            extend_lens_cpu=batch.extend_lens + [1] * pad_rows,
            seq_lens_cpu=batch.seq_lens + [1] * pad_rows,
            attention_mask=batch.attention_mask,
            block_size=batch.block_size,
            block_offset=batch.block_offset,
            logits_mode=batch.logits_mode,
            req_to_token=req_to_token,
            extras=extras,
            row_groups=list(batch.row_groups),
            layout_key=key,
            state_read_slots=self.buffers["state_read_slots"][:pbs],
            state_write_slots=self.buffers["state_write_slots"][:pbs],
            # Always for denoise/commit steps (CUDA graphs capture the track write), else
            # only when a row tracks (a decode step never does).
            state_track_slots=(self.buffers["state_track_slots"][:pbs]
                               if batch.mode is ForwardMode.DLLM_EXTEND
                               or any(batch.state_track_slots) else None),
            state_split_cpu=(batch.state_split + [0] * pad_rows
                             if any(batch.state_split) else None),
        )
