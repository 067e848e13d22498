"""The server under hostile input and load, full size: the scenarios of
``tests/reliability/harness.py`` against a real ``dllm serve`` of the built-in model on
127.0.0.1, with the counts of issue 25. Prints a figures table and writes
``bench/results/stress-<stamp>-<label>.{md,json}``.

    python bench/stress.py --label after
    python bench/stress.py --label before --python /path/to/other/checkout/.venv/bin/python
    python bench/stress.py --label after --compare bench/results/stress-...-before.json

``--python`` runs the server of another checkout (its own environment): the same client
measures both. ``--compare`` adds a column with an earlier run's figures. Every request loop
is bounded in count and time; all traffic goes to 127.0.0.1. About 10 minutes on 2 cores."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.reliability import harness as h  # noqa: E402

# The connection scenario's server runs with this many open files at most, so that holding
# more connections than that finds out what the server does at its file limit.
MAX_FDS = 640
HOLD = 600
PARTS = ("load", "fuzz", "big_prompts", "slow_sockets", "header_floods", "abort_races",
         "sigterm", "sigint_idle", "connection_limit")


def _new_server(python: str | None) -> bool:
    """Whether that checkout's ``dllm serve`` has this issue's flags."""
    out = subprocess.run([python or sys.executable, "-m", "dllm.server.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=120).stdout
    return "--shutdown-timeout" in out


def run(args: argparse.Namespace) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="dllm-stress-"))
    new = _new_server(args.python)
    print(f"server: {args.python or sys.executable} ({'with' if new else 'without'} the "
          f"issue-25 flags); logs in {logs}", flush=True)
    quick = args.quick
    figures: dict[str, Any] = {}

    def step(name: str, coro_or_value: Any) -> None:
        t = time.perf_counter()
        try:
            value = asyncio.run(coro_or_value) if asyncio.iscoroutine(coro_or_value) \
                else coro_or_value()
        except Exception as exc:  # noqa: BLE001 - a scenario the server broke: recorded
            value = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
        figures[name] = value
        print(f"{name} ({time.perf_counter() - t:.0f} s): {json.dumps(value)}", flush=True)

    parts = set(args.parts)
    term_flags = ("--shutdown-timeout", str(args.shutdown_timeout)) if new else ()
    extra = tuple(shlex.split(args.server_flags))
    specs = [("main", extra)] + ([("term", term_flags + extra)] if "sigterm" in parts else [])
    with h.serving(logs, *specs, python=args.python) as servers:
        s = servers[0]
        if "load" in parts:
            step("load", h.load_with_disconnects(s, n=100 if quick else args.load_requests,
                                                 concurrency=64, drop=0.2, seed=0))
        if "fuzz" in parts:
            step("fuzz", h.fuzz(s, n=200 if quick else 600, seed=0))
        if "big_prompts" in parts:
            step("big_prompts", h.big_prompts(s, chars=9_500_000, parallel=args.parallel,
                                              invalid_items=1_000_000))
        if "slow_sockets" in parts:
            step("slow_sockets", h.slow_sockets(s, silent=8, slow=4, header_timeout=10.0,
                                                body_timeout=30.0))
        if "header_floods" in parts:
            step("header_floods", h.header_floods(s, count=100_000, one_size=100 * 2**20))
            figures["header_floods"]["httptools_installed"] = subprocess.run(
                [args.python or sys.executable, "-c", "import httptools"],
                capture_output=True).returncode == 0  # in the server's environment
        if "abort_races" in parts:
            step("abort_races", h.abort_races(s, trials=20 if quick else 100, seed=0,
                                              list_trials=5 if quick else 20))
        if "sigterm" in parts:
            step("sigterm", h.sigterm_under_load(servers[1], long_streams=6, long_plain=4,
                                                 short=6,
                                                 shutdown_timeout=args.shutdown_timeout))
        if "sigint_idle" in parts:
            step("sigint_idle", lambda: h.sigint_idle(s))
    if "connection_limit" in parts:
        with h.serving(logs, ("fds", extra), python=args.python, max_fds=MAX_FDS) as (fds,):
            step("connection_limit", h.connection_limit(fds, limit=HOLD, extra=20))
    return figures


# ---- the table ------------------------------------------------------------------------------
def rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) in the order of the issue."""
    g = lambda *path: _get(f, path)  # noqa: E731
    out = [
        ("load: requests / concurrency / disconnected", f"{g('load', 'requests')} / "
         f"{g('load', 'concurrency')} / {g('load', 'disconnected')}"),
        ("load: errors among the others", g("load", "errors")),
        ("load: p50 / p99 s", f"{g('load', 'p50_s')} / {g('load', 'p99_s')}"),
        ("load: wall s / requests per s / output tokens per s",
         f"{g('load', 'wall_s')} / {g('load', 'requests_per_s')} / "
         f"{g('load', 'output_tokens_per_s')}"),
        ("load: leaked KV pages / request slots",
         f"{g('load', 'leaked_kv_pages')} / {g('load', 'leaked_request_slots')}"),
        ("load: RSS before / after MB",
         f"{g('load', 'rss_before_mb')} / {g('load', 'rss_after_mb')}"),
        ("load: /health p99 / max ms",
         f"{g('load', 'health_p99_ms')} / {g('load', 'health_max_ms')}"),
        ("fuzz: malformed bodies / not a 4xx OpenAI error",
         f"{g('fuzz', 'bodies')} / {g('fuzz', 'not_4xx_openai')}"),
    ]
    for route, codes in (g("fuzz", "status_by_route") or {}).items():
        out.append((f"fuzz: {route} statuses", ", ".join(f"{k}: {v}" for k, v in codes.items())))
    out.append(("fuzz: /health max ms", g("fuzz", "health_max_ms")))
    n = g("big_prompts", "parallel_n")
    for case, label in (("one", "one 9.5 MB prompt"), ("parallel", "9.5 MB prompts at once"),
                        ("invalid_items", "a body of 10^6 invalid items")):
        c = g("big_prompts", case) or {}
        status = f"{c.get('statuses')} / {c.get('seconds')}"
        out += [(f"{label}: status / s", f"({n} at once) {status}" if case == "parallel"
                 else status),
                (f"{label}: extra RSS MB", c.get("extra_rss_mb")),
                (f"{label}: longest stream gap s (in the 2 s before) / /health max ms",
                 f"{c.get('max_stream_gap_s')} ({c.get('stream_gap_before_s')}) / "
                 f"{c.get('health_max_ms')}")]
    out += [
        ("slow sockets: /health max ms", g("slow_sockets", "health_max_ms")),
        ("silent sockets: closed after s (max)", g("slow_sockets", "silent_closed_max_s")),
        ("slow headers: closed after s (max) / 408s",
         f"{g('slow_sockets', 'slow_headers_closed_max_s')} / "
         f"{g('slow_sockets', 'slow_headers_408')}"),
        ("slow body: closed after s (max) / 408s",
         f"{g('slow_sockets', 'slow_body_closed_max_s')} / "
         f"{g('slow_sockets', 'slow_body_408')}"),
        ("connection limit: over it, 503 / 200 / no answer (of 20)",
         f"{g('connection_limit', 'extra_refused_503')} / "
         f"{g('connection_limit', 'extra_answered_200')} / "
         f"{g('connection_limit', 'extra_no_answer')}"),
        ("connection limit: slowest answer s / log growth KB",
         f"{g('connection_limit', 'extra_answer_max_s')} / "
         f"{g('connection_limit', 'log_growth_kb')}"),
        ("100,000 headers: status / extra RSS MB",
         f"{g('header_floods', 'many_headers', 'status')} / "
         f"{g('header_floods', 'many_headers', 'extra_rss_mb')}"),
        ("one 100 MB header: status / extra RSS MB",
         f"{g('header_floods', 'one_big_header', 'status')} / "
         f"{g('header_floods', 'one_big_header', 'extra_rss_mb')}"),
        ("header floods: /health max ms", g("header_floods", "health_max_ms")),
        ("httptools installed (the server's environment)",
         g("header_floods", "httptools_installed")),
        ("abort races: trials + list trials / mismatches",
         f"{g('abort_races', 'trials')} + {g('abort_races', 'list_trials')} / "
         f"{g('abort_races', 'mismatches')}"),
        ("abort races: /health max ms", g("abort_races", "health_max_ms")),
        ("SIGTERM under load: outcomes", json.dumps(g("sigterm", "outcomes"))),
        ("SIGTERM: bad endings / exit code / exit s / tracebacks",
         f"{g('sigterm', 'bad')} / {g('sigterm', 'exit_code')} / {g('sigterm', 'exit_s')} / "
         f"{g('sigterm', 'tracebacks')}"),
        ("SIGINT idle: exit code / tracebacks",
         f"{g('sigint_idle', 'exit_code')} / {g('sigint_idle', 'tracebacks')}"),
    ]
    la = g("load_average") or {}
    out.append(("machine load average (1, 5, 15 min) at start / end",
                f"{la.get('start')} / {la.get('end')}"))
    return [(k, str(v)) for k, v in out]


def _get(f: dict, path: tuple) -> Any:
    for p in path:
        if not isinstance(f, dict) or p not in f:
            return None
        f = f[p]
    return f


def table(columns: list[tuple[str, dict]]) -> str:
    names = [r[0] for r in rows(columns[0][1])]
    values = [dict(rows(f)) for _, f in columns]
    lines = ["| figure | " + " | ".join(label for label, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(v.get(name, "") for v in values) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="after", help="this run's column name")
    p.add_argument("--python", default=None,
                   help="the interpreter whose dllm serves (another checkout's venv)")
    p.add_argument("--server-flags", default="",
                   help="more flags for every `dllm serve` started, as one string "
                        "('--engine-nice 0'): an A/B of a server setting")
    p.add_argument("--load-requests", type=int, default=1000,
                   help="requests of the load scenario (64 at once, 20%% disconnected)")
    p.add_argument("--same-session", action="store_true",
                   help="start the servers in this command's session (default: each in its "
                        "own, as a server started elsewhere; in one session Linux shares the "
                        "CPU among the client's and the server's threads together)")
    p.add_argument("--compare", default=None, help="an earlier run's .json: a column of it")
    p.add_argument("--parallel", type=int, default=8, help="9.5 MB prompts sent at once")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="the SIGTERM scenario's grace (the old server's is fixed at 5 s)")
    p.add_argument("--quick", action="store_true", help="smaller counts (a try-out)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, metavar="PART",
                   help=f"the scenarios to run (default: all of {', '.join(PARTS)})")
    p.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                   help="run nothing: print and write the table of these runs' .json files, "
                        "one column each")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    from bench.report import stamp, write_report

    if args.combine:
        runs = [json.loads(Path(f).read_text()) for f in args.combine]
        md = table([(r["label"], r["figures"]) for r in runs])
        print(md)
        header = ("# stress: " + " / ".join(f"{r['label']} (server `{r['python']}`, client "
                                            f"commit {r['commit']})" for r in runs) + "\n\n")
        print(f"wrote {write_report(args.out, 'stress', header + md, {'runs': args.combine}, f'{stamp()}-combined')}")
        return 0
    h.OWN_SESSION = not args.same_session
    t = time.perf_counter()
    load_start = os.getloadavg()
    figures = run(args)
    figures["load_average"] = {"start": [round(x, 2) for x in load_start],
                               "end": [round(x, 2) for x in os.getloadavg()]}
    if "big_prompts" in figures:
        figures["big_prompts"]["parallel_n"] = args.parallel
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    payload = {"label": args.label, "commit": commit, "python": args.python or sys.executable,
               "server_flags": args.server_flags, "same_session": args.same_session,
               "seconds": round(time.perf_counter() - t), "platform": platform.platform(),
               "figures": figures}
    columns = [(args.label, figures)]
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        columns.insert(0, (before["label"], before["figures"]))
    md = table(columns)
    print(md)
    header = (f"# stress ({args.label})\n\n`bench/stress.py`, the built-in model on CPU, "
              f"{platform.platform()}; client commit {commit}, server: "
              f"`{args.python or sys.executable}`"
              + (f", flags `{args.server_flags}`" if args.server_flags else "") + ".\n\n")
    path = write_report(args.out, "stress", header + md, payload, f"{stamp()}-{args.label}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
