"""The static input registry (DESIGN §7).

Fixed-size device buffers, sized for the largest batch, filled from a live ``ScheduledBatch``
with a padding rule per field and sliced back into a ``ForwardBatch`` view. The eager runner
fills them unpadded; the CUDA-graph runner pads to a captured size, so a replay reads the same
addresses every time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.runner.forward_batch import ForwardBatch, ScheduledBatch


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


class InputRegistry:
    def __init__(self, max_bs: int, max_tokens: int, device: torch.device):
        self.max_bs = max_bs
        self.max_tokens = max_tokens
        self.device = device
        self.fields: dict[str, Field] = dict(CORE_FIELDS)
        self.buffers: dict[str, torch.Tensor] = {}
        for name, f in self.fields.items():
            self._alloc(name, f)

    def _alloc(self, name: str, f: Field) -> None:
        n = self.max_tokens if f.axis == "tokens" else self.max_bs
        self.buffers[name] = torch.full((n,), f.pad, dtype=f.dtype, device=self.device)

    def register(self, name: str, axis: str, dtype: torch.dtype, pad: float = 0) -> None:
        """Declare a post-step input (e.g. an algorithm setting) before it is first filled."""
        if name not in self.fields:
            self.fields[name] = Field(axis, dtype, pad)
            self._alloc(name, self.fields[name])

    def ensure_capacity(self, bs: int, tokens: int) -> None:
        """Grow the buffers (eager only: captured graphs are built within the initial size)."""
        if bs <= self.max_bs and tokens <= self.max_tokens:
            return
        self.max_bs, self.max_tokens = max(bs, self.max_bs), max(tokens, self.max_tokens)
        for name, f in self.fields.items():
            self._alloc(name, f)

    def _fill(self, name: str, values: list | torch.Tensor, padded: int) -> torch.Tensor:
        buf = self.buffers[name]
        n = len(values)
        if n:
            src = values if isinstance(values, torch.Tensor) else torch.tensor(
                values, dtype=buf.dtype)
            buf[:n].copy_(src, non_blocking=True)
        if padded > n:
            buf[n:padded].fill_(self.fields[name].pad)
        return buf[:padded]

    def load(self, batch: ScheduledBatch, req_to_token: torch.Tensor,
             padded_bs: int | None = None, padded_tokens: int | None = None,
             out_cache_loc: list[int] | None = None) -> ForwardBatch:
        """Copy ``batch`` into the buffers and return a ``ForwardBatch`` of views.

        ``out_cache_loc`` defaults to ``req_to_token[row, position]`` of each token, gathered
        on the device (cache index == absolute position)."""
        bs, t = batch.batch_size, batch.num_tokens
        pbs, pt = padded_bs or bs, padded_tokens or t
        self.ensure_capacity(pbs, pt)
        get = {
            "input_ids": batch.input_ids, "positions": batch.positions,
            "req_pool_indices": batch.req_pool_indices, "prefix_lens": batch.prefix_lens,
            "extend_lens": batch.extend_lens, "seq_lens": batch.seq_lens,
        }
        views = {name: self._fill(name, values, pt if self.fields[name].axis == "tokens" else pbs)
                 for name, values in get.items()}
        if out_cache_loc is None:
            rows = torch.repeat_interleave(
                views["req_pool_indices"][:bs], views["extend_lens"][:bs], output_size=t)
            loc = req_to_token[rows, views["positions"][:t]]
        else:
            loc = out_cache_loc
        views["out_cache_loc"] = self._fill("out_cache_loc", loc, pt)
        extras = {}
        for source, axis_n in ((batch.row_inputs, pbs), (batch.token_inputs, pt),
                               (batch.row_tensors, pbs)):
            for name, values in source.items():
                if name not in self.fields:
                    raise KeyError(f"post-step input {name!r} was not registered")
                extras[name] = self._fill(name, values, axis_n)
        pad_rows = pbs - bs
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
        )
