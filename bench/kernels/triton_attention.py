"""The ``DLLM_EXTEND`` attention of one layer alone: the Triton paged kernel
(runner/kernels/triton_extend.py) against FlashInfer's packed decode form (the production
path at large batch, with and without its two head permutations) and its paged prefill with
``causal=False``, on SDAR-8B, LLaDA2-mini and the full-attention models' window shapes, over a
KV pool of shuffled pages.

    python bench/kernels/triton_attention.py --rows 1,8,32,128 --keys 330 [--sweep]
    python bench/kernels/triton_attention.py --models llada-8b,dream-7b --rows 1 --keys 384 \
        --jitter 0 --splits 1,4,8 --sweep --sweep-rows 1 --sweep-splits 4,8,16
    python bench/kernels/triton_attention.py --models llada-8b,dream-7b --rows 1 --keys 384 \
        --jitter 0 --blocks 128,384 --sweep --sweep-rows 1 --sweep-space large \
        --sweep-splits 1,2,4

Each form is checked against a float32 reference first. ``µs``: the median of single calls
each after a read of 256 MB (L2 holds other, clean data: the KV comes from HBM, as in a step
where 36 layers pass in between); also ``triton.testing.do_bench``'s median (its L2 flush
zeroes a buffer, whose dirty lines are written back during the timed call: slower), the
mean CUDA-graph replay (one launch a replay, L2 not flushed) and, for the Triton kernel, the
median call of a CUDA graph of calls taking turns among copies of the KV pool (> 400 MB in
all: back to back, keys from HBM, as a step's layers run them). The sweep uses do_bench, or
with ``--sweep-splits`` (few rows: a launch's latency) the graph over KV copies. GB/s counts
the KV bytes the rows must read (K and V of every key of every KV head, once). Prints a
markdown table; writes ``triton-attn-*.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dllm.runner.kernels.triton_extend import (
    default_config,
    dllm_extend_attention,
    launch_config,
    plan,
    reference,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import (  # noqa: E402
    copy_bandwidth,
    environment,
    require_cuda,
    rotating_us,
    stamp,
    write_report,
)

# name: (query heads, KV heads, head dim, block size)
MODELS = {"sdar-8b": (32, 8, 128, 4), "llada2-mini": (16, 4, 128, 32),
          "qwen3-8b-decode": (32, 8, 128, 1),
          # full attention's 32-token dual-cache window (LLaDA-8B: 32 KV heads; Dream-7B: 28/4)
          "llada-8b": (32, 32, 128, 32), "dream-7b": (28, 4, 128, 32)}
PAGE = 16
SWEEP = [dict(BLOCK_N=n, num_warps=w, num_stages=s, PREFETCH=p, KV_FIRST=f)
         for n in (32, 64) for w in (4, 8) for s in (1, 2, 3) for p in (0, 1, 2)
         for f in (False, True)]
SWEEP += [dict(BLOCK_N=128, num_warps=w, num_stages=s, PREFETCH=p, KV_FIRST=f)
          for w in (4, 8) for s in (2, 3) for p in (0, 1) for f in (False, True)]
# With --sweep-splits (few rows, keys split over several programs): the query tile's height
# too, up to the block's own (B·G rows), with fewer of the other knobs.
SPLIT_SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=4, num_stages=s, PREFETCH=p, KV_FIRST=False)
               for m in (16, 32, 64, 128) for n in (32, 64) for s in (2, 3) for p in (0, 1)]
# With --sweep-space large (query tiles of hundreds of rows: prefix windows, the whole canvas):
# flash-attention-like tiles, 8 warps for the 128-row ones, at each of --sweep-splits.
LARGE_SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, PREFETCH=1, KV_FIRST=False)
               for m, n, w, s in ((64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2),
                                  (128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3),
                                  (128, 64, 8, 2), (128, 128, 8, 2))]


def build(rows: int, keys: int, jitter: float, h: int, hkv: int, d: int, block: int,
          seed: int):
    """A batch of ``rows`` rows with about ``keys`` keys each (uniform within ±jitter, at
    least one block), their pages shuffled over the pool."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(block, int(keys * (1 - jitter))), max(block, int(keys * (1 + jitter)))
    seq = torch.randint(lo, hi + 1, (rows,), generator=g)
    pages = (seq + PAGE - 1) // PAGE
    width = int(pages.max()) * PAGE
    perm = (torch.randperm(int(pages.sum()), generator=g) + 1).tolist()  # page 0: padding
    table = torch.zeros(rows + 1, width, dtype=torch.int64)
    at = 0
    for r in range(rows):
        mine = torch.tensor(perm[at : at + int(pages[r])], dtype=torch.int64)
        at += int(pages[r])
        t = torch.arange(int(pages[r]) * PAGE)
        table[r + 1, : t.numel()] = mine[t // PAGE] * PAGE + t % PAGE
    slots = (int(pages.sum()) + 1) * PAGE
    dev = torch.device("cuda")
    bf = dict(device=dev, dtype=torch.bfloat16)
    return dict(
        q=torch.randn(rows * block, h, d, **bf),
        k=torch.randn(slots, hkv, d, **bf), v=torch.randn(slots, hkv, d, **bf),
        table=table.to(dev), req=torch.arange(1, rows + 1, device=dev),
        seq=seq.to(dev), seq_cpu=seq, pages=pages, perm_pages=perm, block=block,
        kv_bytes=int(seq.sum()) * hkv * d * 2 * 2)


def flashinfer_forms(b: dict, h: int, hkv: int, d: int, scale: float) -> dict:
    """FlashInfer callables as runner/attention/flashinfer.py plans them."""
    import flashinfer

    dev = b["q"].device
    rows, block = b["seq_cpu"].numel(), b["block"]
    indptr = torch.zeros(rows + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(b["pages"], 0)
    # The rows' page ids in order, from the table (slot // page at 0, 16, 32, ...).
    idx = torch.cat([b["table"][r + 1, : int(p) * PAGE : PAGE] // PAGE
                     for r, p in enumerate(b["pages"].tolist())]).to(torch.int32)
    last = (b["seq_cpu"] - (b["pages"] - 1) * PAGE).to(torch.int32)
    common = dict(num_kv_heads=hkv, page_size=PAGE, q_data_type=torch.bfloat16,
                  kv_data_type=torch.bfloat16, sm_scale=scale)
    cache = (b["k"].view(-1, PAGE, hkv, d), b["v"].view(-1, PAGE, hkv, d))
    forms = {}
    ws_d = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws_d, "NHD", use_tensor_cores=True)
    dec.plan(indptr, idx, last, num_qo_heads=h * block, head_dim=d, disable_split_kv=True,
             **common)
    g = h // hkv
    q = b["q"]
    packed_q = q.view(rows, block, hkv, g, d).transpose(1, 2).reshape(rows, -1, d).contiguous()

    def packed_full():
        rq = q.view(rows, block, hkv, g, d).transpose(1, 2).reshape(rows, -1, d)
        out = dec.run(rq, cache)
        return out.view(rows, hkv, block, g, d).transpose(1, 2).reshape(rows * block, h, d)

    forms["flashinfer decode packed (kernel)"] = (lambda: dec.run(packed_q, cache), None)
    forms["flashinfer decode packed + 2 permutations"] = (packed_full, packed_full)
    ws_p = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws_p, "NHD")
    qo = torch.arange(rows + 1, dtype=torch.int32) * block
    pre.plan(qo, indptr, idx.to(dev), last, num_qo_heads=h, head_dim_qk=d, causal=False,
             **common)
    forms["flashinfer prefill causal=False"] = (lambda: pre.run(q, cache),
                                                lambda: pre.run(q, cache))
    return forms


def cold_us(fn, flush: torch.Tensor, reps: int = 50) -> float:
    """Median µs of one call after a read of a buffer larger than L2 (leaving its lines
    clean: ``do_bench`` zeroes its flush buffer, whose dirty lines are then written back
    during the timed call)."""
    fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for a, b in zip(starts, ends, strict=True):
        flush.sum()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in zip(starts, ends, strict=True))[reps // 2] * 1e3


def _err(e: float | None) -> str:
    return "" if e is None else f"{e:.1e}"


def graph_replay_us(fn, iters: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--keys", type=int, default=330, help="mean keys per row")
    ap.add_argument("--jitter", type=float, default=0.25,
                    help="keys per row uniform in keys·(1 ± jitter)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sweep", action="store_true",
                    help="also time BLOCK_N × num_warps × num_stages × PREFETCH × KV_FIRST")
    ap.add_argument("--sweep-rows", default="32,128", help="row counts the sweep runs at")
    ap.add_argument("--sweep-splits", default="1",
                    help="comma list of key-split counts the sweep runs each config at (other "
                         "than 1: the query tile's height swept too, fewer of the rest)")
    ap.add_argument("--sweep-space", choices=("auto", "large"), default="auto",
                    help="auto: SWEEP with one split, else SPLIT_SWEEP; large: LARGE_SWEEP "
                         "(tiles for hundreds of query rows) at each of --sweep-splits")
    ap.add_argument("--blocks", default="",
                    help="comma list of query tokens a row, instead of the model's block "
                         "(the full-attention models' prefix windows and whole canvas)")
    ap.add_argument("--plans", action="store_true",
                    help="also time the attention backend's launch plan (triton_extend.plan) "
                         "and the plan before session 20 (rows x KV heads x splits >= two "
                         "waves, at most 4 splits; launch_config's tile)")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--splits", default="",
                    help="comma list of key-split counts to time the default config at (the "
                         "merge folded into the last split program, and as a second launch)")
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    import triton

    env = environment()
    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    env["copy_bytes_per_s"] = bw
    print(json.dumps(env))
    use_fi = env["flashinfer"] is not None and not args.no_flashinfer
    flush = torch.ones(256 * 2**20 // 4, dtype=torch.float32, device="cuda")
    results = []
    failures = []

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    cases = [(model, block) for model in args.models.split(",")
             for block in ([int(b) for b in args.blocks.split(",")] if args.blocks
                           else [MODELS[model][3]])]
    for model, block in cases:
        h, hkv, d, _ = MODELS[model]
        scale = d**-0.5
        for rows in map(int, args.rows.split(",")):
            b = build(rows, args.keys, args.jitter, h, hkv, d, block, seed=rows)
            call = (b["q"], b["k"], b["v"], b["table"], b["req"], b["seq"], block, scale)
            ref = reference(*call)
            base = dict(model=model, rows=rows, block=block,
                        mean_keys=float(b["seq_cpu"].float().mean()),
                        kv_mb=b["kv_bytes"] / 1e6, floor_us=b["kv_bytes"] / bw * 1e6)

            # Copies of the KV pool, > 400 MB in all: in a graph of calls taking turns among
            # them, each call reads its keys from HBM, back to back, as a step's layers do.
            kvs = [(b["k"].clone(), b["v"].clone())
                   for _ in range(max(2, -(-400 * 2**20 // (2 * b["k"].numel() * 2))))]

            def hbm_us(kv_fn, kvs=kvs) -> float:
                """µs a call of ``kv_fn(k, v)`` in a graph of calls over the KV copies."""
                return rotating_us(lambda kv: kv_fn(*kv), kvs, max(40, len(kvs)))

            def timed(fn, graph=False, flush=flush, kv_fn=None):
                us = bench(fn)
                extra = dict(zeroed_l2_us=us, clean_l2_us=cold_us(fn, flush))
                if graph:  # (FlashInfer's eager wrappers are not captured here)
                    extra["graph_replay_us"] = graph_replay_us(fn)
                if kv_fn is not None:
                    extra["hbm_graph_us"] = hbm_us(kv_fn)
                return extra["clean_l2_us"], extra

            def record(impl, us, out, extra=None, base=base, ref=ref, b=b):
                err = (out.float() - ref).abs().max().item() if out is not None else None
                row = dict(base, impl=impl, us=us, gb_s=b["kv_bytes"] / us / 1e3,
                           max_err=err, **(extra or {}))
                results.append(row)
                if err is not None and not err < 2e-2:
                    failures.append(row)
                return row

            out = torch.full_like(b["q"], float("nan"))
            cfg = default_config(block * h // hkv, d)
            dllm_extend_attention(*call, out=out)
            rest = call[3:]
            t, extra = timed(lambda call=call, out=out: dllm_extend_attention(*call, out=out),
                             graph=True, kv_fn=lambda k, v, q=b["q"], rest=rest, out=out:
                             dllm_extend_attention(q, k, v, *rest, out=out))
            record("triton (default)", t, out, dict(extra, config=cfg))
            if args.plans:
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                m = block * h // hkv
                # before session 20: splits for two waves of rows × KV heads, at most 4
                split = max(1, min(4, -(-2 * sms // (rows * hkv))))
                for name, (n, c) in (("plan", plan(rows, hkv, m, d, sms)),
                                     ("split plan", (split, launch_config(rows, hkv, m, d, split,
                                                                         sms)))):
                    o = torch.full_like(b["q"], float("nan"))
                    def fn(call=call, o=o, n=n, c=c):
                        return dllm_extend_attention(*call, out=o, num_splits=n, config=c)

                    fn()
                    t, extra = timed(fn, graph=True, kv_fn=lambda k, v, q=b["q"], rest=rest,
                                     o=o, n=n, c=c: dllm_extend_attention(
                                         q, k, v, *rest, out=o, num_splits=n, config=c))
                    record(f"triton ({name})", t, o,
                           dict(extra, config={**cfg, **(c or {}), "splits": n}))
            for n in (int(v) for v in filter(None, args.splits.split(","))):
                for fold in (True, False):
                    o = torch.full_like(b["q"], float("nan"))
                    def fn(call=call, o=o, n=n, fold=fold):
                        return dllm_extend_attention(*call, out=o, num_splits=n,
                                                     fold_merge=fold)

                    fn()
                    t, extra = timed(fn, graph=True, kv_fn=lambda k, v, q=b["q"], rest=rest,
                                     o=o, n=n, fold=fold: dllm_extend_attention(
                                         q, k, v, *rest, out=o, num_splits=n, fold_merge=fold))
                    record(f"triton, {n} splits{'' if fold else ', merge launch'}", t, o,
                           dict(extra, config=cfg))
                    if n == 1:
                        break
            if args.sweep and str(rows) in args.sweep_rows.split(","):
                best = None
                splits = [int(n) for n in args.sweep_splits.split(",")]
                space = (LARGE_SWEEP if args.sweep_space == "large"
                         else SWEEP if splits == [1] else SPLIT_SWEEP)
                tallest = max(16, triton.next_power_of_2(block * h // hkv))
                # (SWEEP's entries keep the default tile's BLOCK_M)
                space = [c for c in space if c.get("BLOCK_M", 0) <= tallest]
                for c, n in ((c, n) for n in splits for c in space):
                    try:
                        o = torch.full_like(b["q"], float("nan"))
                        dllm_extend_attention(*call, out=o, config=c, num_splits=n)
                        if splits == [1] and args.sweep_space == "auto":
                            us = bench(lambda call=call, o=o, c=c, n=n: dllm_extend_attention(
                                *call, out=o, config=c, num_splits=n))
                        else:  # few rows: the launch's latency, timed as a step runs it
                            us = hbm_us(lambda k, v, q=b["q"], rest=rest, o=o, c=c, n=n:
                                        dllm_extend_attention(q, k, v, *rest, out=o,
                                                              config=c, num_splits=n))
                    except Exception as e:  # out of shared memory, say
                        print(f"{model} rows {rows} {c}: {type(e).__name__}: {e}"[:300])
                        continue
                    row = record("triton sweep", us, o, dict(config={**cfg, **c, "splits": n}))
                    if best is None or us < best["us"]:
                        best = row
                if best is not None:
                    results.append(dict(best, impl="triton (best of sweep)"))
            if use_fi:
                try:
                    for name, (fn, checked) in flashinfer_forms(b, h, hkv, d, scale).items():
                        o = checked() if checked is not None else None
                        us, extra = timed(fn)
                        record(name, us, o, extra)
                except Exception as e:
                    print(f"flashinfer failed on {model} rows {rows}: {type(e).__name__}: {e}")
            del b, call, ref
            torch.cuda.empty_cache()

    head = ("| model | rows | block | mean keys | KV MB | impl | µs | GB/s | × KV floor | "
            "µs, do_bench | graph replay µs | graph over KV copies µs | max err | config |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    shown = [r for r in results if r["impl"] != "triton sweep"]
    md = head + "".join(
        f"| {r['model']} | {r['rows']} | {r['block']} | {r['mean_keys']:.0f} | "
        f"{r['kv_mb']:.1f} | {r['impl']} | "
        f"{r['us']:.1f} | {r['gb_s']:.0f} | {r['us'] / r['floor_us']:.2f} | "
        f"{r.get('zeroed_l2_us', float('nan')):.1f} | "
        f"{r.get('graph_replay_us', float('nan')):.1f} | "
        f"{r.get('hbm_graph_us', float('nan')):.1f} | "
        f"{_err(r['max_err'])} | "
        f"{r.get('config', '')} |\n" for r in shown)
    print(md)
    if failures:
        print(f"ACCURACY FAILURES: {len(failures)}")
        for r in failures:
            print(r)
    when = stamp()
    write_report(args.out, "triton-attn",
                 f"# Triton DLLM_EXTEND attention, {when}\n\n{json.dumps(env)}\n\n"
                 f"`{' '.join(sys.argv)}`\n\n{md}",
                 dict(env=env, argv=sys.argv, results=results), when)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
