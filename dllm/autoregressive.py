"""Autoregressive generation through the same scheduler, pools and runner (DESIGN §3):
a causal ``EXTEND`` prefill (chunked by the token budget) whose last chunk samples the first
token, then one ``DECODE`` row per request per step. Prefix cache: admission takes the longest
cached run of whole pages of the prompt but its last token; each prefill chunk's pages are
inserted once its result is applied, and at the end every page whose tokens were all fed."""

from __future__ import annotations

from typing import Any

import torch

from dllm.algorithms import sample_tokens
from dllm.algorithms.base import SamplingTensors
from dllm.denoise import sampling_flags, sampling_rows
from dllm.request import Req
from dllm.runner.forward_batch import (
    AttentionMask,
    ForwardBatch,
    ForwardMode,
    LogitsMode,
    ScheduledBatch,
    StepKind,
)
from dllm.runner.host_copy import Carry
from dllm.scheduler import Row, Scheduler


def sampling_tensors(fb: ForwardBatch, n: int) -> SamplingTensors:
    ex = fb.extras
    return SamplingTensors(temperature=ex["temperature"][:n], top_k=ex["top_k"][:n],
                           top_p=ex["top_p"][:n], seed=ex["seed"][:n])


class SampleNext:
    """``[bs]`` next tokens from each row's last-token logits, sampled at the position after
    that token (the RNG counter), on the device. ``flags``: ``sampling_flags`` of the batch."""

    def __init__(self, flags: tuple[bool, bool, bool] = (True, True, True)):
        self.flags = flags

    @classmethod
    def for_batch(cls, batch: ScheduledBatch) -> SampleNext:
        return cls(sampling_flags(batch.row_inputs))

    def __call__(self, fb: ForwardBatch, hidden: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        bs = len(fb.extend_lens_cpu)
        last_pos = fb.positions[fb.last_token_index[:bs]]
        sampling = sampling_tensors(fb, bs)
        sampling.may_sample, sampling.may_filter, sampling.may_filter_any = self.flags
        out = sample_tokens(logits[:bs, None, :], sampling, (last_pos + 1)[:, None],
                            torch.zeros_like(last_pos))
        return out.x0[:, 0]


class AutoregressiveScheduler(Scheduler):
    """Overlapped scheduling: a request whose last forward is still in flight decodes from
    that forward's sampled token on the device (``ScheduledBatch.carry``), at the position
    after it; a request sure to reach ``max_new_tokens`` with that token is not decoded."""

    def match_limit(self, req: Req) -> int:
        """The prompt but its last token, whose logits give the first output token."""
        return req.prompt_len - 1

    def cache_finished(self, req: Req) -> None:
        """Every token fed so far has its KV written: all but the last output token."""
        self.cache_prefix(req, req.committed_len - 1)

    def schedule(self) -> list[ScheduledBatch]:
        prefill = self.build_prefill()
        busy = set(prefill.rids) if prefill else set()
        ready = [r for r in self.running.values() if not r.needs_prefill and r.rid not in busy
                 and (r.output_ids or r.inflight)
                 and len(r.output_ids) + r.inflight < r.params.max_new_tokens]
        return [b for b in (prefill, self.build_decode(ready)) if b is not None]

    def update(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        return self.apply_tokens(batch, output)

    def build_prefill(self) -> ScheduledBatch | None:
        rows = self.chunk_prefill(lambda r: r.prompt_len, 1)
        if not rows:
            return None
        batch = ScheduledBatch(ForwardMode.EXTEND, kind=StepKind.SAMPLE,
                               attention_mask=AttentionMask.CAUSAL, logits_mode=LogitsMode.LAST)
        for req, start, end in rows:
            batch.add_row(req.rid, req.req_pool_idx, req.prompt_ids[start:end], start)
            track = self.track_slot(req, end)
            batch.add_state(req.state_slot, req.state_slot, track)  # the chunk continues it
            batch.rows.append(Row(req, track=track))
        batch.row_inputs.update(sampling_rows([req for req, _, _ in rows]))
        return batch

    def build_decode(self, reqs: list[Req]) -> ScheduledBatch | None:
        if not reqs:
            return None
        batch = ScheduledBatch(ForwardMode.DECODE, kind=StepKind.SAMPLE,
                               attention_mask=AttentionMask.CAUSAL, logits_mode=LogitsMode.LAST)
        carry = Carry()
        for req in reqs:
            # The last output token is fed at its own position; its KV is written now. A
            # token still in flight comes from the device, one position further.
            n = req.inflight
            batch.add_row(req.rid, req.req_pool_idx, [0] if n else req.output_ids[-1:],
                          req.committed_len - 1 + n)
            batch.add_state(req.state_slot, req.state_slot)  # updated in place
            batch.rows.append(Row(req))
            carry.add(req.ar.carry if n else None)
        batch.row_inputs.update(sampling_rows(reqs))
        carry.attach(batch)
        return batch

    def launched(self, batch: ScheduledBatch, output: torch.Tensor) -> None:
        """Queued: each row's sampled token is the next step's input, on the device."""
        for i in range(batch.batch_size):
            req = self.row_owner(batch, i)
            if req is None:  # finished since the batch was built (a retried launch)
                continue
            req.inflight += 1
            if batch.mode is ForwardMode.EXTEND:
                req.prefilled_len += batch.extend_lens[i]
            req.ar.carry = (output, i)

    def apply_tokens(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        tokens = output.tolist()  # the one host read of the step

        def apply_row(i: int, req: Req) -> bool:
            req.num_forward_passes += 1
            if batch.mode is ForwardMode.EXTEND:
                end = batch.prefix_lens[i] + batch.extend_lens[i]
                self.cache_prefix(req, end, batch.rows[i].track)
                if end < req.prompt_len:
                    return False  # a middle chunk: its logits are not used
            self.commit_tokens(req, [tokens[i]])
            return True

        return self.apply_rows(batch, apply_row)
