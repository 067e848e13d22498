"""The GEMMs of one SDAR-8B / Qwen3-8B step, alone: time and achieved rate of each shape at
the step's token counts, with each BLAS library torch can call (cuBLAS, cuBLASLt), next to
the copy bandwidth and matmul rate measured in the same run.

    python bench/kernels/gemm_shapes.py --tokens 1,4,512
    python bench/kernels/gemm_shapes.py --models llada-8b,dream-7b --tokens 32,64,96 --repeats 5

Prints a table and writes ``gemm-*.md`` / ``.json`` under ``--out``. With ``--repeats`` each
time is the median of that many rounds, the libraries taking turns within a round, and a
second table names the faster library of each shape and token count where it wins by at
least ``--margin``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import environment, measure_ceilings, require_cuda, rotating_us, write_report  # noqa: E402

# (name, K, N) of the 8B shape (hidden 4096, intermediate 12288, 32/8 heads of 128).
SHAPES = [("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 24576),
          ("down", 12288, 4096), ("lm_head", 4096, 151936)]
LAYERS = 36
# --models: each model's projections (LM heads left out: a step takes logits of few rows).
MODELS = {
    "sdar-8b": SHAPES[:4],
    "llada-8b": [("qkv", 4096, 12288), ("o_proj", 4096, 4096), ("gate_up", 4096, 24576),
                 ("down", 12288, 4096)],
    "dream-7b": [("qkv", 3584, 4608), ("o_proj", 3584, 3584), ("gate_up", 3584, 37888),
                 ("down", 18944, 3584)],
}


def time_ms(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,512")
    ap.add_argument("--libraries", default="cublas,cublaslt")
    ap.add_argument("--models", default=None,
                    help=f"comma-separated, of {', '.join(MODELS)}: their projections, "
                    "timed as graph replays (default: the 8B step's shapes, eagerly)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--margin", type=float, default=0.05,
                    help="the least gain that names a library the faster")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    if args.models or args.repeats > 1:
        return pick_main(args)
    ceilings = measure_ceilings()
    bw, rate = ceilings["hbm_bytes_per_s"], ceilings["bf16_flops_per_s"]
    rows = []
    for lib in args.libraries.split(","):
        torch.backends.cuda.preferred_blas_library(lib)
        for m in map(int, args.tokens.split(",")):
            for name, k, n in SHAPES:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                # Enough weight copies, taken in turn, that none is still in the 50 MB L2
                # when it is read again (as in a step, where 36 layers pass in between).
                ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                      for _ in range(-(-400 * 2**20 // (2 * n * k)))]
                turn = iter(range(10**9))
                ms = time_ms(lambda x=x, ws=ws, turn=turn: torch.nn.functional.linear(
                    x, ws[next(turn) % len(ws)]))
                del ws
                byts = 2 * (n * k + m * k + m * n)
                rows.append(dict(library=lib, tokens=m, gemm=name, k=k, n=n, ms=ms,
                                 tb_s=byts / ms / 1e9, tflop_s=2 * m * n * k / ms / 1e9,
                                 x_floor=ms / 1e3 / max(byts / bw, 2 * m * n * k / rate)))
    torch.backends.cuda.preferred_blas_library("default")
    lines = ["| library | tokens | gemm | K | N | µs | TB/s | TFLOP/s | × floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['library']} | {r['tokens']} | {r['gemm']} | {r['k']} | {r['n']} | "
              f"{r['ms'] * 1e3:.1f} | {r['tb_s']:.2f} | {r['tflop_s']:.0f} | "
              f"{r['x_floor']:.2f} |" for r in rows]
    # One step's GEMM time per library and token count (36 layers + the LM head).
    lines += ["", "| library | tokens | step GEMM ms |", "|---|---|---|"]
    for lib in args.libraries.split(","):
        for m in map(int, args.tokens.split(",")):
            sel = [r for r in rows if r["library"] == lib and r["tokens"] == m]
            total = sum(r["ms"] * (1 if r["gemm"] == "lm_head" else LAYERS) for r in sel)
            lines.append(f"| {lib} | {m} | {total:.3f} |")
    text = "\n".join(lines)
    print(json.dumps({**environment(), **ceilings}))
    print(text)
    write_report(args.out, "gemm", text, {"env": {**environment(), **ceilings}, "rows": rows})
    return 0


def pick_main(args) -> int:
    """Each model's projections at each token count under every library, as graph replays
    over weight copies taken in turn, median of ``--repeats`` rounds."""
    ceilings = measure_ceilings()
    bw, rate = ceilings["hbm_bytes_per_s"], ceilings["bf16_flops_per_s"]
    libs = args.libraries.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = {(name, k, n) for m in (args.models or "sdar-8b").split(",") for name, k, n
              in MODELS[m]}
    rows = []
    for name, k, n in sorted(shapes, key=lambda s: (s[1], s[2])):
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
              for _ in range(-(-400 * 2**20 // (2 * n * k)))]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times: dict[str, list[float]] = {lib: [] for lib in libs}
            for _ in range(args.repeats):
                for lib in libs:
                    torch.backends.cuda.preferred_blas_library(lib)
                    times[lib].append(rotating_us(lambda w, x=x: F.linear(x, w), ws, 24))
            torch.backends.cuda.preferred_blas_library("default")
            us = {lib: statistics.median(t) for lib, t in times.items()}
            floor = max(2 * n * k / bw, 2 * m * n * k / rate) * 1e6
            best = min(us, key=us.get)
            gain = 1 - us[best] / us[libs[0]]
            rows.append(dict(gemm=name, k=k, n=n, tokens=m, floor_us=floor, us=us,
                             spread={lib: (min(t), max(t)) for lib, t in times.items()},
                             pick=best if gain >= args.margin else libs[0], gain=gain))
            print(f"{name:8s} K={k:5d} N={n:5d} M={m:4d} floor {floor:6.1f} " + " ".join(
                f"{lib} {u:6.1f}" for lib, u in us.items()) + f" -> {rows[-1]['pick']}",
                flush=True)
        del ws
    lines = [f"# GEMM libraries at the steps' shapes ({args.models}), median of "
             f"{args.repeats}, graph replays over weight copies", "",
             "| gemm | K | N | tokens | floor µs | " + " | ".join(f"{lib} µs" for lib in libs)
             + f" | pick (≥ {args.margin:.0%} faster) |",
             "|---|---|---|---|---|" + "---|" * len(libs) + "---|"]
    lines += [f"| {r['gemm']} | {r['k']} | {r['n']} | {r['tokens']} | {r['floor_us']:.1f} | "
              + " | ".join(f"{r['us'][lib]:.1f}" for lib in libs)
              + f" | {r['pick']} ({r['gain']:+.1%}) |" for r in rows]
    picks: dict[tuple[int, int], list[int]] = {}
    for r in rows:
        if r["pick"] != libs[0]:
            picks.setdefault((r["n"], r["k"]), []).append(r["tokens"])
    lines += ["", f"Where {libs[-1]} is picked, as (N, K): rows:", "", "```",
              *(f"({n}, {k}): {ms}," for (n, k), ms in sorted(picks.items())), "```"]
    text = "\n".join(lines)
    print(text)
    write_report(args.out, "gemm-pick", text,
                 {"env": {**environment(), **ceilings}, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
