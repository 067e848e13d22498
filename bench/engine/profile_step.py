"""Where one engine step's time goes, on a GPU: the kernels of a denoise (or decode) step and
the host work around them, from ``torch.profiler``, for a random-weight model of real shape.

    python bench/engine/profile_step.py --model sdar-8b --batch-size 1 --runner cuda_graph

Prints the host time of each phase of a step (scheduling, loading the inputs, attention
planning, launching, reading the result, applying it), the top kernels by GPU time per step
(with launches per step), the top host-side operators, and the step's wall time next to the sum
of its kernel times (the difference is GPU idle time: host work the GPU waits for). Writes a
Chrome trace and the tables under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from offline import SHAPES, checkpoint_dir, warm_engine  # noqa: E402
from report import require_cuda  # noqa: E402


def time_phases(engine, steps: int) -> tuple[float, dict[str, float]]:
    """Host seconds per step spent in each phase (timers around the engine's own methods,
    no synchronisation added; ``read`` includes waiting for the GPU), and the step wall."""
    from dllm.denoise import DenoisePost

    spent: dict[str, float] = defaultdict(float)

    def timed(label, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] += time.perf_counter() - t
        return wrapper

    sched = engine.scheduler
    sched.schedule = timed("schedule", sched.schedule)
    for name in ("apply_denoise", "apply_prefill", "apply_tokens"):
        if hasattr(sched, name):
            setattr(sched, name, timed("apply (incl. read)", getattr(sched, name)))
    for r in engine.runner.runners:
        kind = type(r).__name__
        r.load_batch = timed(f"{kind}.load_batch (incl. plan)", r.load_batch)
        r.execute = timed(f"{kind}.execute", r.execute)
        for b in [*getattr(r, "backends", {}).values()]:
            b.plan = timed("attention plan", b.plan)
    eager_backend = engine.runner.backend
    if hasattr(eager_backend, "_plan"):  # the eager runner plans lazily, inside execute
        eager_backend._plan = timed("attention plan (eager, inside execute)",
                                    eager_backend._plan)
    read = DenoisePost.read
    DenoisePost.read = staticmethod(timed("read result (waits for the GPU)", read))
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    finally:
        DenoisePost.read = read
    return wall, {k: v / steps for k, v in spent.items()}


GAP_LIMIT_US = 50  # a longer idle stretch is the GPU waiting for the host between steps


def gap_summary(spans: list[tuple[float, float, str]], steps: int, top: int = 8) -> dict:
    """Idle time between consecutive kernels (start-sorted, µs), per step: how much of the
    step's span no kernel runs, and which kernel transitions it sits in; gaps of
    ``GAP_LIMIT_US`` or more (between steps: the device waiting for the host) apart."""
    spans = sorted(spans)
    total, count, overlaps = 0.0, 0, 0
    pairs: dict[tuple[str, str], list[float]] = {}
    long_pairs: dict[tuple[str, str], list[float]] = {}
    end = None
    for (start, _stop, name), prev in zip(spans[1:], spans[:-1], strict=True):
        end = prev[1] if end is None else max(end, prev[1])
        gap = start - end
        if gap < 0:
            overlaps += 1
            continue
        if gap < GAP_LIMIT_US:
            total += gap
            count += 1
        p = (pairs if gap < GAP_LIMIT_US else long_pairs).setdefault((prev[2], name), [0.0, 0])
        p[0] += gap
        p[1] += 1

    def ranked(d):
        return [(k, (t / steps, c / steps))
                for k, (t, c) in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]]
    return dict(gap_ms=total / steps / 1e3, gaps=count / steps, overlaps=overlaps / steps,
                mean_us=total / max(count, 1), top=ranked(pairs),
                long_ms=sum(t for t, _ in long_pairs.values()) / steps / 1e3,
                long_top=ranked(long_pairs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="sdar-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--runner", default="cuda_graph", choices=["cuda_graph", "eager"])
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-overlap", action="store_true",
                    help="read each step's result before queueing the next")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    from torch.profiler import ProfilerActivity, profile

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = (f"{args.model}-bs{args.batch_size}-{args.runner}-{args.backend}"
           f"{'-plain' if args.no_overlap else ''}")
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint_dir(args.model, Path(tmp))
        llm = warm_engine(path, args.batch_size, args.runner == "cuda_graph", args.backend,
                          args.prompt_len, 2 * args.steps + 10)
        e = llm.engine
        e.overlap = not args.no_overlap
        wall, phases = time_phases(e, args.steps)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                e.step()
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / f"trace-{tag}.json"))
    kernels: dict[str, list[float]] = {}
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(ev.name, []).append(ev.device_time_total)
            spans.append((ev.time_range.start, ev.time_range.end, ev.name))
    gaps = gap_summary(spans, args.steps)
    n = args.steps
    total = sum(sum(v) for v in kernels.values()) / n / 1e3
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    lines = [f"# {tag}: step wall {wall * 1e3:.3f} ms (unprofiled), kernel time "
             f"{total:.3f} ms/step, {sum(len(v) for v in kernels.values()) / n:.0f} "
             "kernels/step", "", "| host phase | µs/step |", "|---|---|",
             *(f"| {k} | {v * 1e6:.0f} |" for k, v in sorted(phases.items())),
             "", "| ms/step | share | launches/step | µs each | kernel |",
             "|---|---|---|---|---|"]
    for name, times in rows[: args.top]:
        ms = sum(times) / n / 1e3
        lines.append(f"| {ms:.3f} | {ms / total:.1%} | {len(times) / n:.0f} | "
                     f"{sum(times) / len(times):.1f} | {name[:110]} |")
    lines += ["", f"Between consecutive kernels (gaps under {GAP_LIMIT_US} µs, i.e. inside a "
              f"step): {gaps['gap_ms']:.3f} ms/step idle over {gaps['gaps']:.0f} gaps "
              f"({gaps['mean_us']:.2f} µs mean); {gaps['overlaps']:.0f} kernels/step started "
              "before their predecessor ended (programmatic dependent launch at work).", "",
              "| µs/step idle | count/step | µs mean | after → before |", "|---|---|---|---|",
              *(f"| {t:.1f} | {c:.0f} | {t / c:.2f} | {a[:50]} → {b[:50]} |"
                for (a, b), (t, c) in gaps["top"]),
              "", f"Gaps of {GAP_LIMIT_US} µs or more (the device waiting between steps): "
              f"{gaps['long_ms']:.3f} ms/step.", "",
              "| µs/step idle | count/step | µs mean | after → before |", "|---|---|---|---|",
              *(f"| {t:.1f} | {c:.2f} | {t / c:.1f} | {a[:50]} → {b[:50]} |"
                for (a, b), (t, c) in gaps["long_top"]),
              "", "Host operators (self CPU time):", "",
              prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)]
    text = "\n".join(lines)
    print(text)
    (out / f"profile-{tag}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
