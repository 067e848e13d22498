"""Full-attention diffusion (LLaDA, Dream) on one GPU: whole requests in each cache mode, and
what each forward costs next to its floor, measured in the same run.

    python bench/engine/full_attention.py --models llada-8b,dream-7b \\
        --modes dual,prefix,exact --batch-sizes 1,8

Random weights of the released configs' sizes (``load_format="dummy"``, bf16), ``--batch-size``
prompts of ``--prompt-len`` random ids submitted at once, ``--gen-len`` new tokens each with
no stop, blocks of ``--block``, one token a step (``dllm.steps`` = the generation length; the
family's default rule: LLaDA ``low_confidence_static``, Dream ``entropy``), CUDA graphs and
the overlap schedule (the CUDA defaults). One warm-up request batch first (it also captures
the windows' graphs on first use), then one timed.

Columns:

* ``wall s`` / ``tok/s``: the timed batch, prefill included, as a user sees it;
  ``forwards``: forwards a request took.
* ``cached step ms``: the median engine step of the block's later forwards (dual: the block
  of B tokens over the cached prefix and suffix; prefix: the block and the suffix over the
  cached prefix; absent in exact mode), and ``refresh step ms`` the median step of the
  whole-canvas forwards (exact: every step; cached modes: each block's first). Under the
  overlap schedule a step returns once the step before it is read, so a step's time is
  counted for the forward launched one step earlier.
* ``window replay ms``: the captured graph of a block's window alone (its GPU time, the
  unmasking step included; the greedy graph, the one these requests replay), and ``canvas
  replay ms`` that of the whole canvas. The prefix cache's later windows (the block and the
  suffix, 64 to 352 tokens here) are compared with the block window's floor there, which
  understates theirs; the last column sums every cached forward's time over the floor of
  its own window (rows x tokens); a second table lists the cached forwards by window width,
  each against its own floor.
* Floors, for the forward each column is about: every weight read once at the measured copy
  bandwidth (the input embedding is a lookup: only the rows of the step's tokens), and the
  FLOPs (the projections over every query token, the LM head over the block's tokens only,
  attention over the canvas) at the sustained bf16 matmul rate (``bench/report.py``).

Writes ``bench/results/full-attention-<stamp>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

from bench.report import (  # noqa: E402
    apply_skinny_rows,
    environment,
    measure_ceilings,
    replay_us,
    require_cuda,
    skinny_rows_option,
    stamp,
    write_report,
)

FAMILY = {"llada-8b": "llada", "dream-7b": "dream"}


def checkpoint(shape: str, root: Path) -> str:
    from bench.engine.side_by_side import checkpoint as released_checkpoint

    return released_checkpoint(FAMILY[shape], shape, root)


def costs(model: torch.nn.Module, rows: int, query: int, block: int, canvas: int
          ) -> tuple[float, float]:
    """(bytes, FLOPs) of one forward of ``rows`` rows of ``query`` tokens each over a canvas
    of ``canvas`` keys, logits for ``block`` positions a row."""
    embed = model.model.embed_tokens.weight
    head = embed if model.lm_head is None else model.lm_head.weight
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    total = sum(size(p) for p in model.parameters())
    tokens = rows * query
    if model.lm_head is not None:  # the input embedding is a lookup: the step's rows only
        total -= size(embed) - tokens * embed.shape[1] * embed.element_size()
    body = sum(p.numel() for p in model.parameters()) - embed.numel() - (
        0 if model.lm_head is None else head.numel())
    spec = model.attn_spec
    layers = len(model.model.layers)
    attn = 4 * tokens * canvas * spec.num_heads * spec.head_dim * layers
    flops = 2 * body * tokens + 2 * head.numel() * rows * block + attn
    return float(total), float(flops)


def run_case(shape: str, path: str, mode: str, bs: int, graph: bool, args, ceilings) -> dict:
    from dllm import LLM, SamplingParams
    from dllm.denoise import GRAPH_FLAGS

    llm = LLM(path, load_format="dummy", dtype="bfloat16", device="cuda",
              max_running_requests=bs, context_length=4096, kv_cache_memory_gb=20,
              disable_cuda_graph=not graph)
    e = llm.engine
    vocab = e.model.model.embed_tokens.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, min(vocab, 30000), (2, bs, args.prompt_len), generator=g)
    params = SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True,
                            dllm={"block_size": args.block, "steps": args.gen_len,
                                  "cache_mode": mode})
    llm.generate(prompts[0].tolist(), params)  # warm-up: graphs captured on first use
    launched: list[list[tuple[int, int]]] = []
    forward = e.runner.forward

    def recording(batch, post=None):
        launched[-1].append((batch.batch_size, max(batch.extend_lens)))
        return forward(batch, post)

    e.runner.forward = recording
    reqs = [e.make_request(p, params) for p in prompts[1].tolist()]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for r in reqs:
        e.add_request(r)
    steps: list[float] = []
    while any(not r.finished for r in reqs):
        launched.append([])
        t = time.perf_counter()
        e.step()
        steps.append(time.perf_counter() - t)
    e.drain()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    e.runner.forward = forward
    canvas = args.prompt_len + args.gen_len
    if args.profile:
        profile_kernels(e, prompts[1].tolist(), params, f"{shape} {mode} bs={bs}",
                        args.profile_top)
    if args.profile_windows:
        profile_windows(e.runner.runners[0], bs, args.prompt_len + args.gen_len,
                        f"{shape} {mode} bs={bs}", args.profile_top)
    bw, mm = ceilings["hbm_bytes_per_s"], ceilings["bf16_flops_per_s"]

    # A step's time is the forward launched a step earlier (overlap: it waits for that one).
    # The cached forwards by window (rows, tokens): prefix's shrink block by block.
    cached, refresh = [], []
    by_width: dict[tuple[int, int], list[float]] = {}
    for i in range(1, len(steps)):
        for rows, width in launched[i - 1]:
            (refresh if width == canvas else cached).append(steps[i] * 1e3)
            if width != canvas:
                by_width.setdefault((rows, width), []).append(steps[i] * 1e3)
    windows = []
    for (rows, width), ms in sorted(by_width.items()):
        nbytes, flops = costs(e.model, rows, width, args.block, canvas)
        floor = max(nbytes / bw, flops / mm) * 1e3
        windows.append(dict(rows=rows, width=width, forwards=len(ms),
                            step_ms=statistics.median(ms), floor_ms=floor,
                            weight_floor_ms=nbytes / bw * 1e3,
                            compute_floor_ms=flops / mm * 1e3,
                            x_floor=statistics.median(ms) / floor))
    cached_floors = [w["floor_ms"] for w in windows for _ in range(w["forwards"])]
    runner = e.runner.runners[0]
    replay = {}
    for (rows, width, key), g in getattr(runner, "graphs", {}).items():
        # the graphs the greedy requests replayed (``key[1]``: the sampling flags; the
        # sampling graph of the same shape also runs the draw's vocabulary passes)
        if rows == bs and width in (args.block, canvas) and key[1] == GRAPH_FLAGS[0]:
            replay[width] = replay_us(g.graph) / 1e3
    win_bytes, win_flops = costs(e.model, bs, args.block, args.block, canvas)
    can_bytes, can_flops = costs(e.model, bs, canvas, args.block, canvas)
    win_floor = max(win_bytes / bw, win_flops / mm) * 1e3
    can_floor = max(can_bytes / bw, can_flops / mm) * 1e3
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    row = dict(model=shape, mode=mode, batch=bs, runner="cuda_graph" if graph else "eager",
               wall_s=wall, tok_s=bs * args.gen_len / wall,
               forwards=statistics.mean(r.num_forward_passes for r in reqs),
               cached_step_ms=med(cached), refresh_step_ms=med(refresh),
               window_replay_ms=replay.get(args.block, float("nan")),
               canvas_replay_ms=replay.get(canvas, float("nan")),
               window_floor_ms=win_floor, window_weight_floor_ms=win_bytes / bw * 1e3,
               canvas_floor_ms=can_floor, canvas_compute_floor_ms=can_flops / mm * 1e3,
               graphs=len(getattr(runner, "graphs", {})), windows=windows)
    row["x_window_floor"] = row["cached_step_ms"] / win_floor
    # every cached forward against the floor of its own window (prefix: the block and the
    # suffix, shrinking block by block; dual: the block), summed over the request
    row["cached_floor_ms"] = med(cached_floors)
    row["x_cached_floors"] = (sum(cached) / sum(cached_floors) if cached_floors
                              else float("nan"))
    row["x_canvas_floor"] = row["refresh_step_ms"] / can_floor
    del llm, e, runner
    gc.collect()
    torch.cuda.empty_cache()
    return row


def profile_kernels(e, prompts: list[list[int]], params, label: str, top: int = 25) -> None:
    """One more request batch under ``torch.profiler`` (not timed): prints the kernels by GPU
    time per forward, with launches per forward."""
    from torch.profiler import ProfilerActivity, profile

    reqs = [e.make_request(p, params) for p in prompts]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for r in reqs:
            e.add_request(r)
        while any(not r.finished for r in reqs):
            e.step()
        e.drain()
        torch.cuda.synchronize()
    forwards = statistics.mean(r.num_forward_passes for r in reqs)
    print_kernels(prof, forwards, "forward", f"{label}: {{ms:.3f}} ms of kernels a forward "
                  f"({forwards:.0f} forwards)", top)


def print_kernels(prof, per: float, unit: str, title: str, top: int) -> None:
    """A profile's kernels by GPU time, ``per`` ``unit`` (a forward, a replay): the ``top``
    ones and a row summing the rest, under ``title`` (``{ms}``: the total a ``unit``)."""
    events = [(getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0),
               ev.count, ev.key) for ev in prof.key_averages()]
    events = sorted((ev for ev in events if ev[0] > 0), reverse=True)
    total = sum(us for us, _, _ in events) / per
    print(f"\n{title.format(ms=total / 1e3)}\n| µs/{unit} | launches/{unit} | kernel |\n"
          "|---|---|---|")
    for us, count, key in events[:top]:
        print(f"| {us / per:.1f} | {count / per:.2f} | {key[:110]} |")
    rest = events[top:]
    if rest:
        print(f"| {sum(us for us, _, _ in rest) / per:.1f} | "
              f"{sum(c for _, c, _ in rest) / per:.2f} | the other {len(rest)} kernels |")
    print(flush=True)


def profile_windows(runner, bs: int, canvas: int, label: str, top: int, replays: int = 5
                    ) -> None:
    """Each captured window graph of the greedy requests (rows = ``bs``), replayed under
    ``torch.profiler``: its kernels by GPU time a replay (the windows' own breakdowns, which
    ``--profile``'s request-wide average mixes)."""
    from torch.profiler import ProfilerActivity, profile

    from dllm.denoise import GRAPH_FLAGS

    graphs = sorted(((width, g) for (rows, width, key), g in getattr(runner, "graphs", {}).items()
                     if rows == bs and key[1] == GRAPH_FLAGS[0]), key=lambda wg: wg[0])
    for width, g in graphs:
        g.graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                g.graph.replay()
            torch.cuda.synchronize()
        what = "canvas" if width == canvas else "window"
        print_kernels(prof, replays, "replay", f"{label}, {what} of {width} tokens: {{ms:.3f}} "
                      f"ms of kernels a replay (replay {replay_us(g.graph) / 1e3:.3f} ms)", top)


def table(rows: list[dict]) -> str:
    head = ("| model | mode | batch | runner | wall s | tok/s | forwards | cached step ms | "
            "window replay ms | window floor ms | × floor | refresh step ms | "
            "canvas replay ms | canvas floor ms | × floor | graphs | "
            "cached steps ÷ their windows' floors |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['model']} | {r['mode']} | {r['batch']} | {r['runner']} | {r['wall_s']:.3f} | "
        f"{r['tok_s']:.1f} | {r['forwards']:.0f} | {r['cached_step_ms']:.2f} | "
        f"{r['window_replay_ms']:.2f} | {r['window_floor_ms']:.2f} | "
        f"{r['x_window_floor']:.2f} | {r['refresh_step_ms']:.2f} | "
        f"{r['canvas_replay_ms']:.2f} | {r['canvas_floor_ms']:.2f} | "
        f"{r['x_canvas_floor']:.2f} | {r['graphs']} | {r['x_cached_floors']:.2f} |\n"
        for r in rows)


def window_table(rows: list[dict]) -> str:
    """The cached forwards of each case by window width: median step against that window's
    floor (the larger of the weight read and the FLOPs)."""
    head = ("| model | mode | batch | rows | window tokens | forwards | median step ms | "
            "weight floor ms | compute floor ms | × floor |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['model']} | {r['mode']} | {r['batch']} | {w['rows']} | {w['width']} | "
        f"{w['forwards']} | "
        f"{w['step_ms']:.2f} | {w['weight_floor_ms']:.2f} | {w['compute_floor_ms']:.2f} | "
        f"{w['x_floor']:.2f} |\n" for r in rows for w in r.get("windows", []))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llada-8b,dream-7b")
    ap.add_argument("--modes", default="dual,prefix,exact")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--runners", default="cuda_graph",
                    help="cuda_graph and/or eager (the same padded steps, not captured)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--profile", action="store_true",
                    help="after each case, one more batch under torch.profiler: kernels a forward")
    ap.add_argument("--profile-windows", action="store_true",
                    help="after each case, every captured window graph replayed under "
                         "torch.profiler: kernels a replay, window by window")
    ap.add_argument("--profile-top", type=int, default=25,
                    help="kernels listed by --profile and --profile-windows")
    skinny_rows_option(ap)
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    apply_skinny_rows(args.skinny_max_rows)
    ceilings = measure_ceilings()
    env = {**environment(), **ceilings, "args": vars(args)}
    print(json.dumps(env), flush=True)
    rows: list[dict] = []
    when = stamp()
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.models.split(","):
            path = checkpoint(shape, Path(tmp))
            for mode in args.modes.split(","):
                for runner in args.runners.split(","):
                    for bs in map(int, args.batch_sizes.split(",")):
                        try:
                            row = run_case(shape, path, mode, bs, runner == "cuda_graph", args,
                                           ceilings)
                        except Exception as exc:  # noqa: BLE001 - report and go on
                            print(f"{shape} {mode} bs={bs} {runner}: {exc!r}", flush=True)
                            continue
                        rows.append(row)
                        print(table([row]).splitlines()[-1], flush=True)
                        write_report(args.out, "full-attention",
                                     f"# Full-attention diffusion {when}\n\n{json.dumps(env)}"
                                     f"\n\n{table(rows)}\n{window_table(rows)}",
                                     {"env": env, "rows": rows}, when)
    print(table(rows))
    print(window_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
