"""SwiGLU's gate/up GEMM and SiLU-and-mul at many tokens (the batch-128 denoise step of the 8B
shapes: 512 tokens), in the forms cuBLAS can be asked for, between the neighbours the model
gives them (the add + RMSNorm before, the down projection after), 36 layers of distinct
weights in one CUDA graph.

    python bench/kernels/gate_up_forms.py [--tokens 512]

Why: in the batch-128 step profile (profile-20261130-0203-…) cuBLAS runs gate/up (and the LM
head) as ``nvjet_…_256x128_…_coopA`` with a memset before it, and the GPU idles 4.1 µs between
that memset and the GEMM, 37 times a step; a memset node that waits on a kernel and a kernel
that waits on it cost more than two kernels in a row. Forms:

- ``F.linear``: ``x @ W.T`` into ``[T, 2I]``, then FlashInfer's ``silu_and_mul`` (production);
- ``no reduced-precision reduction``: the same under
  ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False`` (another
  cuBLAS heuristic choice);
- ``transposed``: ``W @ x.T`` into ``[2I, T]`` (cuBLAS sees another problem shape), then a
  Triton SiLU-and-mul reading the transposed halves;
- ``two GEMMs``: gate and up as two ``[T, I]`` GEMMs, then the Triton SiLU-and-mul;
- ``cuBLASLt``: the first form with ``preferred_blas_library("cublaslt")``.

Each form's output is checked against the first (bf16 GEMMs of other tilings round
differently: max relative error < 2e-2). Writes ``gate-up-forms-<stamp>.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import environment, graph_us, refused, require_cuda, write_report  # noqa: E402

HIDDEN, INTER, LAYERS = 4096, 12288, 36


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, T, N, stride_gt, stride_gi, stride_ut, stride_ui,
                     BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ri = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rt[:, None] < T) & (ri[None, :] < N)
    g = tl.load(g_ptr + rt[:, None] * stride_gt + ri[None, :] * stride_gi, mask=mask,
                other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rt[:, None] * stride_ut + ri[None, :] * stride_ui, mask=mask,
                other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + rt[:, None] * N + ri[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(g: torch.Tensor, u: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``silu(g) * u`` → ``[T, I]``; ``transposed``: g and u are ``[I, T]`` views."""
    if transposed:
        i, t = g.shape
        sg, su = (g.stride(1), g.stride(0)), (u.stride(1), u.stride(0))
        bt, bi = 64, 64
    else:
        t, i = g.shape
        sg, su = (g.stride(0), g.stride(1)), (u.stride(0), u.stride(1))
        bt, bi = 8, 256
    out = torch.empty((t, i), dtype=g.dtype, device=g.device)
    _silu_mul_kernel[(triton.cdiv(t, bt), triton.cdiv(i, bi))](
        g, u, out, t, i, *sg, *su, BLOCK_T=bt, BLOCK_I=bi, num_warps=4)
    return out


@contextmanager
def flag(name: str):
    m = torch.backends.cuda.matmul
    saved = m.allow_bf16_reduced_precision_reduction
    lib = torch.backends.cuda.preferred_blas_library()
    try:
        if name == "no_rpr":
            m.allow_bf16_reduced_precision_reduction = False
        if name == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction = saved
        torch.backends.cuda.preferred_blas_library(lib)


def forms() -> dict:
    import flashinfer

    def linear(x, w):
        return flashinfer.activation.silu_and_mul(F.linear(x, w))

    def transposed(x, w):
        y = torch.mm(w, x.T)  # [2I, T]
        return silu_mul(y[:INTER], y[INTER:], transposed=True)

    def two(x, w):
        return silu_mul(F.linear(x, w[:INTER]), F.linear(x, w[INTER:]), transposed=False)

    return {"F.linear + silu_and_mul": (linear, ""),
            "no reduced-precision reduction": (linear, "no_rpr"),
            "transposed + Triton silu": (transposed, ""),
            "two GEMMs + Triton silu": (two, ""),
            "cuBLASLt": (linear, "cublaslt")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    import flashinfer

    env = environment()
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    t = args.tokens
    layers = [dict(gate_up=torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=dt, generator=g)
                   * HIDDEN**-0.5,
                   down=torch.randn(HIDDEN, INTER, device="cuda", dtype=dt, generator=g)
                   * INTER**-0.5,
                   norm=torch.ones(HIDDEN, device="cuda", dtype=dt)) for _ in range(LAYERS)]
    x0 = torch.randn(t, HIDDEN, device="cuda", dtype=dt, generator=g)
    flops = LAYERS * 2 * t * HIDDEN * (2 * INTER)
    rows, ref, failures = [], None, 0
    for label, (fn, name) in forms().items():
        def step(fn=fn):
            x, r = x0.clone(), torch.zeros_like(x0)
            for lw in layers:
                flashinfer.norm.fused_add_rmsnorm(x, r, lw["norm"], 1e-6)
                x = F.linear(fn(x, lw["gate_up"]), lw["down"])
            return x

        try:
            with flag(name):
                us, out = graph_us(step, args.replays)
        except Exception as e:  # noqa: BLE001 (a form this machine refuses)
            refused(label, e)
            continue
        res = out.float()
        if ref is None:
            ref = res
        err = ((res - ref).norm() / ref.norm()).item()
        failures += not err < 2e-2
        rows.append(dict(form=label, us_step=us, us_layer=us / LAYERS, err=err))
        print(f"  {label:>32}: {us:8.0f} µs/step, {us / LAYERS:6.1f} µs/layer, err {err:.1e}",
              flush=True)
    lines = [f"# Gate/up + SiLU at {t} tokens, 8B shapes ({env['gpu']}, torch {env['torch']})",
             "", f"36 × (add + RMSNorm, gate/up, SiLU-and-mul, down) in one CUDA graph; "
             f"gate/up alone is {flops / 1e12:.2f} TFLOP a step. Median of "
             f"{args.replays} replays.", "",
             "| form | µs/step | µs/layer | rel. err vs first |", "|---|---|---|---|"]
    lines += [f"| {r['form']} | {r['us_step']:.0f} | {r['us_layer']:.1f} | {r['err']:.1e} |"
              for r in rows]
    text = "\n".join(lines)
    print(text)
    print(f"wrote {write_report(args.out, 'gate-up-forms', text, dict(env=env, rows=rows))}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
