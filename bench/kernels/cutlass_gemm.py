"""CUTLASS 3 (sm90a: TMA loads, warp-specialised WGMMA pipelines, persistent and stream-K
schedules) against cuBLAS at the full-attention windows' token counts (32-256 rows), where
the prefix cache's forwards sit between the weight read and the matmul floor.

The library is built by ``bench/kernels/cutlass/build.sh`` (CUTLASS's headers from
FlashInfer's wheel, the CUDA runtime static, loaded through ctypes so it needs no torch
headers); the operands are swapped (the weights are CUTLASS's A, the tokens its N), so a
tile of N = the window covers every token once and each weight tile is read once.

    bash bench/kernels/cutlass/build.sh .whl/flashinfer_python-0.5.3-py3-none-any.whl lib.so
    python bench/kernels/cutlass_gemm.py --lib lib.so --tokens 64,128,160,192

Prints, per shape and token count, cuBLAS, the best CUTLASS configuration and the floor
(max of the weight read at the copy rate and the matmul at the sustained rate); writes
``cutlass-gemm-*.md`` / ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import environment, measure_ceilings, refused, require_cuda, rotating_us, write_report  # noqa: E402

# (name, N, K): LLaDA-8B (hidden 4096, intermediate 12288, 32 KV heads of 128) and Dream-7B
# (hidden 3584, intermediate 18944, 28 / 4 heads of 128).
SHAPES = [("qkv", 12288, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096),
          ("down", 4096, 12288), ("dream-qkv", 4608, 3584), ("dream-o_proj", 3584, 3584),
          ("dream-gate_up", 37888, 3584), ("dream-down", 3584, 18944)]
ROTATE_BYTES = 400 * 2**20  # weight copies taken in turn: each call reads HBM, not L2
CALLS = 24


class Cutlass:
    """The probe library's entry points: ``g_{tm}_{tn}_{sched}_{ws,run}``."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)

    def configs(self) -> list[tuple[int, int, str]]:
        out = []
        for tm in (64, 128):
            for tn in range(8, 264, 8):
                for s in "ps":
                    if hasattr(self.lib, f"g_{tm}_{tn}_{s}_run"):
                        out.append((tm, tn, s))
        return out

    def call(self, cfg, w, x, y, ws, residual=None) -> int:
        tm, tn, s = cfg
        fn = getattr(self.lib, f"g_{tm}_{tn}_{s}_run")  # returns int: ctypes' default
        t, k = x.shape
        n = w.shape[0]
        return fn(ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(x.data_ptr()),
                  ctypes.c_void_p(residual.data_ptr() if residual is not None else 0),
                  ctypes.c_void_p(y.data_ptr()), t, n, k,
                  ctypes.c_float(1.0 if residual is not None else 0.0),
                  ctypes.c_void_p(ws.data_ptr() if ws is not None else 0),
                  ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))

    def workspace(self, cfg, t: int, n: int, k: int) -> torch.Tensor | None:
        tm, tn, s = cfg
        fn = getattr(self.lib, f"g_{tm}_{tn}_{s}_ws")
        fn.restype = ctypes.c_size_t
        size = fn(t, n, k)
        return torch.zeros(size, dtype=torch.uint8, device="cuda") if size else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True, help="the library build.sh made")
    ap.add_argument("--tokens", default="32,64,96,128,160,192,224,256")
    ap.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--residual", action="store_true",
                    help="also time o_proj and down with the residual added in the epilogue")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    lib = Cutlass(args.lib)
    cfgs = lib.configs()
    env = environment()
    ceil = measure_ceilings()
    bw, rate = ceil["hbm_bytes_per_s"], ceil["bf16_flops_per_s"]
    print(f"{env}\n{len(cfgs)} configurations; copy {bw / 1e12:.2f} TB/s, "
          f"matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    rows = []
    for name, n, k in shapes:
        copies = max(1, -(-ROTATE_BYTES // (2 * n * k)))
        wts = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
               for _ in range(copies)]
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            floor_us = max(2 * n * k / bw, 2 * t * n * k / rate) * 1e6
            ref = F.linear(x.float(), wts[0].float())
            res = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
            base = {}
            for blas in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(blas)
                base[blas] = rotating_us(lambda w, x=x: F.linear(x, w), wts, CALLS)
            torch.backends.cuda.preferred_blas_library("default")
            row = dict(shape=name, n=n, k=k, tokens=t, floor_us=floor_us, **base, cutlass={})
            for cfg in cfgs:
                if not t / 2 <= cfg[1] < t + 64:
                    continue  # one or two columns of tiles, under 64 columns of padding
                label = f"{cfg[0]}x{cfg[1]}{cfg[2]}"
                y = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
                ws = lib.workspace(cfg, t, n, k)
                try:
                    rc = lib.call(cfg, wts[0], x, y, ws)
                    torch.cuda.synchronize()
                    if rc:
                        print(f"{name} t={t} {label}: cannot implement ({rc})", flush=True)
                        continue
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    us = rotating_us(lambda w, x=x, y=y, ws=ws, cfg=cfg: lib.call(cfg, w, x, y, ws),
                                     wts, CALLS)
                    entry = dict(us=us, rel_err=err)
                    if args.residual and name.endswith(("o_proj", "down")):
                        lib.call(cfg, wts[0], x, y, ws, residual=res)
                        torch.cuda.synchronize()
                        entry["residual_err"] = ((y.float() - ref - res.float()).norm()
                                                 / ref.norm()).item()
                        entry["residual_us"] = rotating_us(
                            lambda w, x=x, y=y, ws=ws, cfg=cfg, res=res: lib.call(cfg, w, x, y, ws, res),
                            wts, CALLS)
                    row["cutlass"][label] = entry
                except Exception as e:  # a refused launch: report it and go on
                    refused(f"{name} t={t} {label}", e)
            ok = {c: e for c, e in row["cutlass"].items() if e["rel_err"] < 1e-2}
            best = min(ok, key=lambda c: ok[c]["us"]) if ok else None
            row["best"] = best
            rows.append(row)
            print(f"{name:14s} t={t:3d} floor {floor_us:7.1f} cublas {base['cublas']:7.1f} "
                  f"lt {base['cublaslt']:7.1f} best {best} "
                  f"{ok[best]['us'] if best else float('nan'):7.1f} "
                  + " ".join(f"{c}:{e['us']:.1f}" for c, e in row["cutlass"].items()),
                  flush=True)
        del wts
    lines = [f"# CUTLASS sm90 against cuBLAS at the windows' token counts ({env['gpu']})", "",
             f"copy {bw / 1e12:.2f} TB/s, sustained matmul {rate / 1e12:.0f} TFLOP/s; "
             "µs a call, weights read from HBM (copies taken in turn), graph replay", "",
             "| shape | tokens | floor µs | cuBLAS | cuBLASLt | best CUTLASS | config | "
             "CUTLASS / best cuBLAS | rel err |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        blas = min(r["cublas"], r["cublaslt"])
        b = r["cutlass"].get(r["best"]) if r["best"] else None
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['floor_us']:.1f} | {r['cublas']:.1f} | "
            f"{r['cublaslt']:.1f} | {b['us'] if b else float('nan'):.1f} | {r['best']} | "
            f"{(b['us'] / blas) if b else float('nan'):.3f} | "
            f"{b['rel_err'] if b else float('nan'):.1e} |")
    md = "\n".join(lines)
    print(md)
    path = write_report(args.out, "cutlass-gemm", md, dict(env=env, ceilings=ceil, rows=rows,
                                                            args=vars(args)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
