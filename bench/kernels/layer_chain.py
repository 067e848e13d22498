"""The batch-1 GEMM chain of a whole 8B step, as the model runs it, under launch variants of the
skinny GEMM (``dllm.runner.kernels.skinny_gemm``): every layer's q/k/v (1/rms from the partials),
o_proj (+ residual, next norm), gate/up (1/rms, SiLU-and-mul in the epilogue) and down
(+ residual, next norm), each reading the previous one's output, 36 layers of distinct weights
(7.8 GB, far past the L2), replayed as one CUDA graph.

    python bench/kernels/layer_chain.py [--tokens 4] [--layers 36]

Per variant: the chain's time per step, per layer, and against the bytes it reads at the copy
ceiling measured in the same run. Variants: plain launches; the weights loaded with an L2
``evict_first`` policy; programmatic dependent launch (PDL) with 0-16 MB of each weight
prefetched into L2 before the kernel waits for its input, each program letting the next
kernel launch at its start, once its input is ready, or after its main loop; with and
without ``evict_first``. Each
variant's output is compared with the plain chain's (the launch mode changes no arithmetic:
the bits must be equal). Writes ``layer-chain-<stamp>.md`` / ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from dllm.runner.kernels import skinny_gemm as sg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import (  # noqa: E402
    copy_bandwidth,
    environment,
    graph_us,
    refused,
    require_cuda,
    write_report,
)

HIDDEN, INTER, QKV = 4096, 12288, 6144
EPS = 1e-6
# (label, pdl, prefetch bytes, weight eviction policy, where a program lets the next kernel
# launch: 0 at its start, 1 once its input is ready, 2 after its main loop)
VARIANTS = [("plain", False, 0, "", 0), ("evict_first", False, 0, "evict_first", 0),
            ("pdl, trigger at start", True, 0, "", 0),
            ("pdl, trigger at start + 16 MB prefetch", True, 16 * 2**20, "", 0)]
VARIANTS += [(f"pdl, trigger {where}{f' + {mb} MB prefetch' if mb else ''}", True,
              mb * 2**20, "", trigger)
             for trigger, where in ((1, "after wait"), (2, "after main loop"))
             for mb in (0, 2, 8, 16)]
VARIANTS += [("pdl, trigger after wait + 8 MB prefetch, evict_first", True, 8 * 2**20,
              "evict_first", 1)]


def build(layers: int, dt: torch.dtype) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(n, k):
        return torch.randn(n, k, device="cuda", dtype=dt, generator=g) * k**-0.5

    def nw(n):
        return 1 + 0.1 * torch.randn(n, device="cuda", dtype=dt, generator=g)

    return [dict(qkv=w(QKV, HIDDEN), o=w(HIDDEN, HIDDEN), gate_up=w(2 * INTER, HIDDEN),
                 down=w(HIDDEN, INTER), post_norm=nw(HIDDEN), next_norm=nw(HIDDEN))
            for _ in range(layers)]


def chain(weights: list[dict], x: torch.Tensor, pdl: bool) -> torch.Tensor:
    """The layer GEMMs with the model's fusions; attention is left out (its output stands in
    as the first HIDDEN columns of q/k/v's)."""
    m = x.shape[0]
    stream = x
    scaled = x
    sum_sq = torch.zeros(HIDDEN // 32, sg._block_m(m), device=x.device, dtype=torch.float32)
    sum_sq[:, :m] = (x.float().pow(2).sum(-1) / (HIDDEN // 32))
    for lw in weights:
        qkv = sg.skinny_linear(scaled, lw["qkv"], sum_sq=sum_sq, eps=EPS, pdl=pdl)
        stream, scaled, sum_sq = sg.skinny_linear_residual(
            qkv[:, :HIDDEN], lw["o"], None, stream, lw["post_norm"], pdl=pdl)
        act = sg.skinny_linear(scaled, lw["gate_up"], sum_sq=sum_sq, eps=EPS, silu=True, pdl=pdl)
        stream, scaled, sum_sq = sg.skinny_linear_residual(act, lw["down"], None, stream,
                                                           lw["next_norm"], pdl=pdl)
    return stream


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--layers", type=int, default=36)
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    env = environment()
    bw = copy_bandwidth()
    dt = torch.bfloat16
    weights = build(args.layers, dt)
    per_layer = 2 * (QKV + HIDDEN + 2 * INTER) * HIDDEN + 2 * HIDDEN * INTER
    floor_us = args.layers * per_layer / bw * 1e6
    x = torch.randn(args.tokens, HIDDEN, device="cuda", dtype=dt)
    print(f"{env}\ncopy ceiling {bw / 1e12:.2f} TB/s; {args.layers} layers × "
          f"{per_layer / 1e6:.0f} MB: floor {floor_us:.0f} µs", flush=True)
    rows, ref, failures = [], None, 0
    saved = (sg.PREFETCH_BYTES, sg.W_EVICT, sg.PDL_TRIGGER)
    for label, pdl, prefetch, evict, trigger in VARIANTS:
        sg.PREFETCH_BYTES, sg.W_EVICT, sg.PDL_TRIGGER = prefetch, evict, trigger
        try:
            us, out = graph_us(lambda pdl=pdl: chain(weights, x, pdl))
        except Exception as e:  # noqa: BLE001 (a variant the GPU or compiler refuses)
            refused(f"  {label}", e)
            continue
        finally:
            sg.PREFETCH_BYTES, sg.W_EVICT, sg.PDL_TRIGGER = saved
        if ref is None:
            ref = out
        same = torch.equal(out, ref)
        failures += not same
        rows.append(dict(variant=label, us=us, per_layer_us=us / args.layers,
                         x_floor=us / floor_us, equal=same))
        print(f"  {label:>52}: {us:8.0f} µs/step, {us / args.layers:6.1f} µs/layer, "
              f"{us / floor_us:.3f}× floor, bits {'equal' if same else 'DIFFER'}", flush=True)
    lines = [f"# Batch-{args.tokens} GEMM chain of an 8B step ({env['gpu']}, torch "
             f"{env['torch']}, triton {env['triton']})", "",
             f"{args.layers} layers of q/k/v, o_proj, gate/up, down with the fused epilogues; "
             f"{args.layers * per_layer / 1e9:.2f} GB of weights; copy ceiling "
             f"{bw / 1e12:.2f} TB/s → floor {floor_us:.0f} µs. Median of 20 CUDA-graph "
             "replays.", "",
             "| variant | µs/step | µs/layer | × floor | bits equal to plain |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['us']:.0f} | {r['per_layer_us']:.1f} | "
              f"{r['x_floor']:.3f} | {'yes' if r['equal'] else 'NO'} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    print(f"wrote {write_report(args.out, 'layer-chain', text, dict(env=env, rows=rows))}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
