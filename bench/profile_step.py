"""Where one engine step's time goes, on a GPU: the kernels of a denoise (or decode) step and
the host work around them, from ``torch.profiler``, for a random-weight model of real shape.

    python bench/profile_step.py --model sdar-8b --batch-size 1 --runner cuda_graph

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline import SHAPES, checkpoint_dir, warm_engine  # noqa: E402


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
    if not torch.cuda.is_available():
        print("bench/profile_step.py needs a CUDA GPU", file=sys.stderr)
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
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(ev.name, []).append(ev.device_time_total)
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
    lines += ["", "Host operators (self CPU time):", "",
              prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)]
    text = "\n".join(lines)
    print(text)
    (out / f"profile-{tag}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
