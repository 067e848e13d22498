"""``--watch`` of ``dllm chat`` and ``dllm generate``: one request run on the engine with its
step events on (``SamplingParams.denoise_steps``), drawn as it denoises.

On a terminal the answer is redrawn in place after every denoise step: the tokens committed
so far, each coloured by the step of its block that committed it (step 0 red, then orange,
yellow, green, ...), and the current block's still-masked positions as ``░``. Elsewhere
(a pipe, a file) each step is one plain line, ``block B step S: text with _ for masks``
(and ``block B start:`` for a block before its first step).
Either way the answer ends with a line of statistics: tokens, forwards, tokens per forward
and seconds (the drawing pauses left out)."""

from __future__ import annotations

import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from dllm.trace import StepEvent

MASK_TTY, MASK_PLAIN = "░", "_"
# ANSI 256-colour foregrounds by step within a block (then repeating).
STEP_COLOURS = (196, 208, 220, 46, 51, 33, 129, 201)
DEFAULT_DELAY_S = 0.08  # pause per step on a terminal, so the eye can follow it
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Canvas:
    """The answer as the step events draw it: output index -> (text, step that wrote it),
    and the current block's masked output indices."""

    pieces: dict[int, tuple[str, int]] = field(default_factory=dict)
    masked: set[int] = field(default_factory=set)

    def start_block(self, ev: StepEvent, decode: Any) -> None:
        """The block of ``ev`` (its first step) as it was before that step: all masked."""
        for i, t in ev.given:
            self.pieces[ev.block_offset + i] = (decode([t]), 0)
        before = {*ev.masked, *(c.position for c in ev.committed)}
        self.masked = {ev.block_offset + i for i in before if ev.block_offset + i >= 0}

    def apply(self, ev: StepEvent, decode: Any) -> None:
        for c in ev.committed:
            self.pieces[ev.block_offset + c.position] = (decode([c.token_id]), ev.step)
        self.masked = {ev.block_offset + i for i in ev.masked if ev.block_offset + i >= 0}

    def render(self, colour: bool, limit: int | None = None) -> str:
        """The answer so far; ``limit``: output tokens to show (the final output's count)."""
        end = max([*self.pieces, *self.masked], default=-1) + 1
        if limit is not None:
            end = min(end, limit)
        parts = []
        for i in range(end):
            if i in self.masked or i not in self.pieces:
                parts.append(MASK_TTY if colour else MASK_PLAIN)
                continue
            text, step = self.pieces[i]
            text = text.replace("\n", "↵") if limit is None else text
            parts.append(f"\x1b[38;5;{STEP_COLOURS[step % len(STEP_COLOURS)]}m{text}\x1b[0m"
                         if colour else text)
        return "".join(parts)


class Watcher:
    """Draws one request's steps on ``out``; ``tty`` None: whether ``out`` is a terminal."""

    def __init__(self, engine: Any, out: TextIO | None = None, tty: bool | None = None,
                 delay: float | None = None):
        self.engine = engine
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.delay = (DEFAULT_DELAY_S if self.tty else 0.0) if delay is None else delay
        self._lines = 0  # lines of the last in-place drawing
        self._slept = 0.0  # seconds of --watch-delay pauses (left out of the time shown)

    def run(self, prompt: Any, params: Any) -> Any:
        """Run ``prompt`` (text, ids or chat messages) to its end, drawing each step; the
        request's output."""
        import dataclasses

        e = self.engine
        req = e.make_request(prompt, dataclasses.replace(params, denoise_steps=True))
        def decode(ids: list[int]) -> str:  # special tokens (EOS padding) drawn as nothing
            return e.tokenizer.decode(ids, skip_special_tokens=True)

        canvas = Canvas()
        start = time.perf_counter()
        e.add_request(req)
        try:
            while not req.finished:
                e.step()
                for ev in req.trace.take_events():
                    if ev.step == 0:  # a new block: first all masks
                        canvas.start_block(ev, decode)
                        self._draw(canvas, ev, before=True)
                    canvas.apply(ev, decode)
                    self._draw(canvas, ev)
        except BaseException:
            if not req.finished:
                e.abort(req.rid)
            raise
        finally:
            e.drain()
        seconds = time.perf_counter() - start - self._slept
        out = e.output_of(req)
        if self.tty:
            self._redraw(canvas.render(True, out.completion_tokens))
            self.out.write("\n")
        else:
            self.out.write(out.text + "\n")
        self.out.write(stats_line(out, seconds) + "\n")
        self.out.flush()
        return out

    def _draw(self, canvas: Canvas, ev: StepEvent, before: bool = False) -> None:
        if self.tty:
            self._redraw(canvas.render(True))
        else:
            label = "start" if before else f"step {ev.step}"
            self.out.write(f"block {ev.block_index} {label}: {canvas.render(False)}\n")
        self.out.flush()
        if self.delay:
            time.sleep(self.delay)
            self._slept += self.delay

    def _redraw(self, text: str) -> None:
        """Replace the last drawing with ``text`` (cursor back up over its lines)."""
        if self._lines > 1:
            self.out.write(f"\x1b[{self._lines - 1}F")
        self.out.write("\r\x1b[J" + text)
        width = max(shutil.get_terminal_size().columns, 1)
        visible = len(_ANSI.sub("", text))
        self._lines = max(1, -(-visible // width))


def add_watch_flags(p: Any, what: str) -> None:
    """``--watch`` and ``--watch-delay`` on an argparse parser; ``what``: what is shown."""
    p.add_argument("--watch", action="store_true",
                   help=f"{what}: the block redrawn after every denoise step (masked positions "
                        "as ░, tokens coloured by the step that committed them), then "
                        "forwards, tokens per forward and time; one plain line per step when "
                        "stdout is not a terminal")
    p.add_argument("--watch-delay", type=float, default=None, metavar="SECONDS",
                   help="with --watch: pause after each drawn step (default 0.08 on a "
                        "terminal, 0 otherwise)")


def stats_line(out: Any, seconds: float) -> str:
    n = out.completion_tokens
    forwards = out.num_denoise_forwards or out.num_forward_passes
    return (f"[{n} tokens, {out.num_forward_passes} forwards ({out.num_denoise_forwards} "
            f"denoise, {out.num_blocks} blocks), {n / max(forwards, 1):.2f} tokens/denoise "
            f"forward, {seconds:.2f} s]")
