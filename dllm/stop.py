"""End-of-output rules (DESIGN §4 "End"): EOS, stop ids, stop strings and the length cap,
searched over a whole committed block, output cut after the first stop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dllm.request import FinishReason, Req


@dataclass(frozen=True)
class StopResult:
    keep: list[int]  # tokens of the block that join the output
    finish_reason: FinishReason | None
    matched: str | int | None = None  # the stop string or token id that ended the output


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text_of(self, req: Req) -> IncrementalText:
        """The request's incrementally decoded output text (made at first use); callers
        ``update`` it with the output so far."""
        if req.text is None:
            req.text = IncrementalText(self.decode)
        return req.text

    def check(self, req: Req, new_tokens: list[int]) -> StopResult:
        """What of ``new_tokens`` (the block's generated tokens, in order) to keep."""
        p = req.params
        cut, reason, matched = len(new_tokens), None, None
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= self.eos_token_ids
        for i, t in enumerate(new_tokens):
            if t in stop_ids:
                cut, reason, matched = i + 1, FinishReason.STOP, t
                break
        if p.stop:
            hit = self._first_stop_string(self.text_of(req), req.output_ids, new_tokens[:cut],
                                          p.stop)
            if hit is not None:
                cut, reason, matched = hit[0], FinishReason.STOP, hit[1]
        room = p.max_new_tokens - len(req.output_ids)
        if cut >= room and (reason is None or cut > room):
            return StopResult(new_tokens[:room], FinishReason.LENGTH)
        return StopResult(new_tokens[:cut], reason, matched)

    def _first_stop_string(self, prev_text: IncrementalText, prev: list[int], new: list[int],
                           stops: list[str]) -> tuple[int, str] | None:
        """Fewest tokens of ``new`` after which the output text contains a stop string that it
        did not contain before, and that string: the one completed first (as vLLM), and of
        several completed by the same token, the one that starts first.

        Only the end of the text can hold a new stop string, so this decodes a window: the
        last ``len(longest stop) - 1`` characters of ``prev``'s text (``prev_text``, kept
        incrementally) and the text of the tokens after its read point, decoded with the
        tokens before it as context (as ``IncrementalText`` does). That is the same text as
        the whole decode's end, at O(block) cost per block."""
        if not new:
            return None
        longest = max(len(s) for s in stops)
        base = prev_text.update(prev)
        start, read = prev_text.window
        context_len = len(self.decode(prev[start:read]))

        def window(k: int) -> str:  # the end of the text of ``prev + new[:k]``
            keep = base[max(0, len(base) - longest + 1) :] if longest > 1 else ""
            return keep + self.decode(prev[start:] + new[:k])[context_len:]

        # Only occurrences that end in the new text count; earlier ones ended the output.
        horizon = max(0, len(window(0)) - longest + 1)
        if not any(s in window(len(new))[horizon:] for s in stops):
            return None
        for k in range(1, len(new) + 1):
            text = window(k)[horizon:]
            hits = [(text.find(s), s) for s in stops if s in text]
            if hits:
                return k, min(hits)[1]
        return None

    def output_text(self, req: Req) -> str:
        """The request's text: special tokens skipped, cut before a matched stop string."""
        text = self.decode(req.output_ids)
        if isinstance(req.stop_matched, str):
            at = text.find(req.stop_matched)
            if at != -1:
                text = text[:at]
        return text


class IncrementalText:
    """The text of a growing token list, decoding only its newest tokens (the prefix/read
    offsets of vLLM's and TGI's incremental detokenizers), so streaming a long output costs
    O(block) per block instead of a decode of the whole output.

    ``update(ids)`` decodes the tokens past the last read point together with the tokens
    read at the previous update (context, so a tokenizer's treatment of a sequence's first
    token stays out of the new text) and appends what the new tokens add. While the newest
    text ends in an incomplete UTF-8 character (``\ufffd``) nothing is appended, so ``text``
    is always a prefix of the full decode."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.text = ""
        self._prefix = 0  # first token of the context window
        self._read = 0  # tokens whose text is in ``text``

    @property
    def window(self) -> tuple[int, int]:
        """(first context token, read point): ``text`` is the text of ``ids[:read]``."""
        return self._prefix, self._read

    def update(self, ids: list[int]) -> str:
        if len(ids) > self._read:
            prefix_text = self.decode(ids[self._prefix : self._read])
            new_text = self.decode(ids[self._prefix :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                self.text += new_text[len(prefix_text) :]
                self._prefix, self._read = self._read, len(ids)
        return self.text
