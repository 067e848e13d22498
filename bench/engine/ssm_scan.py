"""The Mamba2 scan of one long prefill row: the reference chunked scan in torch
(``dllm.models.mamba2.ssd_scan``, float32) against fla-core's ``chunk_simple_gla``
(``dllm.runner.kernels.ssm_scan``), at the mixer shape of Granite 4.0-H micro and tiny (64 heads of
64 channels, a 128-wide state, one group), by prompt length. Prints a table and writes
``bench/results/ssm-scan-<stamp>.{md,json}``.

    python bench/engine/ssm_scan.py [--tokens 512,2048,8192,32768] [--out bench/results]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import environment, require_cuda, write_report  # noqa: E402


def time_ms(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="512,2048,8192,32768")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--d-state", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=256, help="the reference's chunk")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    if not require_cuda(__file__):
        return 2
    from dllm.models.mamba2 import ssd_scan
    from dllm.runner.kernels.ssm_scan import fla_available, fla_ssd_scan

    if not fla_available():
        print("fla-core is not installed (pip install fla-core)", file=sys.stderr)
        return 2
    g = torch.Generator("cuda").manual_seed(0)
    h, pd, n = args.heads, args.head_dim, args.d_state
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        x = torch.randn(1, t, h, pd, device="cuda", generator=g)
        b = torch.randn(1, t, 1, n, device="cuda", generator=g)
        c = torch.randn(1, t, 1, n, device="cuda", generator=g)
        dt = F.softplus(torch.randn(1, t, h, device="cuda", generator=g) - 2)
        a = -torch.exp(torch.randn(h, device="cuda", generator=g).clamp(-2, 1))
        d = torch.randn(h, device="cuda", generator=g)
        h0 = torch.randn(1, h, pd, n, device="cuda", generator=g)
        y_ref, _ = ssd_scan(x, dt, a, b, c, d, h0, args.chunk_size)
        y, _ = fla_ssd_scan(x, dt, a, b, c, d, h0)
        rel = ((y - y_ref).double().norm() / y_ref.double().norm()).item()
        ref_ms = time_ms(lambda: ssd_scan(x, dt, a, b, c, d, h0, args.chunk_size))  # noqa: B023
        fla_ms = time_ms(lambda: fla_ssd_scan(x, dt, a, b, c, d, h0))  # noqa: B023
        rows.append({"tokens": t, "reference_ms": round(ref_ms, 3), "fla_ms": round(fla_ms, 3),
                     "speedup": round(ref_ms / fla_ms, 2), "rel_diff": rel})
        print(rows[-1], flush=True)
    md = [f"# Mamba2 scan of one row: reference (torch, chunk {args.chunk_size}) vs fla-core",
          "", f"{h} heads × {pd}, state {n}, one group, float32 inputs", "",
          "| tokens | reference ms | fla ms | speedup | relative difference |", "|---|---|---|---|---|"]
    md += [f"| {r['tokens']} | {r['reference_ms']} | {r['fla_ms']} | {r['speedup']}× | "
           f"{r['rel_diff']:.1e} |" for r in rows]
    text = "\n".join(md)
    print(text)
    print("wrote", write_report(args.out, "ssm-scan", text,
                                {"args": vars(args), "rows": rows, "environment": environment()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
