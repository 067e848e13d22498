"""One MoE layer's routing and routed experts, the torch path against the Triton kernels of
``dllm.runner.kernels.moe_route`` and ``fused_moe``, next to the layer's floors measured in the
same run.

    python bench/kernels/moe.py [--tokens 32,1024,4096] [--shapes llada2-mini,sdar-30b,llada-moe]
    python bench/kernels/moe.py --sweep [--tokens ...] [--shapes llada2-mini]

Shapes: LLaDA2.0-mini (hidden 2048, 256 experts of 512, top-8, sigmoid routing in 8 groups of
which 4 are kept, scaling 2.5), SDAR-30B-A3B (128 experts of 768, top-8, softmax,
renormalised) and LLaDA-MoE (64 experts of 1024, top-8, softmax). 32, 1024 and 4096 tokens
are the batch-1, -32 and -128 denoise steps of block 32. Router logits come from a random
float32 gate over random x (about uniform routing).

Times are medians of CUDA-graph replays (``bench/report.py``): routing (torch
``sigmoid_grouped_topk`` / ``softmax_topk`` against ``route_sigmoid`` / ``route_softmax``, and
the float32 router GEMM that produces the logits, for scale), and the experts
(``StackedExperts.forward_grouped``: ``grouped_mm`` x3 against ``fused_experts``, with the
fused path's launches timed alone too: the alignment, gate/up + SiLU, down x weight, the
K-way sum). The experts take turns among two copies of the layer's weights (>= 0.8 GB each,
far past the L2), as in a step where other layers pass in between. Floors: the bytes of the
experts the routing reaches, read once at the copy bandwidth, and ``2 * 3 * pairs * H * I``
FLOPs at the sustained bf16 matmul rate (``measure_ceilings``); the layer's floor is the
larger. Each fused result is checked against the grouped path (relative error < 1e-2) and
the Triton routing against torch's (the fraction of tokens with the same expert set).

``--sweep`` times candidate tiles of gate/up and down per token count (each kernel alone on
the alignment of its ``block_m``) and prints the fastest, for ``fused_moe.config_for``.
Writes ``moe-<stamp>.md`` / ``.json`` (``moe-sweep-<stamp>`` with ``--sweep``) under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dllm.models.moe import StackedExperts, sigmoid_grouped_topk, softmax_topk
from dllm.runner.kernels import fused_moe as fm
from dllm.runner.kernels import moe_route

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import (  # noqa: E402
    environment,
    graph_us,
    measure_ceilings,
    refused,
    require_cuda,
    rotating_us,
    write_report,
)


@dataclass(frozen=True)
class Shape:
    hidden: int
    experts: int
    inter: int
    top_k: int
    router: str  # "sigmoid" (LLaDA2 / Ling) or "softmax"
    renormalize: bool
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0


SHAPES = {
    "llada2-mini": Shape(2048, 256, 512, 8, "sigmoid", True, 8, 4, 2.5),
    "sdar-30b": Shape(2048, 128, 768, 8, "softmax", True),
    "llada-moe": Shape(2048, 64, 1024, 8, "softmax", False),
}
COPIES, CALLS, ROUTE_CALLS = 2, 4, 10


def experts_module(s: Shape, g: torch.Generator) -> StackedExperts:
    """A bf16 ``StackedExperts`` with random weights, built on the GPU."""
    with torch.device("meta"):
        ex = StackedExperts(s.experts, s.hidden, s.inter)

    def rand(*shape: int, fan_in: int) -> nn.Parameter:
        w = torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)
        return nn.Parameter(w.mul_(fan_in**-0.5), requires_grad=False)

    ex.gate_proj = rand(s.experts, s.inter, s.hidden, fan_in=s.hidden)
    ex.up_proj = rand(s.experts, s.inter, s.hidden, fan_in=s.hidden)
    ex.down_proj = rand(s.experts, s.hidden, s.inter, fan_in=s.inter)
    return ex


def torch_route(s: Shape, logits: torch.Tensor, bias: torch.Tensor | None):
    if s.router == "sigmoid":
        return sigmoid_grouped_topk(logits, s.top_k, s.n_group, s.topk_group, bias,
                                    s.renormalize, s.scaling)
    return softmax_topk(logits, s.top_k, s.renormalize)


def triton_route(s: Shape, logits: torch.Tensor, bias: torch.Tensor | None):
    if s.router == "sigmoid":
        return moe_route.route_sigmoid(logits, s.top_k, s.n_group, s.topk_group, bias,
                                       s.renormalize, s.scaling)
    return moe_route.route_softmax(logits, s.top_k, s.renormalize)


def weights_of(ex: StackedExperts) -> tuple[torch.Tensor, ...]:
    return ex.gate_proj, ex.up_proj, ex.down_proj


def inputs(s: Shape, tokens: int, g: torch.Generator):
    x = torch.randn(tokens, s.hidden, device="cuda", generator=g).to(torch.bfloat16)
    gate = torch.randn(s.experts, s.hidden, device="cuda", generator=g) * s.hidden**-0.5
    bias = (torch.randn(s.experts, device="cuda", generator=g) * 0.1
            if s.router == "sigmoid" else None)
    return x, gate, bias


def bench_case(name: str, s: Shape, tokens: int, layers: list[StackedExperts],
               ceilings: dict, g: torch.Generator) -> dict:
    x, gate, bias = inputs(s, tokens, g)
    logits = F.linear(x.float(), gate)
    weights, ids = torch_route(s, logits, bias)
    t_w, t_ids = triton_route(s, logits, bias)
    same = (t_ids.sort(1).values == ids.sort(1).values).all(1).float().mean().item()
    pairs = tokens * s.top_k
    hit = ids.unique().numel()
    row = dict(shape=name, tokens=tokens, pairs=pairs, experts_hit=hit,
               config=fm.config_for(pairs, s.experts, s.hidden, s.inter).label(),
               route_same=same)
    row["gate_gemm_us"], _ = graph_us(lambda: [F.linear(x.float(), gate)
                                               for _ in range(ROUTE_CALLS)])
    row["gate_gemm_us"] /= ROUTE_CALLS
    for key, fn in (("route_torch_us", torch_route), ("route_triton_us", triton_route)):
        us, _ = graph_us(lambda fn=fn: [fn(s, logits, bias) for _ in range(ROUTE_CALLS)])
        row[key] = us / ROUTE_CALLS
    row["grouped_us"] = rotating_us(lambda ex: ex.forward_grouped(x, ids, weights), layers,
                                    CALLS)
    row["fused_us"] = rotating_us(
        lambda ex: fm.fused_experts(x, *weights_of(ex), ids, weights), layers, CALLS)
    ref = layers[0].forward_grouped(x, ids, weights).float()
    got = fm.fused_experts(x, *weights_of(layers[0]), ids, weights).float()
    row["err"] = ((got - ref).norm() / ref.norm()).item()
    row.update(parts(s, x, ids, weights, layers))
    w_bytes = hit * 3 * s.hidden * s.inter * 2
    row["bytes_floor_us"] = w_bytes / ceilings["hbm_bytes_per_s"] * 1e6
    row["flop_floor_us"] = 2 * 3 * pairs * s.hidden * s.inter / ceilings["bf16_flops_per_s"] * 1e6
    row["floor_us"] = max(row["bytes_floor_us"], row["flop_floor_us"])
    row["fused_x_floor"] = row["fused_us"] / row["floor_us"]
    row["grouped_x_floor"] = row["grouped_us"] / row["floor_us"]
    return row


def parts(s: Shape, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
          layers: list[StackedExperts], cfg: fm.MoeConfig | None = None) -> dict:
    """The fused path's launches one by one (each in its own graph)."""
    pairs = ids.numel()
    cfg = cfg or fm.config_for(pairs, s.experts, s.hidden, s.inter)
    layout = fm.align(ids, s.experts, cfg.block_m)
    act = fm.gate_up_silu(x, layers[0].gate_proj, layers[0].up_proj, layout, s.top_k, cfg)
    y = fm.down_weighted(act, layers[0].down_proj, weights, layout, cfg)
    align_us, _ = graph_us(lambda: [fm.align(ids, s.experts, cfg.block_m)
                                    for _ in range(ROUTE_CALLS)])
    return dict(
        align_us=align_us / ROUTE_CALLS,
        gate_up_us=rotating_us(lambda ex: fm.gate_up_silu(x, ex.gate_proj, ex.up_proj, layout,
                                                          s.top_k, cfg, out=act), layers, CALLS),
        down_us=rotating_us(lambda ex: fm.down_weighted(act, ex.down_proj, weights, layout,
                                                        cfg, out=y), layers, CALLS),
        sum_us=graph_us(lambda: [fm.sum_pairs(y, ids, s.experts, x.dtype)
                                 for _ in range(ROUTE_CALLS)])[0] / ROUTE_CALLS)


def sweep_candidates(per_expert: float) -> list[tuple[int, bool, int, int, int, int]]:
    """(block_m, swap_ab, n, k, warps, stages) tiles of gate/up and down to try at about
    ``per_expert`` rows an expert."""
    if per_expert <= 6:  # weight streaming: tile widths, K steps and pipeline depths
        return [(16, True, n, k, 4, st) for n in (32, 64, 128) for k in (64, 128, 256)
                for st in (3, 4, 5) if n * k <= 16384]
    if per_expert <= 24:
        return [(m, m < 64, n, k, 4, st) for m in (16, 32, 64) for n, k in ((64, 128), (128, 64))
                for st in (3, 4)]
    if per_expert <= 64:
        return [(64, swap, *c) for swap in (False, True) for c in (
            (64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 6), (128, 32, 4, 8),
            (256, 64, 8, 3), (256, 32, 8, 4), (256, 32, 8, 6))]
    return [(m, False, *c) for m in (64, 128) for c in (
        (128, 64, 4, 3), (128, 64, 4, 5), (128, 64, 8, 3), (128, 32, 4, 6), (256, 64, 8, 3),
        (256, 32, 8, 4), (256, 32, 8, 6))]


def time_kernel(kind: str, cfg: fm.MoeConfig, s: Shape, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, layers: list[StackedExperts]) -> float:
    """µs of one gate/up (``kind`` "gate_up") or down launch with ``cfg``'s tiles."""
    layout = fm.align(ids, s.experts, cfg.block_m)
    base = fm.config_for(ids.numel(), s.experts, s.hidden, s.inter)
    act = fm.gate_up_silu(x, layers[0].gate_proj, layers[0].up_proj, layout, s.top_k,
                          fm.MoeConfig(cfg.block_m, cfg.swap_ab, *astuple(base)[2:]))
    if kind == "gate_up":
        return rotating_us(lambda ex: fm.gate_up_silu(x, ex.gate_proj, ex.up_proj, layout,
                                                      s.top_k, cfg, out=act), layers, CALLS)
    y = fm.down_weighted(act, layers[0].down_proj, weights, layout, cfg)
    return rotating_us(lambda ex: fm.down_weighted(act, ex.down_proj, weights, layout, cfg,
                                                   out=y), layers, CALLS)


def sweep(out: str, names: list[str], tokens: list[int]) -> int:
    env = environment()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, best = [], []
    for name in names:
        s = SHAPES[name]
        layers = [experts_module(s, g) for _ in range(COPIES)]
        for t in tokens:
            x, gate, bias = inputs(s, t, g)
            weights, ids = torch_route(s, F.linear(x.float(), gate), bias)
            pairs = ids.numel()
            for kind in ("gate_up", "down"):
                for block_m, swap, n, k, w, st in sweep_candidates(pairs / s.experts):
                    cfg = fm.MoeConfig(block_m, swap, n, k, w, st, n, k, w, st)
                    label = f"m{block_m}{'T' if swap else 'N'} n{n}k{k}w{w}s{st}"
                    try:
                        us = time_kernel(kind, cfg, s, x, ids, weights, layers)
                    except Exception as e:  # noqa: BLE001 (out of resources, say)
                        refused(f"  {name} {t} {kind} {label}", e)
                        continue
                    rows.append(dict(shape=name, tokens=t, kernel=kind, config=label, us=us))
                    print(f"{name} {t:5d} {kind:>7} {label:>22}: {us:8.1f} µs", flush=True)
            for kind in ("gate_up", "down"):
                mine = sorted((r for r in rows if r["shape"] == name and r["tokens"] == t
                               and r["kernel"] == kind), key=lambda r: r["us"])
                best += mine[:3]
        del layers
        torch.cuda.empty_cache()
    lines = [f"# Fused MoE tile sweep ({env['gpu']}, triton {env['triton']})", "",
             "Each kernel alone on its block_m's alignment; median of graph replays of "
             f"{CALLS} calls over {COPIES} weight copies; the three fastest a kernel.", "",
             "| shape | tokens | kernel | config | µs |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['tokens']} | {r['kernel']} | {r['config']} | "
              f"{r['us']:.1f} |" for r in best]
    text = "\n".join(lines)
    print(text)
    print(f"wrote {write_report(out, 'moe-sweep', text, dict(env=env, rows=rows))}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", default="32,1024,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true",
                    help="time candidate tiles of the expert kernels instead")
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    names = args.shapes.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.sweep:
        return sweep(args.out, names, tokens)
    ceilings = measure_ceilings()
    env = {**environment(), **ceilings}
    print(f"copy {ceilings['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
          f"{ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s sustained", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in names:
        s = SHAPES[name]
        layers = [experts_module(s, g) for _ in range(COPIES)]
        for t in tokens:
            row = bench_case(name, s, t, layers, ceilings, g)
            rows.append(row)
            print(f"{name} {t:5d}: route {row['route_torch_us']:.1f} -> "
                  f"{row['route_triton_us']:.1f} µs, experts {row['grouped_us']:.1f} -> "
                  f"{row['fused_us']:.1f} µs (floor {row['floor_us']:.1f}, "
                  f"{row['fused_x_floor']:.2f}x), err {row['err']:.1e}", flush=True)
        del layers
        torch.cuda.empty_cache()
    lines = [
        f"# MoE layer: torch vs fused Triton ({env['gpu']}, torch {env['torch']}, triton "
        f"{env['triton']}; copy {ceilings['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
        f"{ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s sustained)", "",
        "µs a call, medians of CUDA-graph replays. route: torch -> Triton (same: tokens with "
        "the same expert set); gate: the float32 router GEMM before it; experts: grouped_mm "
        "path -> fused (align + gate/up + down + sum alone); floor: max(bytes of the experts "
        "reached at the copy bandwidth, FLOPs at the sustained matmul rate).", "",
        "| shape | tokens | hit | route torch | route triton | same | gate | grouped | fused "
        "| align | gate/up | down | sum | bytes floor | flop floor | fused × floor | grouped × "
        "floor | err | config |",
        "|" + "---|" * 19]
    lines += [f"| {r['shape']} | {r['tokens']} | {r['experts_hit']} | "
              f"{r['route_torch_us']:.1f} | {r['route_triton_us']:.1f} | {r['route_same']:.4f} | "
              f"{r['gate_gemm_us']:.1f} | {r['grouped_us']:.1f} | {r['fused_us']:.1f} | "
              f"{r['align_us']:.1f} | {r['gate_up_us']:.1f} | {r['down_us']:.1f} | "
              f"{r['sum_us']:.1f} | {r['bytes_floor_us']:.1f} | {r['flop_floor_us']:.1f} | "
              f"{r['fused_x_floor']:.2f} | {r['grouped_x_floor']:.2f} | {r['err']:.1e} | "
              f"{r['config']} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    print(f"wrote {write_report(args.out, 'moe', text, dict(env=env, rows=rows))}")
    return 1 if any(not r["err"] < 1e-2 for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
