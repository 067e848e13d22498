"""``--watch`` (``dllm.watch``): the built-in model answering 348 + 127, drawn on a terminal
(in place, coloured by step, masks as ░) and as plain lines; and the real CLI of ``dllm
chat --watch`` and ``dllm generate --watch`` in a subprocess (stdout a pipe: plain lines)."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from dllm import LLM, SamplingParams
from dllm.watch import MASK_TTY, STEP_COLOURS, Watcher

# The CLI as the console script runs it (``main`` reads sys.argv).
DLLM = [sys.executable, "-c", "import sys; from dllm.server.cli import main; sys.exit(main())"]
QUESTION = [{"role": "user", "content": "What is 348 + 127?"}]
ONE_PER_STEP = {"algorithm": "low_confidence_static", "steps_per_block": 8}


@pytest.fixture(scope="module")
def builtin() -> LLM:
    return LLM(None)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_drawing_passes_through_masked_states(builtin):
    term = Terminal()
    out = Watcher(builtin.engine, term, delay=0).run(
        QUESTION, SamplingParams(max_new_tokens=16, dllm=ONE_PER_STEP))
    assert out.text.strip() == "475"
    text = term.getvalue()
    drawings = text.split("\r\x1b[J")[1:]  # each redraw clears from the line start
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", d) for d in drawings]
    assert plain[0] == MASK_TTY * 3  # the answer's first block starts all masked (3 free)
    assert any(MASK_TTY in p and p.strip(MASK_TTY) for p in plain)  # partly filled
    final, stats = plain[-1].split("\n")[:2]
    assert final == "475"
    assert stats.startswith(f"[{out.completion_tokens} tokens, {out.num_forward_passes} "
                            f"forwards ({out.num_denoise_forwards} denoise")
    # Each digit in the colour of the step that committed it: three different steps here.
    colours = re.findall(r"\x1b\[38;5;(\d+)m([^\x1b])", drawings[-1].split("\n")[0])
    assert [c for _, c in colours] == list("475")
    assert len({int(k) for k, _ in colours}) == 3 <= len(STEP_COLOURS)
    builtin.engine.check_memory()


def test_plain_lines_off_a_terminal(builtin):
    buf = io.StringIO()
    out = Watcher(builtin.engine, buf).run(
        QUESTION, SamplingParams(max_new_tokens=16, dllm=ONE_PER_STEP))
    lines = buf.getvalue().splitlines()
    assert "\x1b" not in buf.getvalue()
    assert lines[0] == "block 0 start: ___"
    steps = [ln for ln in lines if re.match(r"block \d+ step \d+: ", ln)]
    assert len(steps) == out.num_denoise_forwards
    assert lines[-2] == out.text == "475"
    assert lines[-1].startswith("[")


@pytest.mark.parametrize("argv", [
    ["chat", "--watch", "What is 348 + 127?"],
    ["generate", "--watch", "--chat", "--dllm", '{"algorithm": "low_confidence_static", '
     '"steps_per_block": 8}', "What is 348 + 127?"],
])
def test_cli_watch(argv):
    r = subprocess.run([*DLLM, *argv], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("block 0 start: _")
    assert lines[-2] == "475" and "tokens/denoise forward" in lines[-1]


def test_cli_watch_refuses_a_file(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    r = subprocess.run([*DLLM, "generate", "--watch", "--input",
                        str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--watch" in r.stderr and "Traceback" not in r.stderr
