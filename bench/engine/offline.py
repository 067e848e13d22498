"""Offline speed on one GPU: per-step latency and output tokens/s of random-weight models of
real shapes, next to the roofline of each case, measured in the same run.

    python bench/engine/offline.py --models sdar-8b,qwen3-8b --batch-sizes 1,8,32,128

Block-diffusion models run ``low_confidence_static`` with one token per denoise step (a fixed
schedule, so the figures do not depend on random-weight confidences); a step is one
``DLLM_EXTEND`` forward of ``bs × block_size`` tokens with the unmasking step. Autoregressive
models run ``DECODE`` steps (hybrids too: ``granite-h-*``; ``granite-h-*-bd`` are the same
shapes as block-diffusion hybrids). Weights are random (``load_format="dummy"``), built on the GPU.

Each case times the same warm engine twice: the plain host loop (each step's result read
before the next step is queued) and the overlapped one (the default on CUDA), in its steady
state (from the return of one step to that of the N-th after it: each returns once the step
before it is read); ``step ms`` and the ratios are the overlapped loop's.

Floors: weight bytes read per step (for hybrids plus each row's recurrent state, read and
written once) ÷ measured HBM bandwidth (a device-to-device copy), and
FLOPs per step ÷ measured bf16 matmul rate (8192³). The matmul rate is the sustained one
(back to back for 3 s: the GPU's power cap lowers the SM clock under a steady load, and the
timed steps run in that state; ``SM MHz`` is the clock read during them, nan where they ended
before nvidia-smi answered); the ratio to the burst rate (the first 10 matmuls of a cool GPU,
at its boost clock) is printed beside it. MoE weight floors count every expert the step's
tokens could reach (``min(E, tokens x k)``); with ``--count-experts`` an eager run of the same
workload counts the distinct experts each MoE layer's forward actually routes to, and
``reached floor`` reads only those. Graphs are captured as the engine's defaults do (up to
two rows a request: a merged commit runs the resolved block and the next one as two rows); a
graph case any of whose timed forwards ran eagerly (a shape not captured, e.g. out of memory)
is reported as failed, not timed.
Writes ``bench/results/offline-*.md`` and ``.json`` with the GPU name, driver, torch and
flashinfer versions.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import (  # noqa: E402
    ClockRead,
    apply_skinny_rows,
    environment,
    measure_ceilings,
    require_cuda,
    skinny_rows_option,
    stamp,
    write_report,
)


def _granite_h(**shape) -> dict:
    """A Granite 4.0-H layout of 40 layers with attention at 5, 15, 25 and 35."""
    return dict(num_hidden_layers=40, head_dim=shape["hidden_size"] // shape[
        "num_attention_heads"], layer_types=["attention" if i % 10 == 5 else "mamba"
                                            for i in range(40)],
                mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
                mamba_expand=2, mamba_chunk_size=256, vocab_size=100352,
                tie_word_embeddings=True, position_embedding_type="nope",
                embedding_multiplier=12.0, residual_multiplier=0.22,
                attention_multiplier=shape["num_attention_heads"] / shape["hidden_size"],
                **shape)  # 1 / head_dim, as released


GRANITE_H_TINY = dict(hidden_size=1536, num_attention_heads=12, num_key_value_heads=4,
                      mamba_n_heads=48, num_local_experts=64, num_experts_per_tok=6,
                      intermediate_size=512, shared_intermediate_size=1024, logits_scaling=6.0)
GRANITE_H_MICRO = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                       mamba_n_heads=64, num_local_experts=0, num_experts_per_tok=0,
                       intermediate_size=8192, shared_intermediate_size=8192,
                       logits_scaling=8.0)

# Real configs' shapes (config.json keys), the tokenizer comes from the factory.
SHAPES = {
    "sdar-4b": ("SDARForCausalLM", dict(hidden_size=2560, intermediate_size=9728,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, tie_word_embeddings=True, block_size=4)),
    "sdar-8b": ("SDARForCausalLM", dict(hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, tie_word_embeddings=False, block_size=4)),
    "qwen3-8b": ("Qwen3ForCausalLM", dict(hidden_size=4096, intermediate_size=12288,
                 num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936, tie_word_embeddings=False)),
    "llada2-mini": ("LLaDA2MoeModelLM", dict(hidden_size=2048, intermediate_size=5120,
                    moe_intermediate_size=512, num_hidden_layers=20, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=128, vocab_size=157184, num_experts=256,
                    num_experts_per_tok=8, num_shared_experts=1, n_group=8, topk_group=4,
                    first_k_dense_replace=1, block_size=32)),
    # ibm-granite/granite-4.0-h-tiny as publicly quoted (7B, ~1B active): 40 layers, 4 of them
    # NoPE attention, 36 Mamba2 (48 heads of 64, state 128, one group), 64 experts top-6 of
    # 512 beside a 1024 shared MLP in every layer, tied 100k vocabulary. Its MoE layers run
    # eagerly (no graph runner for them). "-bd": the same shape as a block-diffusion hybrid
    # (``GraniteMoeHybridForBlockDiffusion``, block 4), a denoise step per timed step.
    "granite-h-tiny": ("GraniteMoeHybridForCausalLM", _granite_h(**GRANITE_H_TINY)),
    "granite-h-tiny-bd": ("GraniteMoeHybridForBlockDiffusion",
                          _granite_h(**GRANITE_H_TINY, block_size=4)),
    # ibm-granite/granite-4.0-h-micro (3B dense: shared MLP only), captured in CUDA graphs.
    "granite-h-micro": ("GraniteMoeHybridForCausalLM", _granite_h(**GRANITE_H_MICRO)),
    "granite-h-micro-bd": ("GraniteMoeHybridForBlockDiffusion",
                           _granite_h(**GRANITE_H_MICRO, block_size=4)),
}


def checkpoint_dir(name: str, root: Path) -> str:
    from dllm.testing import make_tiny_checkpoint

    arch, shape = SHAPES[name]
    path = root / name
    make_tiny_checkpoint(arch, path)  # tokenizer files; config.json rewritten below
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(shape, torch_dtype="bfloat16", max_position_embeddings=32768)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").unlink()
    return str(path)


def step_costs(model: torch.nn.Module, tokens: int, ctx: int, cfg: dict,
               rows: int = 0, reached: float | None = None) -> tuple[float, float]:
    """(bytes read and written, FLOPs) of one forward over ``tokens`` query tokens of ``rows``
    requests at context ``ctx``. An untied input embedding is a lookup: only ``tokens`` of its
    rows are read and it does no matrix work. MoE: only the experts the tokens can reach are
    read (``reached``: the experts a layer's forward was measured to route to, on average),
    and FLOPs count the ``k`` active ones per token. Hybrids: each row's recurrent state
    (conv window and fp32 SSM state of every Mamba2 layer) is read and written once per
    forward, and the SSM's own FLOPs are left out (small beside the projections)."""
    from dllm.models.granite_hybrid import StackedWeight
    from dllm.models.mamba2 import Mamba2Mixer

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:  # untied: the head is the matmul
        embed = model.model.embed_tokens.weight
        total -= (embed.shape[0] - tokens) * embed.shape[1] * embed.element_size()
        params -= embed.numel()
    if "num_experts" in cfg:
        e, k = cfg["num_experts"], cfg["num_experts_per_tok"]
        expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
        moe_layers = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
        touched = min(e, tokens * k) if reached is None else reached
        total -= moe_layers * (e - touched) * expert * 2
        params -= moe_layers * (e - k) * expert  # FLOPs use the k active experts per token
    for m in model.modules():
        if isinstance(m, StackedWeight):  # Granite-H experts [E, out, in]
            w = m.weight
            e, k = w.shape[0], cfg["num_experts_per_tok"]
            per = w[0].numel()
            total -= (e - min(e, tokens * k)) * per * w.element_size()
            params -= (e - k) * per
        if isinstance(m, Mamba2Mixer):
            d = m.dims
            state = (d.conv_kernel - 1) * d.conv_dim * 2 + d.num_heads * d.head_dim * d.d_state * 4
            total += 2 * rows * state
    attn_layers = sum(1 for t in cfg.get("layer_types", ["attention"] * cfg[
        "num_hidden_layers"]) if t == "attention")
    attn = 4 * tokens * ctx * cfg["num_attention_heads"] * cfg["head_dim"] * attn_layers
    return float(total), float(2 * params * tokens + attn)


def warm_engine(path: str, bs: int, graph: bool, backend: str, prompt_len: int, steps: int):
    """An ``LLM`` with ``bs`` requests past their prefill and 3 warm-up steps, with room for
    ``steps`` more steps each (``ignore_eos``, one token per denoise step)."""
    from dllm import LLM, SamplingParams

    llm = LLM(path, load_format="dummy", dtype="bfloat16", device="cuda",
              attention_backend=backend, disable_cuda_graph=not graph,
              max_running_requests=bs, context_length=4096,
              algorithm="low_confidence_static", page_size=16, kv_cache_memory_gb=20,
              enable_prefix_cache=False)  # its hybrid state snapshots would take slots
    e = llm.engine
    diffusion = e.mask_token_id is not None
    b = e.block_size
    g = torch.Generator().manual_seed(0)
    # Room for ``steps`` steps after the warm-up, and for the tokens an early request decodes
    # while the later prompts are prefilled (one prefill chunk per step).
    chunks = -(-bs * prompt_len // e.config.max_prefill_tokens)
    params = SamplingParams(max_new_tokens=steps * (b if diffusion else 1) + 2 * b + 8 + chunks,
                            ignore_eos=True, dllm={"steps_per_block": b} if diffusion else {})
    reqs = [e.make_request(torch.randint(100, 30000, (prompt_len,), generator=g).tolist(),
                           params) for _ in range(bs)]
    for r in reqs:
        e.add_request(r)
    while any(r.needs_prefill or r.req_pool_idx is None for r in reqs):
        e.step()
        failed = [r.error for r in reqs if r.finished]
        if failed:
            raise RuntimeError(f"a request ended during prefill: {failed[0]}")
    for _ in range(3):  # warm-up steps
        e.step()
    return llm


def reached_experts(path: str, bs: int, backend: str, prompt_len: int, steps: int) -> float:
    """The distinct experts a MoE layer's forward routes its tokens to, averaged over the
    layers and ``steps`` steps of the same workload run eagerly (the routing read back from
    the device: a captured graph cannot report it)."""
    from dllm.models.ops import UsesOps

    llm = warm_engine(path, bs, False, backend, prompt_len, steps)
    e = llm.engine
    ops = next(m.ops for m in e.model.modules() if isinstance(m, UsesOps))
    inner, counts = ops.moe_experts, []

    def counting(experts, x, topk_ids, topk_weights):
        counts.append(int(torch.unique(topk_ids).numel()))
        return inner(experts, x, topk_ids, topk_weights)

    ops.moe_experts = counting
    try:
        for _ in range(steps):
            e.step()
        e.drain()
    finally:
        del ops.moe_experts
    del llm, e
    gc.collect()
    torch.cuda.empty_cache()
    return sum(counts) / max(1, len(counts))


def bench_case(name: str, path: str, bs: int, graph: bool, backend: str, prompt_len: int,
               steps: int, ceilings: dict, count_experts: bool = False) -> dict:
    arch, shape = SHAPES[name]
    # counted first, on an engine of its own (freed before the timed one is built)
    reached = (reached_experts(path, bs, backend, prompt_len, steps)
               if count_experts and "num_experts" in shape else None)
    llm = warm_engine(path, bs, graph, backend, prompt_len, 2 * steps)
    e = llm.engine
    diffusion = e.mask_token_id is not None
    b = e.block_size
    per_req = 2 * steps * (b if diffusion else 1) + 2 * b
    # The same warm engine, the host loop plain then overlapped (``Engine.overlap``).
    walls = {}
    counts = e.runner.forward_counts.copy()
    for overlap in (False, True):
        e.drain()
        e.overlap = overlap
        torch.cuda.synchronize()
        if overlap:
            # The SM clock, sampled while the steps run: kept only if nvidia-smi answered
            # before they ended (a short loop ends first: then NaN, not an idle GPU's clock).
            clock = ClockRead()
            # The steady state: an overlapped step returns once the step before it is read,
            # so the clock runs from one such return to the ``steps``-th after it (the
            # pipeline's fill, one step's host work, is not counted).
            e.step()
            e.step()
        t = time.perf_counter()
        for _ in range(steps):
            e.step()
        if not overlap:
            torch.cuda.synchronize()
        walls[overlap] = (time.perf_counter() - t) / steps
    in_time = clock.finished()
    e.drain()
    sm_mhz = clock.mhz() if in_time else float("nan")
    # Every timed forward a graph replay, merged commits (two rows a request) included: a
    # shape not captured (out of memory, or above --cuda-graph-max-bs) would time the eager
    # runner's Python launches instead.
    eager = sum(n for (name, _), n in (e.runner.forward_counts - counts).items()
                if name == "eager")
    if graph and eager:
        raise RuntimeError(f"batch {bs}: {eager} of the timed forwards ran eagerly (a shape "
                           "not captured)")
    if len(e.scheduler.running) != bs:
        raise RuntimeError("a request ended inside the timed steps")
    dt = walls[True]
    # The replay of a step of bs rows, and of one where every request's commit half rides
    # (2·bs rows), on the device alone.
    replay_ms = _replay_ms(e, bs) if graph else float("nan")
    sizes = list(e.runner.runners[0].sizes) if graph else []  # captured (an OOM drops some)
    merged_ms = (_replay_ms(e, 2 * bs) if graph and diffusion and e.merged_commit
                 else float("nan"))
    # Query tokens a step, on average: with merged commits a block's b steps carry b + 1
    # blocks of tokens (its commit half rides in the next block's first step).
    tokens = bs * ((b + 1 if e.merged_commit else b) if diffusion else 1)
    byts, flops = step_costs(e.model, tokens, prompt_len + per_req // 2, shape, bs)
    reached_bytes = (step_costs(e.model, tokens, prompt_len + per_req // 2, shape, bs,
                                reached)[0] if reached is not None else float("nan"))
    # One token per denoise step: b tokens per b steps with merged commits (a block's commit
    # rides in the next block's first step), per b + 1 with a commit forward of its own.
    per_block = b if e.merged_commit else b + 1
    out_tok = bs * (b / per_block if diffusion else 1.0) / dt
    floor_bw = byts / ceilings["hbm_bytes_per_s"]
    floor_mm = flops / ceilings["bf16_flops_per_s"]
    del llm, e
    gc.collect()  # the engine holds reference cycles: free its KV cache before the next case
    torch.cuda.empty_cache()
    return dict(model=name, arch=arch, batch=bs, runner="cuda_graph" if graph else "eager",
                backend=backend, step_ms=dt * 1e3, plain_step_ms=walls[False] * 1e3,
                output_tok_s=out_tok,
                weight_read_floor_ms=floor_bw * 1e3, matmul_floor_ms=floor_mm * 1e3,
                x_weight_floor=dt / floor_bw, x_matmul_floor=dt / floor_mm,
                x_matmul_floor_burst=dt / (flops / ceilings["bf16_flops_per_s_burst"]),
                sm_mhz=sm_mhz,
                tokens_per_step=tokens, graph_replay_ms=replay_ms, merged_replay_ms=merged_ms,
                graph_sizes=sizes,
                reached_experts=reached if reached is not None else float("nan"),
                reached_floor_ms=reached_bytes / ceilings["hbm_bytes_per_s"] * 1e3,
                x_reached_floor=dt / (reached_bytes / ceilings["hbm_bytes_per_s"]))


def _replay_ms(engine, rows: int) -> float:
    """GPU time of the captured step of ``rows`` rows alone (the graph of the last replayed
    step's window and key, at the size ``rows`` pads to; nan if none), without the host work
    around it (scheduling, registry copies, FlashInfer planning, the result read)."""
    graphs = engine.runner.runners[0]
    last = getattr(graphs, "last_replayed", None)
    i = bisect.bisect_left(graphs.sizes, rows)
    if last is None or i == len(graphs.sizes):
        return float("nan")
    _, window, key = next(shape for shape, g in graphs.graphs.items() if g is last)
    g = graphs.graphs.get((graphs.sizes[i], window, key))
    if g is None:
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.graph.replay()
    start.record()
    for _ in range(20):
        g.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def table(rows: list[dict]) -> str:
    head = ("| model | batch | runner | attention | step ms | step ms, no overlap | "
            "graph replay ms | merged replay ms | out tok/s | "
            "weight floor ms | × weight floor | matmul floor ms | × matmul floor | "
            "× burst matmul floor | SM MHz | experts reached | reached floor ms | "
            "× reached floor |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['model']} | {r['batch']} | {r['runner']} | {r['backend']} | {r['step_ms']:.2f} | "
        f"{r.get('plain_step_ms', float('nan')):.2f} | "
        f"{r.get('graph_replay_ms', float('nan')):.2f} | "
        f"{r.get('merged_replay_ms', float('nan')):.2f} | "
        f"{r['output_tok_s']:.0f} | {r['weight_read_floor_ms']:.2f} | {r['x_weight_floor']:.2f} "
        f"| {r['matmul_floor_ms']:.2f} | {r['x_matmul_floor']:.2f} | "
        f"{r.get('x_matmul_floor_burst', float('nan')):.2f} | {r.get('sm_mhz', float('nan')):.0f} | "
        f"{r.get('reached_experts', float('nan')):.1f} | "
        f"{r.get('reached_floor_ms', float('nan')):.2f} | "
        f"{r.get('x_reached_floor', float('nan')):.2f} |\n"
        for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="sdar-8b,qwen3-8b,sdar-4b,llada2-mini")
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--runners", default="cuda_graph,eager")
    ap.add_argument("--backends", default="flashinfer")
    ap.add_argument("--eager-batch-sizes", default=None,
                    help="batch sizes for the eager runner (default: all)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--count-experts", action="store_true",
                    help="MoE models: count the experts a layer's forward reaches (an eager "
                         "run of the same workload first) and add the weight floor of those")
    ap.add_argument("--out", default="bench/results")
    skinny_rows_option(ap)
    args = ap.parse_args()
    if not require_cuda(__file__):
        return 2
    apply_skinny_rows(args.skinny_max_rows)
    ceilings = measure_ceilings()
    env = {**environment(), **ceilings, "args": vars(args)}
    print(json.dumps(env))
    from dllm.runner.kernels.settings import KernelSettings

    grouped_moe = KernelSettings.from_env().moe_grouped
    rows = []
    when = stamp()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = checkpoint_dir(name, Path(tmp))
            for backend in args.backends.split(","):
                for runner in args.runners.split(","):
                    sizes = args.batch_sizes if runner == "cuda_graph" or not \
                        args.eager_batch_sizes else args.eager_batch_sizes
                    for bs in map(int, sizes.split(",")):
                        if runner == "cuda_graph" and (backend != "flashinfer" or (
                                name == "llada2-mini" and not grouped_moe) or (
                                name.startswith("granite-h-tiny"))):
                            continue  # graphs need FlashInfer, MoE the grouped experts
                        try:
                            row = bench_case(name, path, bs, runner == "cuda_graph", backend,
                                             args.prompt_len, args.steps, ceilings,
                                             count_experts=args.count_experts)
                        except Exception as exc:  # noqa: BLE001 - report and go on
                            print(f"{name} bs={bs} {runner} {backend}: {exc!r}", flush=True)
                            continue
                        rows.append(row)
                        print(table([row]).splitlines()[-1], flush=True)
                        _write(args.out, when, env, rows)
    print(table(rows))
    return 0


def _write(out: str, when: str, env: dict, rows: list[dict]) -> None:
    write_report(out, "offline", f"# Offline benchmark {when}\n\n{json.dumps(env)}\n\n"
                 f"{table(rows)}", {"env": env, "rows": rows}, when)


if __name__ == "__main__":
    sys.exit(main())
