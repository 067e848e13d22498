"""Block-granular continuous batching for block-diffusion models (DESIGN §2, §4).

Every engine step runs up to two forwards: one ``EXTEND`` that prefills full prompt blocks of
admitted requests (chunked by a token budget, block-causal), and one ``DLLM_EXTEND`` over the
current block of every request past its prefill (denoise rows and commit rows side by side).
A request whose block resolves leaves the denoise rows at once; the next step it runs the
commit forward, then starts its next block.

Merged commit (the default; ``EngineConfig.merged_commit``): the commit forward and the next
block's first denoise step run in one forward, as two whole-block rows of the request: the
commit half (the resolved block's final tokens, ``Row.commit_half``) sees the prefix and
itself and writes its KV; the next row (all masks) sees the prefix, the commit half's KV,
written in the same layer before any row attends, and itself. The same keys, values and
logits as the two forwards it replaces, one forward fewer per block; both rows are ordinary
block rows, so the batch replays a CUDA graph and runs the block kernels (the commit half's
logits and step result are ignored, as a commit forward's are). The pair counts as one
forward of the request, and one forward in flight. A hybrid cannot split its recurrent state
between two rows of one forward: its merged commit is one row of 2·B query tokens at the
resolved block's start under the block-causal mask, its state written after the first block
(``ScheduledBatch.state_split``), logits asked for the last B tokens only
(``LogitsMode.BLOCK``; the post-step denoises those). A request that ends inside a block
needs no commit at all (its KV would never be read: the prefix cache inserts a generated
block only once its commit ran). Not merged: shifted-logits models (the commit pass reads
the next block's first token) and algorithms that edit a filled block (``joint_threshold``:
``UnmaskingAlgorithm.edits``), which keep the separate commit forward.

Overlapped scheduling (the engine applies a step's result after queueing the next step): a
row whose result is still in flight continues from that result on the device (its input
tokens are the in-flight output row, ``ScheduledBatch.carry``; its algorithm state is the
in-flight state). A block that resolved is then denoised once more before the host knows: that
forward over the final tokens is exactly its commit forward, and the next block starts the step
after the host reads the resolution, as without overlap. Shifted-logits models wait for the
commit's result (it holds the next block's first token): one step more per block. With merged
commits, a request whose in-flight forward is *sure* to finish its block (the algorithm's
fixed schedule ends at that step: ``UnmaskingAlgorithm.surely_done``) is merged already, its
commit half carried from that forward's output; otherwise the
commit stays the forward queued on the resolved block, as described above. A request whose
in-flight forward is sure to resolve its last block takes no row in the next forward: it ends
when that result is read (``surely_finishes``).

Memory for a request's whole reserved length is taken at admission, so a running request never
waits for memory and never fails for it.

Shifted logits (Fast-dLLM v2): the logits at a block's last position predict the next block's
first token. The commit forward reads it (greedily, as the reference's commit pass does, at any
temperature) and it joins the output at once; a prompt that ends on a block boundary gets it
from its prefill's last-token logits. It sits at position 0 of the next block, fixed (never
masked or edited, as in the reference).

Prefix cache (``dllm.prefix_cache``): admission takes the longest cached run of whole prompt
blocks (``match_limit``) and prefills only the rest; a prompt chunk's blocks are inserted once
its prefill result is applied, a generated block once its commit forward's result is (its KV
then comes from the final tokens). The partial last prompt block is never inserted from the
prefill: the commit forward writes it. A hybrid's prefill chunk or commit forward that ends on
the track grid also writes its state into the request's track slot, donated to the tree
with the blocks.

Hybrid models (a recurrent state, DESIGN §6): each request holds one committed state slot, the
state after its committed tokens. A prompt prefill row reads and writes it (the SSM runs
causally over the chunk); a denoise row reads it and writes slot 0 (nothing: every step is
re-run from the committed state); the commit forward of a resolved block writes it (the state
after the block's final tokens). A merged row (2·B) writes the state after its first block
(``ScheduledBatch.state_split``) and runs its second from that state, discarding the result. Under the overlap schedule a row built while the forward
before it on the same block is in flight may be that block's commit forward or one more
denoise step, which only the device knows: it writes the committed slot gated by the in-flight
row's done flag (``ScheduledBatch.state_write_gate``). The next block's first denoise step is
built only after the host read the resolution, so it is queued after the commit forward and
reads the state that forward wrote (stream order). No working slot: the commit forward is a
forward of its own over the final tokens, so an algorithm that edits a mask-free block
(``joint_threshold``) edits only in denoise steps, which write no state."""

from __future__ import annotations

from typing import Any

import torch

from dllm.algorithms import get_algorithm
from dllm.denoise import (
    DenoisePost,
    config_rows,
    graph_group,
    sampling_rows,
    state_rows,
    trace_top,
)
from dllm.request import BlockState, Req
from dllm.runner.forward_batch import (
    AttentionMask,
    ForwardMode,
    LogitsMode,
    ScheduledBatch,
    StepKind,
)
from dllm.runner.host_copy import Carry
from dllm.scheduler import Row, Scheduler


def merges_in_two_rows(merged_commit: bool, logits_shift: int, recurrent_state: bool) -> bool:
    """Whether merged commits run as two whole-block rows of a request (module docstring):
    merged commits on, no shifted logits (those never merge), no recurrent state (a hybrid
    merges into one 2·B row). The runner sizes its graphs and inputs by it."""
    return merged_commit and not logits_shift and not recurrent_state


class BlockDiffusionScheduler(Scheduler):
    """``logits_shift``: 1 for Fast-dLLM v2 (module docstring)."""

    def __init__(self, *args: Any, logits_shift: int = 0, merged_commit: bool = True,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.logits_shift = logits_shift
        # Shifted logits read the next block's first token from the commit pass: no merging.
        self.merged_commit = merged_commit and not logits_shift
        self.two_rows = merges_in_two_rows(merged_commit, logits_shift,
                                           self.state_pool is not None)

    def merges_commit(self, req: Req) -> bool:
        """Whether ``req``'s resolved block commits inside its next block's first denoise
        step (module docstring): the host knows the block is final (no forward on it is in
        flight) and the algorithm never edits a filled block."""
        return (self.merged_commit and req.inflight == 0
                and not get_algorithm(req.denoise.algorithm).edits)

    def surely_resolves(self, req: Req, blk: BlockState) -> bool:
        """Under the overlap schedule: whether the denoise forward in flight on ``blk`` is
        sure to finish it (its algorithm's fixed schedule ends there), so the next forward
        may be its merged commit before the host reads the result; and the next block lies
        inside the request's reservation."""
        return (self.merged_commit and blk.start + 2 * req.block_size <= req.reserved_len
                and self._in_flight_resolves(req, blk))

    def surely_finishes(self, req: Req, blk: BlockState) -> bool:
        """Under the overlap schedule: whether the forward in flight on ``blk`` is sure to
        resolve it and ``blk`` is the request's last block (its final tokens reach
        ``max_new_tokens``): the request ends when that result is read, so it takes no row in
        the next forward (it would ride one whose result nobody reads)."""
        return (blk.start + 2 * req.block_size > req.reserved_len
                and self._in_flight_resolves(req, blk))

    @staticmethod
    def _in_flight_resolves(req: Req, blk: BlockState) -> bool:
        """The one forward in flight on ``blk`` is its fixed schedule's last step."""
        if not (req.inflight == 1 and blk.carry is not None and not blk.resolved):
            return False
        algo = get_algorithm(req.denoise.algorithm)
        return not algo.edits and algo.surely_done(req.denoise.algo_config, blk.step - 1)

    def match_limit(self, req: Req) -> int:
        """The full prompt blocks (the partial last one is denoised, never cached); with
        shifted logits a prompt ending on a block boundary keeps one block to prefill, whose
        last logits give the first token."""
        if self.logits_shift and req.prefill_target == req.prompt_len:
            return req.prompt_len - 1
        return req.prefill_target

    def schedule(self) -> list[ScheduledBatch]:
        prefill = self.build_prefill()
        denoise = self.build_denoise([r for r in self.running.values() if not r.needs_prefill])
        return [b for b in (prefill, denoise) if b is not None]

    def update(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        if batch.kind is StepKind.DENOISE:
            return self.apply_denoise(batch, output)
        return self.apply_prefill(batch, output)

    def launched(self, batch: ScheduledBatch, output: Any) -> None:
        if batch.kind is StepKind.DENOISE:
            self.launched_denoise(batch, output)
        else:
            self.launched_prefill(batch, output)

    # ---- prefill -----------------------------------------------------------------------
    def build_prefill(self) -> ScheduledBatch | None:
        """Full prompt blocks, as many as fit the token budget, block-causal, no logits."""
        rows = self.chunk_prefill(lambda r: r.prefill_target, self.config.block_size)
        if not rows:
            return None
        # Shifted logits: a prompt that ends on a block boundary reads its first token here.
        first_token = self.logits_shift and any(end == r.prompt_len for r, _, end in rows)
        batch = ScheduledBatch(ForwardMode.EXTEND, attention_mask=AttentionMask.BLOCK_CAUSAL,
                               kind=StepKind.FIRST_TOKEN if first_token else StepKind.PREFILL,
                               block_size=self.config.block_size,
                               logits_mode=LogitsMode.LAST if first_token else LogitsMode.NONE)
        for req, start, end in rows:
            batch.add_row(req.rid, req.req_pool_idx, req.prompt_ids[start:end], start)
            track = self.track_slot(req, end)
            batch.add_state(req.state_slot, req.state_slot, track)  # the chunk continues it
            batch.rows.append(Row(req, track=track))
        return batch

    def launched_prefill(self, batch: ScheduledBatch, output: Any) -> None:
        """The chunk's KV is queued: the next step may build on it (stream order)."""
        for i in range(batch.batch_size):
            req = self.row_owner(batch, i)
            if req is not None:
                req.prefilled_len += batch.extend_lens[i]
                req.inflight += 1

    def apply_prefill(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        first = output.tolist() if batch.logits_mode is LogitsMode.LAST else None

        def apply_row(i: int, req: Req) -> bool:
            req.num_forward_passes += 1
            end = batch.prefix_lens[i] + batch.extend_lens[i]
            self.cache_prefix(req, end, batch.rows[i].track)  # whole prompt blocks: exact KV
            if first is not None and end == req.prompt_len:
                self.commit_tokens(req, [first[i]])
                return True
            return False

        return self.apply_rows(batch, apply_row)

    # ---- denoise -----------------------------------------------------------------------
    def _start_block(self, req: Req) -> None:
        b = req.block_size
        start = req.committed_len // b * b
        p = req.prompt_len  # the known tokens from ``start`` on, without copying the rest
        known = (req.output_ids[start - p :] if start >= p
                 else [*req.prompt_ids[start:], *req.output_ids])
        req.denoise.block = BlockState(
            start=start,
            tokens=known + [self.config.mask_token_id] * (b - len(known)),
            editable=[False] * len(known) + [True] * (b - len(known)),
            num_initial_masks=b - len(known),
        )

    def _next_block(self, req: Req, blk: BlockState) -> BlockState:
        """The block after ``blk`` (all masks: the prompt ends inside ``blk`` at the latest),
        started before the host has read ``blk``'s final tokens."""
        b = req.block_size
        req.denoise.block = nxt = BlockState(
            start=blk.start + b, tokens=[self.config.mask_token_id] * b, editable=[True] * b,
            num_initial_masks=b)
        return nxt

    def build_denoise(self, reqs: list[Req]) -> ScheduledBatch | None:
        """One ``DLLM_EXTEND`` row of ``block_size`` tokens per request, or of twice that
        for a merged commit (a resolved block's final tokens, then the next block)."""
        rows: list[tuple[Req, BlockState, BlockState | None]] = []
        for req in reqs:
            blk, commit = req.denoise.block, None
            if blk is not None and blk.resolved and blk.commit_launched:
                if self.logits_shift:
                    continue  # the commit's result holds the next block's first token
                req.denoise.block = blk = None  # its commit forward is queued: the next block starts
            elif blk is not None and blk.resolved and self.merges_commit(req):
                commit, blk = blk, None  # committed in this row, before the next block
            elif blk is not None and self.surely_resolves(req, blk):
                commit, blk = blk, self._next_block(req, blk)
            elif blk is not None and self.surely_finishes(req, blk):
                continue
            if blk is None:
                if self.logits_shift and req.inflight:
                    continue  # the prefill's result holds the block's first token
                self._start_block(req)
                blk = req.denoise.block
            rows.append((req, blk, commit))
        if not rows:
            return None
        # A merged commit over a recurrent state is one row of 2·B (its second block starts
        # from the state after the first); otherwise it is two whole-block rows, the commit
        # half first (module docstring), so CUDA graphs and the block kernels apply.
        two_rows = self.two_rows
        merged = not two_rows and any(commit is not None for _, _, commit in rows)
        b = self.config.block_size
        batch = ScheduledBatch(ForwardMode.DLLM_EXTEND, attention_mask=AttentionMask.BLOCK_CAUSAL,
                               kind=StepKind.DENOISE, block_size=b,
                               logits_mode=LogitsMode.BLOCK if merged else LogitsMode.ALL)
        editable: list[bool] = []
        carry = Carry()
        gates: list[torch.Tensor | None] = []
        reqs: list[Req] = []
        for req, blk, commit in rows:
            # In flight on this block: its input is that forward's output, on the device (a
            # merged commit's first block, when the forward finishing it is in flight).
            carried = (blk if commit is None else commit).carry if req.inflight else None
            if commit is not None and two_rows:
                batch.add_row(req.rid, req.req_pool_idx, commit.tokens, commit.start)
                batch.row_groups.append(req.denoise.algorithm)
                editable += commit.editable
                carry.add(carried)
                carried = None
                reqs.append(req)
                batch.rows.append(Row(req, commit, commit_half=True))
            if commit is None or two_rows:
                batch.add_row(req.rid, req.req_pool_idx, blk.tokens, blk.start)
            else:  # block-causal: the first block sees only itself, the next sees both
                batch.add_row(req.rid, req.req_pool_idx, commit.tokens + blk.tokens,
                              commit.start)
                editable += [False] * b
            if merged:
                batch.state_split.append(b if commit is not None else 0)
            batch.row_groups.append(req.denoise.algorithm)
            editable += blk.editable  # bools: the registry stores them as 0/1
            carry.add(carried)
            gate, track = self._add_state(batch, req, blk, carried is not None, commit)
            gates.append(gate)
            reqs.append(req)
            batch.rows.append(Row(req, blk, track, None if two_rows else commit))
        if (top := trace_top(reqs)) is not None:  # a traced batch replays its own graph
            batch.row_groups = [graph_group(g, top) for g in batch.row_groups]
        batch.token_inputs["editable"] = editable
        batch.row_inputs.update(
            step=[row.block.step for row in batch.rows],
            num_initial_masks=[row.block.num_initial_masks for row in batch.rows],
            **sampling_rows(reqs),
            **config_rows(reqs),
        )
        carry.attach(batch)
        batch.row_tensors.update(state_rows(reqs, self.req_pool.req_to_token.device))
        if any(g is not None for g in gates):
            one = self._one()
            batch.state_write_gate = torch.stack([one if g is None else g for g in gates])
        return batch

    def _add_state(self, batch: ScheduledBatch, req: Req, blk: BlockState, carried: bool,
                   commit: BlockState | None = None) -> tuple[torch.Tensor | None, int]:
        """A hybrid denoise row's state slots (module docstring); returns its write gate
        (None: the host knows whether it writes) and its track slot (a commit forward ending
        on the track grid also snapshots the state for the prefix cache; 0: none)."""
        if req.state_slot is None:
            return None, 0
        if commit is not None:  # merged: the state after the first block (``state_split``)
            track = self.track_slot(req, commit.start + req.block_size)
            batch.add_state(req.state_slot, req.state_slot, track)
            return None, track
        if blk.resolved:  # the commit forward
            track = self.track_slot(req, blk.start + req.block_size)
            batch.add_state(req.state_slot, req.state_slot, track)
            return None, track
        if carried and blk.carry_done is not None:  # the commit forward iff that row is done
            track = self.track_slot(req, blk.start + req.block_size)
            batch.add_state(req.state_slot, req.state_slot, track)
            return blk.carry_done, track
        batch.add_state(req.state_slot, 0)  # a denoise step: the state is discarded
        return None, 0

    def _one(self) -> torch.Tensor:
        one = getattr(self, "_one_tensor", None)
        if one is None:
            one = self._one_tensor = torch.ones((), dtype=torch.int64,
                                                device=self.req_pool.req_to_token.device)
        return one

    def launched_denoise(self, batch: ScheduledBatch,
                         output: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        """The step is queued: each row's next input tokens and algorithm state are its output
        row, on the device, whether or not the host has read it."""
        packed, states = output
        tokens = packed[:, : batch.block_size]
        for i, row in enumerate(batch.rows):
            blk = row.block
            req = self.row_owner(batch, i)
            if req is None:  # finished since the batch was built (a retried launch)
                continue
            if row.commit_half:  # the pair counts as one forward in flight
                blk.commit_launched = True
                continue
            req.inflight += 1
            if row.commit is not None:
                row.commit.commit_launched = True
            if blk.resolved:  # the commit forward
                blk.commit_launched = True
                continue
            blk.step += 1
            blk.carry = (tokens, i)
            if req.state_slot is not None:
                blk.carry_done = packed[i, batch.block_size]
            blk.algo_state = {k: v[i] for k, v in states.items()}

    def apply_denoise(self, batch: ScheduledBatch, output: Any) -> list[Req]:
        """Apply one step's result; returns the requests that committed a block or finished."""
        result = DenoisePost.read(output, trace_top([row.req for row in batch.rows]))

        def apply_row(r: int, req: Req) -> bool:
            blk, track, commit = batch.rows[r].block, batch.rows[r].track, batch.rows[r].commit
            if batch.rows[r].commit_half:  # merged: the block's KV is final (the next row
                req.num_merged_commits += 1  # is this forward's denoise step)
                self.cache_prefix(req, blk.start + req.block_size, track)
                return False
            req.num_forward_passes += 1
            if commit is not None:  # merged: the first block's KV (and state) are final
                req.num_merged_commits += 1
                self.cache_prefix(req, commit.start + req.block_size, track)
                track = 0
            if blk.resolved:  # resolved before this forward: it was the commit forward
                req.num_commit_forwards += 1
                # The block's KV (and state) come from its final tokens now: exact.
                self.cache_prefix(req, blk.start + req.block_size, track)
                if req.denoise.block is blk:
                    req.denoise.block = None
                if self.logits_shift:
                    if req.trace is not None:
                        req.trace.commit_next(result.next_token[r], result.trace[r])
                    self.commit_tokens(req, [result.next_token[r]])
                    return True
                return False
            req.num_denoise_forwards += 1
            if blk.commit_launched and not result.done[r]:
                raise RuntimeError("a block sure to resolve did not (its merged commit "
                                   "was launched)")
            req.track_busy.discard(track)  # gated off: a denoise step after all
            if req.trace is not None:
                req.trace.record_step(blk.start, req.prompt_len, blk.tokens, result.tokens[r],
                                      blk.editable, self.config.mask_token_id,
                                      result.trace[r], result.done[r])
            blk.tokens = result.tokens[r]
            blk.transfers += result.num_transferred[r]
            if result.done[r]:
                self._resolve(req, blk)
                return True
            return req.trace is not None and req.trace.keep_events

        return self.apply_rows(batch, apply_row)

    def _resolve(self, req: Req, blk: BlockState) -> None:
        """The block has no masks left: its tokens are final, so the output is decided now.
        A request that ends inside this block needs no commit forward (its KV would never be
        read again). A forward launched on it since (overlap) was its commit forward."""
        req.num_blocks_committed += 1
        if not self.commit_traced(req, blk.tokens, blk.editable):
            blk.resolved = True
            blk.commit_launched = req.inflight > 0


