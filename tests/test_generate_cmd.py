"""``dllm generate``: JSONL in the OpenAI batch shape, bad lines, resume, and one prompt on the
terminal (run through ``dllm.server.cli.main`` in-process, on the tiny SDAR checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm.server.cli import main
from dllm.server.generate_cmd import parse_line

MALFORMED_LINE = 17  # 1-based


def write_lines(path: Path, lines: list) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def read_out(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def fifty_lines() -> list:
    lines: list = []
    for n in range(1, 51):
        if n == MALFORMED_LINE:
            lines.append('{"prompt": "broken", ')
        elif n % 3 == 0:
            lines.append({"custom_id": f"req-{n}", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"messages": [{"role": "user", "content": f"Question {n}"}],
                                   "max_tokens": 3, "ignore_eos": True}})
        elif n % 3 == 1:
            lines.append({"prompt": f"Prompt number {n}", "ignore_eos": True})
        else:
            lines.append({"custom_id": f"chat-{n}", "ignore_eos": True,
                          "messages": [{"role": "user", "content": f"Hello {n}"}]})
    return lines


def run(*argv: str) -> int:
    return main(["generate", *argv])


def test_fifty_lines_one_malformed_then_resume(sdar_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, fifty_lines())
    assert run("--model", sdar_dir, "--input", str(inp), "--output", str(out),
               "--max-new-tokens", "4") == 0
    rows = read_out(out)
    assert len(rows) == 50
    errors = [r for r in rows if r["error"] is not None]
    assert [r["custom_id"] for r in errors] == [f"line-{MALFORMED_LINE}"]
    assert errors[0]["response"] is None and errors[0]["error"]["code"] == "invalid_json"
    ok = {r["custom_id"]: r for r in rows if r["error"] is None}
    assert len(ok) == 49
    for n in range(1, 51):
        if n == MALFORMED_LINE:
            continue
        cid = f"req-{n}" if n % 3 == 0 else (f"line-{n}" if n % 3 == 1 else f"chat-{n}")
        row = ok[cid]
        assert row["id"].startswith("batch_req_")
        resp = row["response"]
        assert resp["status_code"] == 200 and resp["request_id"] == resp["body"]["id"]
        body = resp["body"]
        # The flag is the default (4); a line's own max_tokens (3) wins.
        assert body["usage"]["completion_tokens"] == (3 if n % 3 == 0 else 4)
        if n % 3 == 1:
            assert body["object"] == "text_completion" and isinstance(
                body["choices"][0]["text"], str)
        else:
            assert body["object"] == "chat.completion"
            assert body["choices"][0]["message"]["role"] == "assistant"
    assert "49 done, 1 failed, 0 skipped" in capsys.readouterr().err

    # A re-run finds everything done.
    assert run("--model", sdar_dir, "--input", str(inp), "--output", str(out)) == 0
    assert read_out(out) == rows
    assert "0 done, 0 failed, 50 skipped" in capsys.readouterr().err

    # An interrupted run (30 lines written, the 31st torn) is completed, not repeated.
    kept = out.read_text().splitlines(keepends=True)[:30]
    out.write_text("".join(kept) + '{"id": "batch_req_torn", "custom_')
    assert run("--model", sdar_dir, "--input", str(inp), "--output", str(out),
               "--max-new-tokens", "4") == 0
    lines = out.read_text().splitlines()
    assert lines[30] == '{"id": "batch_req_torn", "custom_'
    again = [json.loads(x) for i, x in enumerate(lines) if i != 30]
    assert len(again) == 50
    assert sorted(r["custom_id"] for r in again) == sorted(r["custom_id"] for r in rows)
    assert "20 done, 0 failed, 30 skipped" in capsys.readouterr().err


def test_bad_lines_are_reported_and_the_rest_go_on(sdar_dir, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [
        {"custom_id": "good", "prompt": "fine", "max_tokens": 2},
        {"custom_id": "too-long", "prompt": "hi", "max_tokens": 10**6},
        {"custom_id": "bad-type", "prompt": "hi", "max_tokens": "many"},
        {"custom_id": "bad-temp", "prompt": "hi", "temperature": -1},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {"custom_id": "no-body", "method": "POST", "url": "/v1/completions"},
        {"custom_id": "unknown-model", "prompt": "hi", "model": "other"},
        {"custom_id": "n0", "prompt": "hi", "n": 0},
        ["not", "an", "object"],
        {"neither": "prompt nor messages"},
        {"custom_id": "good", "prompt": "duplicate id"},
        "",
        {"custom_id": "good-2", "prompt": "also fine", "max_tokens": 2},
    ])
    assert run("--model", sdar_dir, "--input", str(inp), "--output", str(out)) == 0
    rows = {r["custom_id"]: r for r in read_out(out)}
    assert rows["good"]["error"] is None and rows["good-2"]["error"] is None
    for cid, status in [("too-long", 400), ("bad-type", 400), ("bad-temp", 400),
                        ("unknown-model", 404), ("n0", 400)]:
        r = rows[cid]
        assert r["response"]["status_code"] == status, r
        assert r["response"]["body"]["error"]["message"] == r["error"]["message"]
        assert r["error"]["code"]
    for cid in ("bad-url", "no-body", "line-9", "line-10"):
        assert rows[cid]["response"] is None and rows[cid]["error"]["message"], cid
    # The duplicate custom_id is reported under its line's own id, not the repeated one.
    assert len(read_out(out)) == 12
    assert [r["custom_id"] for r in read_out(out)].count("good") == 1
    dup = rows["line-11"]
    assert dup["error"]["code"] == "duplicate_custom_id" and dup["response"] is None
    assert "'good'" in dup["error"]["message"] and "line 1" in dup["error"]["message"]
    assert "too-long" in rows and "context length" in rows["too-long"]["error"]["message"]


def test_prompt_on_the_terminal_matches_jsonl(sdar_dir, tmp_path, capsys):
    assert run("--model", sdar_dir, "Diffusion models write", "--max-new-tokens", "10") == 0
    printed = capsys.readouterr().out
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"prompt": "Diffusion models write", "max_tokens": 10}])
    assert run("--model", sdar_dir, "--input", str(inp), "--output", str(out)) == 0
    body = read_out(out)[0]["response"]["body"]
    assert printed == body["choices"][0]["text"] + "\n"


def test_chat_prompt_on_the_terminal(sdar_dir, capsys):
    assert run("--model", sdar_dir, "--chat", "Hello", "--max-new-tokens", "5") == 0
    assert capsys.readouterr().out.endswith("\n")


@pytest.mark.parametrize("argv,message", [
    (["--input", "x.jsonl"], "go together"),
    (["a prompt", "--input", "a", "--output", "b"], "not both"),
    ([], "give a prompt"),
])
def test_usage_errors(sdar_dir, capsys, argv, message):
    assert run("--model", sdar_dir, *argv) == 2
    assert message in capsys.readouterr().err


def test_parse_line():
    assert parse_line('{"prompt": "hi"}', 3).custom_id == "line-3"
    job = parse_line('{"custom_id": "a", "messages": [{"role": "user", "content": "x"}]}', 1)
    assert (job.custom_id, job.url, job.error) == ("a", "/v1/chat/completions", None)
    assert "custom_id" not in job.body
    job = parse_line('{"custom_id": "b", "method": "GET", "url": "/v1/completions", '
                     '"body": {}}', 2)
    assert job.error["message"] == "method must be POST"
    assert parse_line("{", 4).error["code"] == "invalid_json"
    assert parse_line('{"custom_id": 5, "prompt": "x"}', 5).custom_id == "line-5"
