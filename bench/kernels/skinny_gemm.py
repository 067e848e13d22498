"""The Triton skinny GEMM (``dllm.runner.kernels.skinny_gemm``) against cuBLAS (``F.linear``)
on the SDAR-8B / Qwen3-8B weight shapes at 1-16 tokens, bf16, with the copy-bandwidth ceiling
measured in the same run.

    python bench/kernels/skinny_gemm.py --tokens 1,4,8,16 [--sweep] [--lm-head]

Each time is the median over replays of a CUDA graph holding many calls, the calls taking
turns among enough weight copies (>= 400 MB together, several times the 50-60 MB L2) that
every call reads its weight from HBM, as in a step where 36 layers pass in between. TB/s counts
the weight plus x and the output once. Every result is checked against a float64 reference
(``||y - ref|| / ||ref|| < 1e-2``) with the output poisoned with NaN before the call.

``--sweep`` times a handful of candidate configurations per shape and prints, per (N, K), the
configuration with the least total time over the token counts (configs are keyed on (N, K)
only, never on M, so a row's result does not depend on the batch) and whether it beats cuBLAS
at every token count, as this device's entry (its compute capability) of the ``CONFIGS`` table
in ``runner/kernels/skinny_gemm.py``.
Writes ``skinny-gemm-<timestamp>.md`` / ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dllm.runner.kernels import skinny_gemm as sg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import (  # noqa: E402
    copy_bandwidth,
    environment,
    refused,
    require_cuda,
    rotating_us,
    write_report,
)

# (name, N, K) of the 8B shapes (hidden 4096, intermediate 12288, 32/8 heads of 128).
SHAPES = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096),
          ("down", 4096, 12288)]
LM_HEAD = ("lm_head", 151936, 4096)
# Named with --shapes only: LLaDA-8B's q/k/v (32 KV heads) and LM head, and Dream-7B's (Qwen2-7B:
# hidden 3584, intermediate 18944, 28/4 heads of 128, vocabulary 152064).
MORE = [("llada-qkv", 12288, 4096), ("llada-lm_head", 126464, 4096),
        ("dream-qkv", 4608, 3584), ("dream-o_proj", 3584, 3584),
        ("dream-gate_up", 37888, 3584), ("dream-down", 3584, 18944),
        ("dream-lm_head", 152064, 3584)]
ROTATE_BYTES = 400 * 2**20
DEVICE = torch.device("cuda")  # the tables of the device the benchmark runs on
SMEM_LIMIT = 200 * 1024  # bytes of shared memory a candidate's pipeline may use (H200: 227 KB)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("nan")
    return ((y.double() - ref).norm() / ref.norm()).item()


def candidates(n: int, k: int, block_m: int = 16) -> list:
    """A few dozen configurations per shape: tile widths 16-128, K tiles 128-512, pipelines
    holding ~32, ~64 or ~96 KB of W per program, and the K splits that bring the grid to
    between ~1 and ~12 programs per SM (split-K costs a second, reduction kernel). ``block_m``:
    the padded rows of x each pipeline stage also holds; the 64- and 128-row tiles take
    ``wide_candidates``."""
    if block_m > 32:
        return wide_candidates(n, k, block_m)
    out = []
    for bn in (16, 32, 64, 128):
        for bk in (128, 256, 512):
            tile = bn * bk * 2
            for stages in sorted({max(2, min(10, kb * 1024 // tile)) for kb in (32, 64, 96)}):
                if stages * (bn + block_m) * bk * 2 > SMEM_LIMIT:
                    continue
                for split in (1, 2, 3, 4):
                    progs = -(-n // bn) * split
                    if k % (bk * split) or k // (bk * split) < 4 or not 120 <= progs <= 1600:
                        continue
                    out.append(sg.SkinnyConfig(bn, bk, split, 8 if bn == 128 else 4, stages))
    # The non-swapped operand order and 8 warps, for the table's config.
    base = sg.config_for(n, k, DEVICE, rows=block_m)
    out += [sg.SkinnyConfig(base.block_n, base.block_k, base.split_k, base.num_warps,
                            base.num_stages, swap_ab=False),
            sg.SkinnyConfig(base.block_n, base.block_k, base.split_k, 8, base.num_stages),
            base]
    return _unique(out)


def wide_candidates(n: int, k: int, block_m: int) -> list:
    """Configurations for the 64- and 128-row tiles, where the MMA does real work: both
    operand orders (swapped, the weight tile is the wgmma's M side and needs >= 64 rows;
    not swapped, x's rows are, with 32- or 64-column weight tiles), K tiles of
    64 or 128, 3-5 stages within the shared memory, 8 warps for the largest accumulators, and
    a K split of 2 where the unsplit grid is under a wave."""
    out = []
    for swap in (True, False):
        for bn in ((64, 128) if swap else (32, 64)):
            for bk in (64, 128):
                for stages in (3, 4, 5):
                    if stages * (bn + block_m) * bk * 2 > SMEM_LIMIT:
                        continue
                    warps = 8 if bn * block_m >= 16384 else 4
                    for split in (1, 2):
                        if split > 1 and (-(-n // bn) >= 132 or k % (bk * split)):
                            continue
                        out.append(sg.SkinnyConfig(bn, bk, split, warps, stages, swap))
    # the table's configuration (``config_for``: the tile's entry, if the shape has one)
    return _unique(out + [sg.config_for(n, k, DEVICE, rows=block_m)])


def _unique(configs: list) -> list:
    seen, uniq = set(), []
    for c in configs:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def _allow_rows(rows) -> None:
    """Raises the kernel's row limit to ``rows``' largest: a sweep may try a row tile the
    runtime does not take."""
    sg.MAX_M = max([sg.MAX_M, *rows])


def _compile(jobs: list) -> int:
    """Compiles the kernels of ``(n, k, m, config)`` cases in this process (one call each on
    small zero tensors): fills Triton's on-disk cache for the timed run. Returns the count."""
    _allow_rows(m for _, _, m, _ in jobs)  # as the parent's main()
    for n, k, m, cfg in jobs:
        w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
        try:
            sg.skinny_linear(x, w, config=cfg)
        except Exception:  # noqa: BLE001 (refused configs are reported by the timed run)
            pass
    torch.cuda.synchronize()
    return len(jobs)


def precompile(cases: list, workers: int) -> None:
    """Triton compiles a kernel in the calling thread, a second or more each: a sweep of a
    few hundred configurations spends minutes there. Compile them ahead in ``workers``
    processes sharing the cache directory."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t = time.time()
    parts = [cases[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        done = sum(pool.map(_compile, [p for p in parts if p]))
    print(f"precompiled {done} cases in {workers} processes: {time.time() - t:.0f} s",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", default="1,4,8,16")
    ap.add_argument("--sweep", action="store_true", help="time candidate configs per shape")
    ap.add_argument("--lm-head", action="store_true", help="also the N=151936 LM head")
    ap.add_argument("--shapes", default="",
                    help="comma list of shape names (default: the 8B shapes; also "
                         + ", ".join(n for n, _, _ in [LM_HEAD] + MORE) + ")")
    ap.add_argument("--max-configs", type=int, default=0, help="cap candidates per shape")
    ap.add_argument("--compile-jobs", type=int, default=0,
                    help="with --sweep: compile the candidates first in this many processes")
    ap.add_argument("--fused", action="store_true",
                    help="time the fused epilogues (residual step, SiLU) against the plain "
                         "kernel")
    ap.add_argument("--silu-configs", default="",
                    help="with --fused: '/'-separated 'block_n,block_k,warps,stages' (per "
                         "half) to time SiLU-and-mul in the gate/up epilogue with ('/', not ';': "
                         "gpu_session.sh splits MICRO on ';')")
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    _allow_rows(int(t) for t in args.tokens.split(","))
    if args.fused:
        return fused_main(args)
    torch.manual_seed(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = SHAPES + ([LM_HEAD] if args.lm_head else [])
    if args.shapes:
        shapes = [s for s in SHAPES + [LM_HEAD] + MORE if s[0] in args.shapes.split(",")]
    env = environment()
    bw = copy_bandwidth()
    print(f"{env}\ncopy ceiling: {bw / 1e12:.2f} TB/s", flush=True)
    dt = torch.bfloat16
    rows, sweep = [], []
    failures = 0
    t_start = time.time()
    tile = sg._block_m(max(tokens))  # the padded rows x takes in shared memory
    if args.sweep and args.compile_jobs > 1:
        precompile([(n, k, m, cfg) for _name, n, k in shapes for cfg in candidates(n, k, tile)
                    for m in tokens], args.compile_jobs)
    for name, n, k in shapes:
        copies = max(1, -(-ROTATE_BYTES // (2 * n * k)))
        ws = [torch.randn(n, k, device="cuda", dtype=dt) * k**-0.5 for _ in range(copies)]
        n_calls = max(20, copies * -(-20 // copies)) if n * k < 10**9 else 8
        xs = {m: torch.randn(m, k, device="cuda", dtype=dt) for m in tokens}
        refs = {m: xs[m].double() @ ws[0].double().T for m in tokens}
        byts = {m: 2 * (n * k + m * k + m * n) for m in tokens}

        def check(fn, m, xs=xs, ws=ws, refs=refs, n=n):
            y = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
            fn(xs[m], ws[0], y)
            return rel_err(y, refs[m])

        cublas = {}
        for m in tokens:
            us = rotating_us(lambda w, x=xs[m]: F.linear(x, w), ws, n_calls)
            err = check(lambda x, w, y: y.copy_(F.linear(x, w)), m)
            cublas[m] = us
            rows.append(dict(shape=name, n=n, k=k, m=m, impl="cublas", config="", us=us,
                             tb_s=byts[m] / us / 1e6, err=err))
        tables = {m: sg.config_for(n, k, DEVICE, rows=m) for m in tokens}
        configs = (candidates(n, k, tile) if args.sweep
                   else list(dict.fromkeys(tables.values())))
        if args.max_configs:
            configs = configs[-args.max_configs:]
        for cfg in configs:
            for m in tokens:
                try:
                    err = check(lambda x, w, y, cfg=cfg: sg.skinny_linear(
                        x, w, config=cfg, out=y), m)
                    us = rotating_us(lambda w, x=xs[m], cfg=cfg: sg.skinny_linear(
                        x, w, config=cfg), ws, n_calls)
                except Exception as e:  # noqa: BLE001 (out of resources, compile errors)
                    refused(f"  {name} {cfg.label()} M={m}", e)
                    break
                ok = err == err and err < 1e-2
                failures += not ok
                r = dict(shape=name, n=n, k=k, m=m, impl="skinny", config=cfg.label(),
                         cfg=cfg.__dict__, us=us, tb_s=byts[m] / us / 1e6, err=err,
                         vs_cublas=cublas[m] / us, ok=ok)
                sweep.append(r)
                if cfg == tables[m]:
                    rows.append(r)
            print(f"  {name} {cfg.label():>20}: " + " ".join(
                f"M{r['m']}={r['us']:.1f}us/{r['tb_s']:.2f}" for r in sweep
                if r["shape"] == name and r["config"] == cfg.label()), flush=True)
        del ws, xs, refs
        torch.cuda.empty_cache()

    lines = [f"# Skinny GEMM vs cuBLAS, bf16 ({env['gpu']}, torch {env['torch']}, "
             f"triton {env['triton']})", "",
             f"Copy ceiling (2 GiB device-to-device, read + write): {bw / 1e12:.2f} TB/s", "",
             "## Table config (`config_for(N, K, rows=M)`) vs cuBLAS", "",
             "| shape | N | K | M | cuBLAS µs | cuBLAS TB/s | skinny µs | skinny TB/s | "
             "speedup | config | rel err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, n, k in shapes:
        for m in tokens:
            c = next(r for r in rows if r["impl"] == "cublas" and r["shape"] == name
                     and r["m"] == m)
            s = next((r for r in rows if r["impl"] == "skinny" and r["shape"] == name
                      and r["m"] == m), None)
            if s is None:
                lines.append(f"| {name} | {n} | {k} | {m} | {c['us']:.1f} | "
                             f"{c['tb_s']:.2f} | failed | | | | |")
                continue
            lines.append(f"| {name} | {n} | {k} | {m} | {c['us']:.1f} | {c['tb_s']:.2f} | "
                         f"{s['us']:.1f} | {s['tb_s']:.2f} | {c['us'] / s['us']:.2f}x | "
                         f"{s['config']} | {s['err']:.1e} |")
    recommended = {}
    if args.sweep:
        lines += ["", "## Sweep: best config per (N, K, M)", "",
                  "| shape | M | best config | µs | TB/s | cuBLAS µs | speedup |",
                  "|---|---|---|---|---|---|---|"]
        for name, _n, _k in shapes:
            for m in tokens:
                cand = [r for r in sweep if r["shape"] == name and r["m"] == m and r["ok"]]
                if not cand:
                    continue
                b = min(cand, key=lambda r: r["us"])
                lines.append(f"| {name} | {m} | {b['config']} | {b['us']:.1f} | "
                             f"{b['tb_s']:.2f} | {cublas_us(rows, name, m):.1f} | "
                             f"{b['vs_cublas']:.2f}x |")
        lines += ["", "## Sweep: one config per (N, K) (least total time over M)", "",
                  "| shape | N | K | config | " + " | ".join(f"M={m} µs (TB/s, vs cuBLAS)"
                                                          for m in tokens)
                  + " | beats cuBLAS at every M |",
                  "|---|---|---|---|" + "---|" * len(tokens) + "---|"]
        for name, n, k in shapes:
            best = _best_config(sweep, name, len(tokens))
            if best is None:
                continue
            sel = {r["m"]: r for r in sweep if r["shape"] == name
                   and r["config"] == best.label()}
            recommended[f"{n},{k}"] = best.__dict__
            lines.append(f"| {name} | {n} | {k} | {best.label()} | " + " | ".join(
                f"{sel[m]['us']:.1f} ({sel[m]['tb_s']:.2f}, {sel[m]['vs_cublas']:.2f}x)"
                for m in tokens) + f" | {all(sel[m]['vs_cublas'] > 1 for m in tokens)} |")
        cap = tuple(torch.cuda.get_device_capability(DEVICE))
        # one configuration over token counts of both tiles fits neither table
        table = ("CONFIGS" if tile == 16 else f"ROWS{tile}"
                 if sg._block_m(min(tokens)) == tile
                 else f"one row tile (the tokens span {sg._block_m(min(tokens))} to {tile} "
                      "rows: sweep each alone)")
        lines += ["", f"This device's entry of `{table}` in `runner/kernels/skinny_gemm.py`:", "",
                  "```python", f"    {cap}: {{"]
        for name, n, k in shapes:
            c = recommended.get(f"{n},{k}")
            if c:
                lines.append(f"        ({n}, {k}): SkinnyConfig({c['block_n']}, {c['block_k']}, "
                             f"{c['split_k']}, {c['num_warps']}, {c['num_stages']}, "
                             f"{c['swap_ab']}),  # {name}")
        lines += ["    },", "```"]
    lines += ["", f"{failures} failed correctness checks; {time.time() - t_start:.0f} s."]
    text = "\n".join(lines)
    print(text)
    path = write_report(args.out, "skinny-gemm", text,
                        dict(env=env, copy_bytes_per_s=bw, tokens=tokens, rows=rows,
                             sweep=sweep, recommended=recommended, failures=failures))
    print(f"wrote {path}")
    return 1 if failures else 0


FUSED_VARIANTS = ["cuBLAS", "plain", "residual (producer)", "1/rms (consumer)", "silu",
                  "1/rms + silu", "plain, pdl", "1/rms + silu, pdl"]


def fused_main(args) -> int:
    """The skinny GEMM's fused epilogues against the plain kernel, per shape: the residual
    step's producer (o_proj, down: add the residual, scale by the next norm's weight, partial
    sums of squares), its consumer (qkv, gate/up: 1 / rms from the partials) and SiLU-and-mul
    (gate/up). The main loop is the plain one, so each should cost about nothing over it."""
    torch.manual_seed(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    env = environment()
    dt = torch.bfloat16
    rows, failures = [], 0
    shapes = SHAPES
    if args.shapes:
        shapes = [s for s in SHAPES + MORE if s[0] in args.shapes.split(",")]
    for name, n, k in shapes:
        copies = max(1, -(-ROTATE_BYTES // (2 * n * k)))
        ws = [torch.randn(n, k, device="cuda", dtype=dt) * k**-0.5 for _ in range(copies)]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            r = torch.randn(m, n, device="cuda", dtype=dt)
            nw = 1 + 0.1 * torch.randn(n, device="cuda", dtype=dt)
            # partial sums for a consumer whose input came from a producer of 128 programs
            ss = (x.float().pow(2).sum(-1) / 128).expand(128, m)
            sum_sq = torch.zeros(128, sg._block_m(m), device="cuda")
            sum_sq[:, :m] = ss
            rstd = torch.rsqrt(x.double().pow(2).sum(-1, keepdim=True) / k + 1e-6)
            plain = x.double() @ ws[0].double().T
            cases = {"cuBLAS": (lambda w, x=x: F.linear(x, w), plain),
                     "plain": (lambda w, x=x: sg.skinny_linear(x, w), plain),
                     "plain, pdl": (lambda w, x=x: sg.skinny_linear(x, w, pdl=True), plain)}
            role = name.rsplit("-", 1)[-1]  # "dream-gate_up": the gate_up of another model
            if role in ("o_proj", "down"):
                cases["residual (producer)"] = (
                    lambda w, x=x, r=r, nw=nw: sg.skinny_linear_residual(x, w, None, r, nw)[0],
                    plain + r.double())
            if role in ("qkv", "gate_up"):
                cases["1/rms (consumer)"] = (lambda w, x=x, ss=sum_sq: sg.skinny_linear(
                    x, w, sum_sq=ss, eps=1e-6), plain * rstd)
            if role == "gate_up":
                gate, up = plain.chunk(2, dim=-1)
                gate_n, up_n = (plain * rstd).chunk(2, dim=-1)
                cases["silu"] = (lambda w, x=x: sg.skinny_linear(x, w, silu=True),
                                 F.silu(gate) * up)
                for label, pdl in (("1/rms + silu", False), ("1/rms + silu, pdl", True)):
                    cases[label] = (lambda w, x=x, ss=sum_sq, pdl=pdl: sg.skinny_linear(
                        x, w, sum_sq=ss, eps=1e-6, silu=True, pdl=pdl), F.silu(gate_n) * up_n)
                for spec in filter(None, args.silu_configs.split("/")):
                    bn, bk, warps, stages = (int(v) for v in spec.split(","))
                    cfg = sg.SkinnyConfig(bn, bk, 1, warps, stages)
                    label = f"silu {cfg.label()}"
                    if label not in FUSED_VARIANTS:
                        FUSED_VARIANTS.append(label)
                    cases[label] = (lambda w, x=x, cfg=cfg: sg.skinny_linear(
                        x, w, silu=True, config=cfg), F.silu(gate) * up)
            for label, (call, ref) in cases.items():
                try:
                    err = rel_err(call(ws[0]), ref)
                except Exception as e:  # noqa: BLE001 (out of resources)
                    refused(f"  {name} M={m} {label}", e)
                    continue
                failures += not err < 1e-2
                us = rotating_us(call, ws, max(20, copies * -(-20 // copies)))
                rows.append(dict(shape=name, n=n, k=k, m=m, variant=label, us=us,
                                 tb_s=2 * n * k / us / 1e6, err=err))
                print(f"  {name} M={m} {label:>20}: {us:.1f} µs, {2 * n * k / us / 1e6:.2f} "
                      f"TB/s, err {err:.1e}", flush=True)
        del ws
        torch.cuda.empty_cache()
    lines = [f"# Skinny GEMM, fused epilogues vs plain ({env['gpu']}, torch {env['torch']}, "
             f"triton {env['triton']})", "",
             "Median µs per call over CUDA-graph replays, weights rotated through > L2.", "",
             "| shape | M | " + " | ".join(FUSED_VARIANTS) + " |",
             "|---|---|" + "---|" * len(FUSED_VARIANTS)]
    for name, _n, _k in shapes:
        for m in tokens:
            cell = {r["variant"]: f"{r['us']:.1f}" for r in rows
                    if r["shape"] == name and r["m"] == m}
            lines.append(f"| {name} | {m} | " + " | ".join(cell.get(v, "—")
                                                           for v in FUSED_VARIANTS) + " |")
    lines += ["", f"{failures} failed correctness checks."]
    text = "\n".join(lines)
    print(text)
    print(f"wrote {write_report(args.out, 'skinny-fused', text, dict(env=env, rows=rows))}")
    return 1 if failures else 0


def cublas_us(rows: list[dict], name: str, m: int) -> float:
    return next(r["us"] for r in rows if r["impl"] == "cublas" and r["shape"] == name
                and r["m"] == m)


def _best_config(sweep: list[dict], name: str, n_tokens: int | None = None):
    """The config with the least total time over the token counts (complete, correct runs)."""
    totals: dict[str, list] = {}
    for r in sweep:
        if r["shape"] == name:
            totals.setdefault(r["config"], []).append(r)
    full = {c: rs for c, rs in totals.items() if all(r["ok"] for r in rs)
            and (n_tokens is None or len(rs) == n_tokens)}
    if not full:
        return None
    best = min(full.values(), key=lambda rs: sum(r["us"] for r in rs))
    return sg.SkinnyConfig(**best[0]["cfg"])


if __name__ == "__main__":
    sys.exit(main())
