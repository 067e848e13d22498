"""The GEMMs of one SDAR-8B / Qwen3-8B step, alone: time and achieved rate of each shape at
the step's token counts, with each BLAS library torch can call (cuBLAS, cuBLASLt), next to
the copy bandwidth and matmul rate measured in the same run.

    python bench/kernels/gemm_shapes.py --tokens 1,4,512

Prints a table and writes ``gemm-*.md`` / ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import environment, measure_ceilings, require_cuda, write_report  # noqa: E402

# (name, K, N) of the 8B shape (hidden 4096, intermediate 12288, 32/8 heads of 128).
SHAPES = [("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 24576),
          ("down", 12288, 4096), ("lm_head", 4096, 151936)]
LAYERS = 36


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
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
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


if __name__ == "__main__":
    sys.exit(main())
