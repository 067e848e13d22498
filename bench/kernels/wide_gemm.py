"""Can a Triton GEMM match cuBLAS at the batch-128 step's 512 tokens on the 8B shapes? The
question behind folding SiLU-and-mul and the add + RMSNorm into GEMM epilogues at batch 128
(bench/NOTES.md, "Left"): those kernels and their gaps cost ~1 ms a step, so an own GEMM pays
only if it comes within ~3% of cuBLAS (767 TFLOP/s on gate/up in isolation).

    python bench/kernels/wide_gemm.py [--tokens 512] [--shapes qkv,o_proj,gate_up,down]

A plain ``y = x @ W.T`` (x ``[M, K]``, W ``[N, K]``, both K-major, bf16, float32 accumulation)
in four forms: tiles loaded through pointers (Triton pipelines them, ``num_stages``) and
through tensor descriptors (TMA), over a grid of ``BLOCK_M × BLOCK_N`` tiles in groups of
``GROUP_M`` row tiles (L2 reuse of W); and persistent (one TMA program an SM walking the
tiles), with and without Triton's warp specialisation. A handful of tile configurations per
form; each result
is checked against ``F.linear`` (relative error < 1e-2) and timed as the median of CUDA-graph
replays of 20 calls taking turns among 4 weight copies, next to cuBLAS timed the same way.
Writes ``wide-gemm-<stamp>.md`` / ``.json`` under ``--out``.

    python bench/kernels/wide_gemm.py --chain 128,256,512,1024,4096

times instead what the runtime runs from o_proj to the next layer's norm, with cuBLAS and
FlashInfer's kernels against ``dllm.runner.kernels.wide_gemm`` (``wide-chain-<stamp>``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dllm.runner.kernels.hardware import num_sms
from dllm.runner.kernels.wide_gemm import _tile  # the runtime's tile order

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import environment, refused, require_cuda, rotating_us, write_report  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096)}
CALLS, COPIES = 20, 4


@triton.jit
def _gemm_ptr_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, K_TILES: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (rm % M)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + (rn % N)[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(K_TILES):  # K = K_TILES * BLOCK_K
        acc = tl.dot(tl.load(x_ptrs), tl.trans(tl.load(w_ptrs)), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _descriptors(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Device-side TMA descriptors of x ``[M, K]``, W ``[N, K]`` and y ``[M, N]``."""
    return (tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                      block_shape=[BLOCK_M, BLOCK_K]),
            tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1],
                                      block_shape=[BLOCK_N, BLOCK_K]),
            tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1],
                                      block_shape=[BLOCK_M, BLOCK_N]))


@triton.jit
def _gemm_tma_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     K_TILES: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    x_desc, w_desc, y_desc = _descriptors(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M, BLOCK_N,
                                          BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(K_TILES):  # K = K_TILES * BLOCK_K
        a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
        b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_ptr.dtype.element_ty))


@triton.jit
def _gemm_persistent_kernel(x_ptr, w_ptr, y_ptr, M, N, K, NUM_PROGRAMS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            K_TILES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """One program an SM walking the tiles (TMA loads; with ``WARP_SPECIALIZE`` Triton
    splits the loads and the MMAs into producer and consumer warps)."""
    x_desc, w_desc, y_desc = _descriptors(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M, BLOCK_N,
                                          BLOCK_K)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(K_TILES):
            a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_ptr.dtype.element_ty))


FORMS = ("pointers", "tma", "persistent", "persistent-ws")


@triton.jit
def _two_dot_kernel(x_desc, w_desc, y_desc, M, N, tiles, NUM_PROGRAMS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, K_TILES: tl.constexpr, SILU: tl.constexpr):
    """gate/up as two 128-column dots a K step (host descriptors), TMA store of
    ``silu(gate) * up`` (SILU) or of ``gate + up``: which part of the runtime kernel costs."""
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(K_TILES):
            a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
            acc = tl.dot(a, w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K]).T, acc)
            acc_up = tl.dot(a, w_desc.load([N + pid_n * BLOCK_N, kt * BLOCK_K]).T, acc_up)
        if SILU:
            y = acc / (1.0 + tl.exp(-acc)) * acc_up
        else:
            y = acc + acc_up
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], y.to(y_desc.dtype))


def _alloc(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-side tensor descriptors (``triton.set_allocator``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def gemm(x: torch.Tensor, w: torch.Tensor, cfg: dict, form: str,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` in ``form`` (one of ``FORMS``) with the tile configuration ``cfg`` (K a
    multiple of BLOCK_K; but for ``pointers`` also x, w and the output contiguous)."""
    m, k = x.shape
    n = w.shape[0]
    assert k % cfg["BLOCK_K"] == 0 and w.shape[1] == k
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    meta = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                GROUP_M=cfg["GROUP_M"], K_TILES=k // cfg["BLOCK_K"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])
    if form == "tma":
        _gemm_tma_kernel[grid](x, w, y, m, n, k, **meta)
    elif form.startswith("persistent"):
        programs = min(grid[0], num_sms(x.device))
        _gemm_persistent_kernel[(programs,)](x, w, y, m, n, k, NUM_PROGRAMS=programs,
                                             WARP_SPECIALIZE=form.endswith("ws"), **meta)
    else:
        _gemm_ptr_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), **meta)
    return y


def configs() -> list[dict]:
    out = []
    for bm, bn, bk, stages, warps, group in itertools.product(
            (128,), (128, 256), (64, 128), (3, 4, 5), (4, 8), (8,)):
        smem = stages * (bm + bn) * bk * 2
        if smem > 220 * 1024 or (bn == 256 and warps == 4) or (bk == 128 and warps == 4):
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_stages=stages,
                        num_warps=warps, GROUP_M=group))
    return out


def variants(out: str, m: int) -> int:
    """Where the runtime's wide kernels lose time against the plain tiles, at ``m`` rows:
    gate/up (plain persistent 128 x 256; two dots with a TMA store, with and without SiLU;
    the runtime kernel at 3 and 4 stages, without and with the norm's row scale) and the
    o_proj / down residual kernel (the plain pointer tile; the runtime kernel at 4 and 8
    warps, 4 and 5 stages)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from dllm.runner.kernels import wide_gemm as wg

    env = environment()
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def record(shape, name, fn, ws):
        us = rotating_us(fn, ws, CALLS)
        rows.append(dict(shape=shape, form=name, us=us))
        print(f"{shape:>8} {name:>34}: {us:7.1f} µs", flush=True)

    n2, k = SHAPES["gate_up"]
    ws = [torch.randn(n2, k, device="cuda", dtype=dt, generator=g) * k**-0.5
          for _ in range(COPIES)]
    x = torch.randn(m, k, device="cuda", dtype=dt, generator=g)
    ss = torch.rand(k // wg.BLOCK_N, m, device="cuda", generator=g) * k
    plain = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=3, num_warps=8, GROUP_M=8)
    record("gate_up", "plain persistent 128x256 s3", lambda w: gemm(x, w, plain, "persistent"),
           ws)
    n = n2 // 2
    tiles = triton.cdiv(m, 128) * (n // 128)
    programs = min(tiles, env["sms"])

    def two_dot(w, silu, stages=3):
        y = torch.empty((m, n), device="cuda", dtype=dt)
        _two_dot_kernel[(programs,)](
            TensorDescriptor.from_tensor(x, [128, 64]), TensorDescriptor.from_tensor(w, [128, 64]),
            TensorDescriptor.from_tensor(y, [128, 128]), m, n, tiles, NUM_PROGRAMS=programs,
            BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, K_TILES=k // 64, SILU=silu,
            num_warps=8, num_stages=stages)
        return y

    for silu in (False, True):
        for stages in (3, 4):
            record("gate_up", f"two dots, TMA store, silu {silu} s{stages}",
                   lambda w, silu=silu, stages=stages: two_dot(w, silu, stages), ws)
    default_stages = wg.SILU_STAGES
    for stages in (3, 4):
        wg.SILU_STAGES = stages
        record("gate_up", f"runtime s{stages}", lambda w: wg.gate_up_silu(x, w), ws)
        record("gate_up", f"runtime s{stages} + row scale",
               lambda w: wg.gate_up_silu(x, w, ss, 1e-6), ws)
    wg.SILU_STAGES = default_stages
    del ws
    for shape in ("o_proj", "down"):
        n, k = SHAPES[shape]
        ws = [torch.randn(n, k, device="cuda", dtype=dt, generator=g) * k**-0.5
              for _ in range(COPIES)]
        x = torch.randn(m, k, device="cuda", dtype=dt, generator=g)
        r = torch.randn(m, n, device="cuda", dtype=dt, generator=g)
        nw = torch.ones(n, device="cuda", dtype=dt)
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=5, num_warps=4, GROUP_M=8)
        default_residual = wg.RESIDUAL_WARPS, wg.RESIDUAL_STAGES
        record(shape, "plain pointers 128x128 s5 w4",
               lambda w, x=x, cfg=cfg: gemm(x, w, cfg, "pointers"), ws)
        for warps, stages in ((4, 5), (8, 5), (4, 4), (8, 4)):
            wg.RESIDUAL_WARPS, wg.RESIDUAL_STAGES = warps, stages
            record(shape, f"runtime residual s{stages} w{warps}",
                   lambda w, x=x, r=r, nw=nw: wg.linear_residual(x, w, r, nw), ws)
        wg.RESIDUAL_WARPS, wg.RESIDUAL_STAGES = default_residual
        del ws
    lines = [f"# Wide kernel variants at {m} tokens ({env['gpu']}, triton {env['triton']})", "",
             "| shape | form | µs |", "|---|---|---|"]
    lines += [f"| {r['shape']} | {r['form']} | {r['us']:.1f} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    print(f"wrote {write_report(out, 'wide-variants', text, dict(env=env, rows=rows))}")
    return 0


def chain(out: str, tokens: list[int], h: int = 4096, i: int = 12288) -> int:
    """The MLP half of a layer and the attention output before it, as the runtime runs them
    at each token count: cuBLAS with FlashInfer's add + RMSNorm and SiLU kernels, against
    ``dllm.runner.kernels.wide_gemm`` (o_proj and down with the residual step in the epilogue,
    gate/up with the norm's row scale and SiLU-and-mul; q/k/v's norm then a plain RMSNorm of
    the stream), and that without the down kernel. Layers rotate through 4 weight copies.
    ``h``/``i``: the hidden and intermediate sizes (the 8B shapes; Dream-7B: 3584, 18944)."""
    import flashinfer

    from dllm.runner.kernels import wide_gemm as wg

    env = environment()
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=dt, generator=g) * scale

    layers = [(rand(h, h, scale=h**-0.5), rand(2 * i, h, scale=h**-0.5),
               rand(h, i, scale=i**-0.5), rand(h, scale=0.1) + 1, rand(h, scale=0.1) + 1)
              for _ in range(COPIES)]
    eps = 1e-6

    def ref(a, r, w):  # a: attention output; r: the stream before attention
        wo, wgu, wd, n1, n2 = w
        y = F.linear(a, wo)
        flashinfer.norm.fused_add_rmsnorm(y, r, n1, eps)  # r = s, y = rms_norm(s) * n1
        act = flashinfer.activation.silu_and_mul(F.linear(y, wgu))
        d = F.linear(act, wd)
        flashinfer.norm.fused_add_rmsnorm(d, r, n2, eps)
        return d

    def wide(a, r, w, down=True):
        wo, wgu, wd, n1, n2 = w
        s, scaled, ss = wg.linear_residual(a, wo, r, n1)
        act = wg.gate_up_silu(scaled, wgu, ss, eps)
        if down:
            s2, _, _ = wg.linear_residual(act, wd, s, n2)
            return flashinfer.norm.rmsnorm(s2, n2, eps)
        d = F.linear(act, wd)
        flashinfer.norm.fused_add_rmsnorm(d, s, n2, eps)
        return d

    forms = {"cuBLAS + FlashInfer": ref, "wide": wide,
             "wide, cuBLAS down": lambda a, r, w: wide(a, r, w, down=False)}
    rows = []
    for m in tokens:
        a, r0 = rand(m, h), rand(m, h)
        base = None
        for name, fn in forms.items():
            r = r0.clone()
            us = rotating_us(lambda w, fn=fn, a=a, r=r: fn(a, r, w), layers, CALLS)
            r.copy_(r0)
            got = fn(a, r, layers[0]).float()
            r.copy_(r0)
            want = ref(a, r, layers[0]).float()
            err = ((got - want).norm() / want.norm()).item()
            base = base or us
            rows.append(dict(tokens=m, form=name, us=us, vs_ref=us / base, err=err))
            print(f"{m:5d} {name:>22}: {us:7.1f} µs a layer, {us / base:.3f}×, err {err:.1e}",
                  flush=True)
    lines = [f"# o_proj + MLP chain a layer, hidden {h}, intermediate {i} ({env['gpu']}, "
             f"torch {env['torch']}, triton {env['triton']}, flashinfer {env['flashinfer']})",
             "",
             f"Median of CUDA-graph replays of {CALLS} layers over {COPIES} weight copies; "
             "err: relative to the cuBLAS chain's output.", "",
             "| tokens | form | µs a layer | × cuBLAS chain | err |", "|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['form']} | {r['us']:.1f} | {r['vs_ref']:.3f} | "
              f"{r['err']:.1e} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    path = write_report(out, "wide-chain", text, dict(env=env, dims=[h, i], rows=rows))
    print(f"wrote {path}")
    return 1 if any(not r["err"] < 2e-2 for r in rows) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--chain", default="",
                    help="comma-separated token counts: time the runtime's o_proj + MLP chain "
                    "(cuBLAS + FlashInfer against dllm.runner.kernels.wide_gemm) instead")
    ap.add_argument("--dims", default="4096,12288",
                    help="the chain's hidden,intermediate sizes (Dream-7B: 3584,18944)")
    ap.add_argument("--variants", action="store_true",
                    help="time variants of the runtime's wide kernels at --tokens instead")
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    triton.set_allocator(_alloc)
    if args.variants:
        return variants(args.out, args.tokens)
    if args.chain:
        h, i = (int(v) for v in args.dims.split(","))
        return chain(args.out, [int(t) for t in args.chain.split(",")], h, i)
    env = environment()
    dt = torch.bfloat16
    m = args.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, failures = [], 0
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = [torch.randn(n, k, device="cuda", dtype=dt, generator=g) * k**-0.5
              for _ in range(COPIES)]
        x = torch.randn(m, k, device="cuda", dtype=dt, generator=g)
        ref = F.linear(x, ws[0]).float()
        flop = 2 * m * n * k
        cublas = rotating_us(lambda w, x=x: F.linear(x, w), ws, CALLS)
        rows.append(dict(shape=name, form="cuBLAS", config="", us=cublas,
                         tflops=flop / cublas / 1e6, vs_cublas=1.0))
        print(f"{name}: cuBLAS {cublas:.1f} µs, {flop / cublas / 1e6:.0f} TFLOP/s", flush=True)
        for form, cfg in itertools.product(FORMS, configs()):
            if form.startswith("persistent") and cfg["num_warps"] == 4:
                continue  # one warp group per MMA tile is what the persistent forms are for
            label = (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} "
                     f"s{cfg['num_stages']} w{cfg['num_warps']}")
            try:
                err = ((gemm(x, ws[0], cfg, form).float() - ref).norm() / ref.norm()).item()
                us = rotating_us(lambda w, x=x, cfg=cfg, form=form: gemm(x, w, cfg, form), ws,
                                 CALLS)
            except Exception as e:  # noqa: BLE001 (out of resources, say)
                refused(f"  {form} {label}", e)
                continue
            failures += not err < 1e-2
            rows.append(dict(shape=name, form=form, config=label, us=us,
                             tflops=flop / us / 1e6, vs_cublas=us / cublas, err=err))
            print(f"  {form:>8} {label:>22}: {us:7.1f} µs, {flop / us / 1e6:4.0f} TFLOP/s, "
                  f"{us / cublas:.3f}× cuBLAS, err {err:.1e}", flush=True)
        del ws
        torch.cuda.empty_cache()
    lines = [f"# Triton GEMM vs cuBLAS at {m} tokens ({env['gpu']}, torch {env['torch']}, "
             f"triton {env['triton']})", "",
             f"Median of CUDA-graph replays of {CALLS} calls over {COPIES} weight copies.", "",
             "| shape | form | config | µs | TFLOP/s | × cuBLAS |", "|---|---|---|---|---|---|"]
    for name in args.shapes.split(","):
        mine = sorted((r for r in rows if r["shape"] == name), key=lambda r: r["us"])
        best = [r for r in mine if r["form"] == "cuBLAS"] + [
            r for r in mine if r["form"] != "cuBLAS"][:3]
        lines += [f"| {r['shape']} | {r['form']} | {r['config']} | {r['us']:.1f} | "
                  f"{r['tflops']:.0f} | {r['vs_cublas']:.3f} |" for r in best]
    lines += ["", f"{failures} failed correctness checks (every config run; the table shows the "
              "best three Triton configs a shape)."]
    text = "\n".join(lines)
    print(text)
    print(f"wrote {write_report(args.out, 'wide-gemm', text, dict(env=env, rows=rows))}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
