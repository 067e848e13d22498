"""A newcomer's mistakes, through the real commands: each is refused with a non-zero exit and
exactly one line on stderr that names the thing to fix (no traceback)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dllm.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
_SCRIPT = Path(sys.executable).with_name("dllm")  # the console script, where it is installed
DLLM = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "dllm.server.cli"]


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def copy_checkpoint(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- packaging and the package ------------------------------------------------------------
def test_license_is_apache_2_and_packaged():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX" in text
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]


def test_dir_lists_the_lazy_public_names(tmp_path):
    code = ("import sys, dllm; names = dir(dllm); "
            "print(all(n in names for n in dllm.__all__), 'dllm.llm' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, check=True)
    assert proc.stdout.split() == ["True", "False"]  # listed, and still not imported
    import dllm

    assert {"LLM", "AsyncLLM", "SamplingParams", "EngineConfig", "RequestOutput",
            "StreamChunk"} <= set(dir(dllm))
    assert "__version__" in dir(dllm)


# ---- a broken checkpoint ------------------------------------------------------------------
def _no_vocab_size(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    del config["vocab_size"]
    (d / "config.json").write_text(json.dumps(config))


def _malformed(d: Path) -> None:
    (d / "config.json").write_text('{"architectures": ["SDARForCausalLM"],\n')


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("breakage, problem", [(_no_vocab_size, "has no 'vocab_size' entry"),
                                               (_malformed, "is not valid JSON")])
def test_bad_config_json(sdar_dir, tmp_path, command, breakage, problem):
    bad = copy_checkpoint(sdar_dir, tmp_path / "BAD")
    breakage(bad)
    line = one_error_line(run([*DLLM, command, "--model", "BAD", "hi"], tmp_path))
    assert line.startswith("dllm: error: BAD/config.json ") and problem in line, line


def test_missing_tokenizer_files(sdar_dir, tmp_path):
    bad = copy_checkpoint(sdar_dir, tmp_path / "notok")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bad / name).unlink(missing_ok=True)
    line = one_error_line(run([*DLLM, "generate", "--model", "notok", "hi"], tmp_path))
    assert "notok has no tokenizer: missing tokenizer.json and tokenizer_config.json" in line
    assert "upgrade" not in line and "architecture" not in line

    (bad / "tokenizer_config.json").write_text("{}")  # only the vocabulary is missing
    with pytest.raises(ValueError, match=r"has no tokenizer: missing tokenizer\.json \("):
        load_tokenizer(str(bad))


# ---- dllm generate --input/--output -------------------------------------------------------
def test_output_that_is_a_directory_is_refused_before_loading(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "results").mkdir()
    # No such model: the refusal must come before anything is loaded.
    proc = run([*DLLM, "generate", "--model", "no-such-model", "--input", "in.jsonl",
                "--output", "results"], tmp_path)
    line = one_error_line(proc)
    assert line == ("dllm: error: --output results is a directory; give the path of a JSONL "
                    "file (created, or appended to)")
    assert os.listdir(tmp_path / "results") == []


def test_duplicate_custom_id_gets_its_own_line_id_and_resume_skips_it(tmp_path):
    lines = [{"custom_id": "q1", "prompt": "1+1=", "max_tokens": 4},
             {"custom_id": "q1", "prompt": "2+2=", "max_tokens": 4},
             {"prompt": "3+3=", "max_tokens": 4}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [*DLLM, "generate", "--input", "in.jsonl", "--output", "out.jsonl"]  # built-in model
    proc = run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in rows}
    assert len(rows) == 3 and set(by_id) == {"q1", "line-2", "line-3"}
    assert by_id["q1"]["error"] is None and by_id["line-3"]["error"] is None
    dup = by_id["line-2"]["error"]
    assert dup["code"] == "duplicate_custom_id"
    assert dup["message"].startswith("line 2 repeats custom_id 'q1' of line 1")
    # A re-run finds every id, the duplicate's included, already there: nothing new is written.
    proc = run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "0 done, 0 failed, 3 skipped" in proc.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3


# ---- python -m dllm.testing ---------------------------------------------------------------
def test_testing_factory_refuses_an_existing_file(tmp_path):
    (tmp_path / "taken").write_text("not a checkpoint")
    proc = run([sys.executable, "-m", "dllm.testing", "SDARForCausalLM", "taken"], tmp_path)
    assert one_error_line(proc) == ("python -m dllm.testing: error: taken is an existing file, "
                                    "not a directory; give a directory path (created if missing)")
    assert (tmp_path / "taken").read_text() == "not a checkpoint"


# ---- the rest of the first hour: flags, devices, Ctrl-C, serve ----------------------------
# One interpreter runs every in-process case (each would otherwise import torch again): the
# console script is ``dllm.server.cli:main``, called here with each case's argv, its stderr
# and its exit status recorded.
_BATCH = r"""
import contextlib, io, json, sys, traceback
from dllm.server.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc(file=err)
            code = "raised"
    results.append({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()})
print(json.dumps(results))
"""

CASES = {
    "json": (["generate", "--dllm", "{threshold: 0.9}", "hi"],
             "dllm generate: error: argument --dllm: '{threshold: 0.9}' is not JSON; give a "
             """JSON object with the keys in double quotes, e.g. '{"threshold": 0.9}'"""),
    "typo": (["serve", "--max-modle-len", "64"],
             "dllm serve: error: unrecognized argument: --max-modle-len (did you mean "
             "--max-model-len?); 'dllm serve --help' lists the flags"),
    "cuda": (["generate", "--device", "cuda", "hi"], "dllm: error: --device cuda: no CUDA device "
             "here (torch {torch} is a CPU-only build); use --device cpu"),
    "mps": (["chat", "--device", "mps", "hi"], "dllm: error: --device mps: dllm runs on CUDA "
            "GPUs and on the CPU only (mps is not supported); use --device cpu"),
    "max-new-tokens": (["generate", "--max-new-tokens", "100000000", "What is 2+2?"],
                       "dllm: error: --max-new-tokens 100000000 does not fit the context length "
                       "of {context} tokens (prompt + output; --max-model-len sets it, up to "
                       "the model's)"),
    "two-models": (["serve", "/a", "--model", "/b"],
                   "dllm: error: two models given: /a and --model /b; give one"),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the --device cuda case needs a machine without CUDA")
    argvs = [argv for argv, _ in CASES.values()] + [
        ["generate", "What is 2+2?", "--max-new-tokens", "8"],  # a plain prompt: a hint
        ["chat", "--trust-remote-code", "What is 17+25?"]]
    proc = subprocess.run([sys.executable, "-c", _BATCH, json.dumps(argvs)],
                          cwd=tmp_path_factory.mktemp("batch"), capture_output=True, text=True,
                          timeout=300, check=True)
    results = json.loads(proc.stdout)
    return dict(zip([*CASES, "hint", "trust"], results, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_mistake_is_one_line_naming_the_flag(batch, case):
    import torch

    from dllm.checkpoint import BUILTIN_MODEL_DIR

    r = batch[case]
    assert r["code"] == 2 and "Traceback" not in r["stderr"], r
    lines = r["stderr"].strip().splitlines()
    context = json.loads((BUILTIN_MODEL_DIR / "config.json").read_text()).get(
        "max_position_embeddings")
    expected = CASES[case][1].replace("{torch}", torch.__version__).replace(
        "{context}", str(context))
    if case == "typo":  # the subcommand's usage, then the line
        assert lines[0].startswith("usage: dllm serve ") and lines[-1] == expected, lines
    else:
        assert lines == [expected]


def test_plain_prompt_to_the_chat_only_model_gets_a_hint(batch):
    r = batch["hint"]
    assert r["code"] == 0, r
    assert r["stderr"].strip().splitlines() == [
        "dllm: hint: this model was trained on chat messages only; add --chat (or use dllm "
        "chat) to have the prompt answered"]


def test_trust_remote_code_is_accepted_with_a_note(batch):
    r = batch["trust"]
    assert r["code"] == 0 and r["stdout"] == "42\n", r
    assert r["stderr"].strip().splitlines() == [
        "dllm: note: --trust-remote-code is not needed: dllm runs no code from checkpoints "
        "(every architecture is implemented here)"]


def _default_sigint() -> None:
    """In the child: Ctrl-C as at a terminal. A suite started in the background by a
    non-interactive shell inherits SIGINT ignored, and the CLI rightly keeps it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(cmd: list[str], cwd: Path, ready) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 120
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_ctrl_c_while_chat_loads_is_one_line(tmp_path):
    start = time.monotonic()
    proc = _interrupt([*DLLM, "chat", "What is 17+25?"], tmp_path,
                      lambda: time.monotonic() - start > 1.5)
    assert proc.returncode == 130
    assert one_error_line(proc) == "dllm: interrupted"


def test_ctrl_c_during_generate_input_is_one_line_and_resume_works(tmp_path):
    lines = [{"custom_id": f"q{i}", "messages": [{"role": "user", "content": f"What is {i}+1?"}],
              "max_tokens": 8} for i in range(3000)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    proc = _interrupt([*DLLM, "generate", "--input", "in.jsonl", "--output", "out.jsonl",
                       "--max-running-requests", "4"], tmp_path,
                      lambda: out.is_file() and out.stat().st_size > 0)
    assert proc.returncode == 130
    assert one_error_line(proc) == ("dllm: interrupted; the lines finished are in out.jsonl; "
                                    "the same command again resumes (it skips their "
                                    "custom_ids)")
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    assert 0 < len(rows) < len(lines) and all(r["error"] is None for r in rows)


def test_serve_with_a_bad_model_fails_before_binding(sdar_dir, tmp_path):
    bad = copy_checkpoint(sdar_dir, tmp_path / "BAD")
    _no_vocab_size(bad)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run([*DLLM, "serve", "BAD", "--port", str(port)], tmp_path)
    line = one_error_line(proc)  # no "Uvicorn running", no traceback
    assert line.startswith("dllm: error: BAD/config.json ") and "vocab_size" in line, line
    assert proc.returncode == 2
