"""What a diffusion request that asked for it learns about each denoise step: the positions
the step committed, their tokens, the algorithm's confidence and the log-probability, and
the per-token log-probabilities of its output (``SamplingParams.denoise_steps`` and
``SamplingParams.logprobs``).

The device side is ``DenoisePost``'s trace columns (``dllm.denoise``): they travel in the
step's one device→host copy, so a traced step costs no extra synchronisation. This module
is the host side: turning one row of that copy into a ``StepEvent`` and into the request's
``TokenLogprob`` list as its blocks commit. Requests that asked for neither carry no
``ReqTrace`` and nothing here runs for them.

Log-probability of a token (the definition the README gives): ``log_softmax`` of the
logits of the forward that committed it, in float32, at temperature 1, before top-k /
top-p, over the whole vocabulary (the mask token included), at the committed position
(Fast-dLLM v2's shifted logits: the logits that predict the position). A token an
algorithm edits later (LLaDA2.1's joint threshold) takes the value of its last edit.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# Most alternatives one position may report (OpenAI's limit for ``top_logprobs``).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and, when asked, the ``top`` alternatives of the
    same distribution ``[(token_id, logprob), ...]`` best first. ``logprob`` is None for a
    token no traced forward produced (Fast-dLLM v2's first token read in the prefill)."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Committed:
    """A position a step filled (or, ``edit``, re-filled) in the current block."""

    position: int  # index inside the block, 0-based
    token_id: int
    confidence: float  # the algorithm's own score (``DenoiseOutput.confidence``)
    logprob: float
    edit: bool = False


@dataclass(frozen=True)
class StepEvent:
    """One denoise forward of one request. ``block_offset``: the output index of the block's
    first position (negative while the block still holds prompt tokens); ``step``: the
    forward's index within the block (0 = first); ``forward``: the request's denoise
    forwards so far, this one included; ``masked``: positions still masked after it;
    ``given``: on a block's first step, its output positions fixed before any denoise step
    ``(position, token_id)`` (Fast-dLLM v2's first token, read by the previous block's
    commit forward; empty for other models)."""

    block_index: int
    block_offset: int
    block_size: int
    step: int
    forward: int
    masked: tuple[int, ...]
    committed: tuple[Committed, ...]
    done: bool  # the block resolved: no mask left and any edit phase over (tokens final)
    given: tuple[tuple[int, int], ...] = ()


@dataclass
class RowTrace:
    """One row's trace columns, unpacked: per block position the confidence, the
    log-probability of the token the step output, and the top alternatives; then the
    log-probability (and alternatives) of the next block's first token (Fast-dLLM v2's
    commit forward)."""

    confidence: list[float]
    logprob: list[float]
    top: list[tuple[tuple[int, float], ...]]
    next_logprob: float
    next_top: tuple[tuple[int, float], ...]


def trace_columns(block_size: int, k: int) -> int:
    """How many int64 columns a traced step appends to a row of the packed result."""
    return 2 * block_size + 2 * block_size * k + 1 + 2 * k


def trace_width(row_len: int, k: int) -> int:
    """The block width of a traced packed row of ``row_len`` columns (``B + 3`` usual
    columns, then ``trace_columns(B, k)``)."""
    b, rest = divmod(row_len - 4 - 2 * k, 3 + 2 * k)
    if rest or b < 1 or b + 3 + trace_columns(b, k) != row_len:
        raise ValueError(f"a traced row of {row_len} columns fits no block (top {k})")
    return b


def _floats(bits: list[int]) -> list[float]:
    return list(struct.unpack(f"{len(bits)}f", struct.pack(f"{len(bits)}i", *bits)))


def unpack_row(cols: list[int], block_size: int, k: int) -> RowTrace:
    """Inverse of ``DenoisePost``'s trace columns (float32 values travel as their bits)."""
    b = block_size
    conf, lp = _floats(cols[:b]), _floats(cols[b: 2 * b])
    ids = cols[2 * b: 2 * b + b * k]
    vals = _floats(cols[2 * b + b * k: 2 * b + 2 * b * k])
    rest = cols[2 * b + 2 * b * k:]
    top = [tuple(zip(ids[i * k:(i + 1) * k], vals[i * k:(i + 1) * k], strict=True))
           for i in range(b)]
    nxt = _floats(rest[:1])[0]
    next_top = tuple(zip(rest[1:1 + k], _floats(rest[1 + k:1 + 2 * k]), strict=True))
    return RowTrace(conf, lp, top, nxt, next_top)


@dataclass
class ReqTrace:
    """A traced request's host record. ``events``: step events not yet taken by a consumer
    (``take_events``), kept only when ``keep_events``; ``logprobs``: one per output token,
    when ``top`` >= 0 (the alternatives asked for) is not None."""

    keep_events: bool
    top: int | None
    events: list[StepEvent] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    _block_start: int | None = None
    _block_index: int = -1
    _step: int = 0
    _forwards: int = 0
    _at: dict[int, TokenLogprob] = field(default_factory=dict)

    def take_events(self) -> list[StepEvent]:
        events, self.events = self.events, []
        return events

    def record_step(self, block_start: int, prompt_len: int, before: list[int],
                    after: list[int], editable: list[bool], mask_id: int, row: RowTrace,
                    done: bool) -> None:
        """One denoise forward of the block at ``block_start`` (an absolute position):
        ``before``/``after`` its tokens around the step."""
        given: tuple[tuple[int, int], ...] = ()
        if block_start != self._block_start:
            self._block_start, self._block_index, self._step = block_start, \
                self._block_index + 1, 0
            self._at = {}
            given = tuple((i, t) for i, (t, e) in enumerate(zip(before, editable, strict=True))
                          if not e and block_start + i >= prompt_len)
        self._forwards += 1
        committed = []
        for i, (a, b, e) in enumerate(zip(before, after, editable, strict=True)):
            if not e or a == b or b == mask_id:
                continue
            committed.append(Committed(i, b, row.confidence[i], row.logprob[i],
                                       edit=a != mask_id))
            if self.top is not None:
                self._at[i] = TokenLogprob(b, row.logprob[i], row.top[i][: self.top])
        if self.keep_events:
            masked = tuple(i for i, (t, e) in enumerate(zip(after, editable, strict=True))
                           if e and t == mask_id)
            self.events.append(StepEvent(self._block_index, block_start - prompt_len,
                                         len(after), self._step, self._forwards, masked,
                                         tuple(committed), done, given))
        self._step += 1

    def commit(self, tokens: list[int], positions: list[int]) -> None:
        """``tokens`` joined the output, read from the block at ``positions``."""
        if self.top is None:
            return
        for t, i in zip(tokens, positions, strict=False):
            lp = self._at.get(i)
            self.logprobs.append(lp if lp is not None and lp.token_id == t
                                 else TokenLogprob(t, None))

    def commit_next(self, token: int, row: RowTrace | None) -> None:
        """Fast-dLLM v2: the next block's first token, read by the commit forward (``row``;
        None: read in the prefill, no traced forward)."""
        if self.top is None:
            return
        self.logprobs.append(TokenLogprob(token, None) if row is None else
                             TokenLogprob(token, row.next_logprob, row.next_top[: self.top]))
