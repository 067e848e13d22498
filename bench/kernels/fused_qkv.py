"""The per-layer steps between the q/k/v GEMM and attention, alone: the current path (q head
RMSNorm, k head RMSNorm, RoPE of q and k, two ``index_put`` into the paged cache: FlashInfer
kernels through ``FlashInferOps`` when flashinfer imports, else the torch reference ops)
against the fused Triton kernels of ``dllm.runner.kernels.fused_qkv``, at SDAR-8B / Qwen3-8B shapes
(32/8 heads of 128, qk-norm, rope_theta 1e6, full rotary).

    python bench/kernels/fused_qkv.py --tokens 1,4,512

Each variant is captured as a CUDA graph of ``--iters`` consecutive layers (the layers write
their own KV buffers, 36 of them in turn, as a step does) and replayed: the per-layer time
includes the gaps between launches, which is what fusing removes. "eager" times the same
iterations launched from Python (CPU launch cost included). Prints a table and writes
``fused-qkv-*.md`` / ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import environment, require_cuda, write_report  # noqa: E402

H, HKV, D, THETA, EPS, LAYERS, MAX_POS = 32, 8, 128, 1e6, 1e-6, 36, 40960


def _events_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def time_layer_us(layer, iters: int, reps: int) -> tuple[float, float]:
    """(graph replay µs per layer, eager µs per layer) of ``layer(i)`` for ``i < iters``."""
    def run_all():
        for i in range(iters):
            layer(i)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile / warm up outside the capture
        for _ in range(2):
            run_all()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    eager = _events_ms(run_all, reps) * 1e3 / iters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    graph.replay()
    torch.cuda.synchronize()
    replay = _events_ms(graph.replay, reps) * 1e3 / iters
    return replay, eager


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().flatten(), ref.double().flatten()
    return ((out - ref).norm() / ref.norm()).item()


def bench_tokens(t: int, ops, rope, table, iters: int, reps: int) -> dict:
    from dllm.runner.kernels.fused_qkv import qk_norm_rope, qk_norm_rope_store, store_kv
    from dllm.runner.memory import TokenToKVPool

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(t, (H + 2 * HKV) * D, generator=g, device=dev, dtype=bf)
    wq = 1 + 0.1 * torch.randn(D, generator=g, device=dev, dtype=bf)
    wk = 1 + 0.1 * torch.randn(D, generator=g, device=dev, dtype=bf)
    pos = torch.randint(0, MAX_POS, (t,), generator=g, device=dev)
    page = 64
    pool = TokenToKVPool(-(-2 * t // page) + 1, page, LAYERS, HKV, D, bf, dev)
    loc = (torch.randperm(pool.num_pages * page - page, device=dev)[:t] + page)
    memo: dict = {}

    def split():
        q = qkv[:, : H * D].view(t, H, D)
        k = qkv[:, H * D : (H + HKV) * D].view(t, HKV, D)
        v = qkv[:, (H + HKV) * D :].view(t, HKV, D)
        return q, k, v

    def current(i):  # SelfAttention.forward + the backend's set_kv
        q, k, v = split()
        q = ops.head_rms_norm(q, wq, EPS)
        k = ops.head_rms_norm(k, wk, EPS)
        q, k = ops.rope(rope, pos, q, k, memo)
        pool.set_kv(i % LAYERS, loc, k.view(t, HKV, D), v)
        return q

    def fused_two(i):  # qk_norm_rope + store_kv
        q, k = qk_norm_rope(qkv, H, HKV, D, wq, wk, EPS, table, pos)
        store_kv(pool.k_buffers[i % LAYERS], pool.v_buffers[i % LAYERS], loc, k, split()[2])
        return q

    def fused_one(i):  # qk_norm_rope_store
        return qk_norm_rope_store(qkv, H, HKV, D, wq, wk, EPS, table, pos,
                                  pool.k_buffers[i % LAYERS], pool.v_buffers[i % LAYERS], loc)

    # Agreement (layer 0): q and the cached K/V of each fused variant against the current path.
    q_ref = current(0).view(t, H, D)
    k_ref, v_ref = pool.k_buffers[0][loc].clone(), pool.v_buffers[0][loc].clone()
    errs = {}
    for name, fn in (("fused_two", fused_two), ("fused_one", fused_one)):
        pool.k_buffers[0].zero_()
        pool.v_buffers[0].zero_()
        q = fn(0)
        errs[name] = {"q": rel(q, q_ref), "k": rel(pool.k_buffers[0][loc], k_ref),
                      "v_equal": bool(torch.equal(pool.v_buffers[0][loc], v_ref))}
    row = {"tokens": t, "agreement": errs}
    for name, fn in (("current", current), ("fused_two", fused_two), ("fused_one", fused_one)):
        row[f"{name}_graph_us"], row[f"{name}_eager_us"] = time_layer_us(fn, iters, reps)
    return row


def table(rows: list[dict], current: str) -> str:
    head = (f"| tokens | current ({current}) µs | norm+rope, store_kv µs | norm+rope+store µs | "
            "speed-up (one launch) | eager current / two / one µs | rel err q, k |\n"
            "|---|---|---|---|---|---|---|\n")
    out = []
    for r in rows:
        e = r["agreement"]["fused_one"]
        out.append(
            f"| {r['tokens']} | {r['current_graph_us']:.2f} | {r['fused_two_graph_us']:.2f} | "
            f"{r['fused_one_graph_us']:.2f} | "
            f"{r['current_graph_us'] / r['fused_one_graph_us']:.2f}× | "
            f"{r['current_eager_us']:.1f} / {r['fused_two_eager_us']:.1f} / "
            f"{r['fused_one_eager_us']:.1f} | {e['q']:.1e}, {e['k']:.1e} |\n")
    return head + "".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,512")
    ap.add_argument("--iters", type=int, default=100, help="layers per captured graph")
    ap.add_argument("--reps", type=int, default=20, help="replays timed (median taken)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    from dllm.models.config import ModelConfig
    from dllm.models.layers import RopeSpec, RotaryEmbedding
    from dllm.models.ops import TORCH_OPS

    dev = torch.device("cuda")
    rope = RotaryEmbedding(RopeSpec.from_config(ModelConfig({"rope_theta": THETA}), D)).to(dev)
    try:
        from dllm.runner.layer_ops import FlashInferOps

        ops = FlashInferOps(torch.nn.ModuleList([rope]), MAX_POS, dev)
        table_ = ops.cos_sin[rope.spec]
    except ImportError:
        ops, table_ = TORCH_OPS, rope.cos_sin_cache(MAX_POS).to(dev)
    rows = [bench_tokens(t, ops, rope, table_, args.iters, args.reps)
            for t in map(int, args.tokens.split(","))]
    env = environment()
    md = (f"# Fused q/k norm + RoPE + KV write, per layer\n\n"
          f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
          f"flashinfer {env['flashinfer']}; H={H}, Hkv={HKV}, D={D}, bf16, qk-norm, full rotary; "
          f"CUDA-graph replay of {args.iters} layers (median of {args.reps}).\n\n"
          + table(rows, ops.name))
    print(md)
    path = write_report(args.out, "fused-qkv", md,
                        {"env": env, "args": vars(args), "current": ops.name, "rows": rows})
    print(f"wrote {path} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
