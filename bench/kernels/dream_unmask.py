"""Dream's greedy unmasking on one GPU: the fused proposal and confidences
(runner/kernels/dream_kernel.py) against the reference path (``dream_probs``, ``argmax``,
``neg_entropy``: float32 ``[positions, vocab]`` tensors), alone and inside the whole
``entropy`` step (the schedule, the ranking, the RNG and the writes around it; its reference
column runs the schedule on torch too, ``dream_schedule`` off), and the kernel's slicing and
width swept.

    python bench/kernels/dream_unmask.py --rows 32,256 [--sweep]

Logits: bf16, Dream's 152064-token vocabulary, ``3 · randn``. Times: the median replay of a
CUDA graph of the call (``bench/report.graph_us``; the logits stay in L2 between replays at
32 rows, as after the LM head in a step). Prints a markdown table; writes
``dream-unmask-*.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dllm.algorithms import dream, get_algorithm, vocab_parallel
from dllm.algorithms.base import DenoiseInput, SamplingTensors
from dllm.runner.kernels import dream_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import environment, graph_us, refused, require_cuda, stamp, write_report  # noqa: E402

VOCAB = 152064
SWEEP = [(s, b, w) for s in (8, 16, 32) for b in (1024, 2048, 4096) for w in (4, 8)]


def greedy(bs: int) -> SamplingTensors:
    z = torch.zeros(bs, device="cuda")
    return SamplingTensors(z, z.long(), z + 1, z.long(), may_sample=False, may_filter=False,
                           may_filter_any=False)


def reference(x: torch.Tensor):
    probs = dream.dream_probs(x, greedy(x.shape[0]))
    x0 = probs.argmax(dim=-1)
    return x0, vocab_parallel.neg_entropy(probs)


def step_input(logits: torch.Tensor) -> DenoiseInput:
    algo = get_algorithm("entropy")
    bs, block, _ = logits.shape
    tokens = torch.full((bs, block), VOCAB - 1, device="cuda")
    tokens[:, : block // 2] = 7  # half the block already written
    return DenoiseInput(
        logits=logits, tokens=tokens, editable=torch.ones_like(tokens, dtype=torch.bool),
        mask_id=VOCAB - 1, step=torch.full((bs,), 3, device="cuda"),
        num_initial_masks=torch.full((bs,), block, device="cuda"),
        positions=torch.arange(block, device="cuda").expand(bs, block), sampling=greedy(bs),
        config=algo.stack_configs([algo.validate({"steps": block}, block)] * bs, "cuda"),
        state=algo.init_state(bs, "cuda"))


def measure(rows: int, sweep: bool, algo, default: tuple[int, int, int]) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows // 32 or 1, min(rows, 32), VOCAB, generator=g,
                          device="cuda") * 3).bfloat16()
    ref_x0, ref_negent = reference(logits)
    row = {"rows": rows, "reference_us": graph_us(lambda: reference(logits))[0]}
    fused = dream_kernel.dream_greedy(logits, entropy=True)
    assert torch.equal(fused[0], ref_x0)
    torch.testing.assert_close(fused[2], ref_negent, rtol=1e-5, atol=5e-7)
    row["kernel_us"] = graph_us(lambda: dream_kernel.dream_greedy(logits, True))[0]
    x = step_input(logits)
    row["step_kernel_us"] = graph_us(lambda: algo.step(x).tokens)[0]
    saved = dream.kernel_module
    dream.kernel_module = lambda name: None  # the unmasking and the schedule on torch
    try:
        row["step_reference_us"] = graph_us(lambda: algo.step(x).tokens)[0]
    finally:
        dream.kernel_module = saved
    if sweep:
        row["sweep"] = {}
        for splits, block, warps in SWEEP:
            dream_kernel.SPLITS, dream_kernel.BLOCK, dream_kernel.NUM_WARPS = splits, block, warps
            try:
                row["sweep"][f"s{splits}b{block}w{warps}"] = graph_us(
                    lambda: dream_kernel.dream_greedy(logits, True))[0]
            except Exception as e:  # noqa: BLE001 (a refused configuration)
                refused(f"s{splits}b{block}w{warps}", e)
        dream_kernel.SPLITS, dream_kernel.BLOCK, dream_kernel.NUM_WARPS = default
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="32,256", help="positions (rows of 32: a batch of blocks)")
    ap.add_argument("--sweep", action="store_true", help="SPLITS x BLOCK x num_warps")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not require_cuda("dream_unmask.py"):
        return 0
    env = environment()
    algo = get_algorithm("entropy")
    rows_md, results = [], []
    default = (dream_kernel.SPLITS, dream_kernel.BLOCK, dream_kernel.NUM_WARPS)
    rows_list = [int(r) for r in args.rows.split(",")]
    if any(r < 1 or (r > 32 and r % 32) for r in rows_list):
        raise SystemExit("--rows: 1-32, or a multiple of 32 (blocks of 32 positions)")
    for rows in rows_list:
        row = measure(rows, args.sweep, algo, default)
        results.append(row)
        best = min(row.get("sweep", {}).items(), key=lambda kv: kv[1], default=("", float("nan")))
        rows_md.append(f"| {rows} | {row['reference_us']:.1f} | {row['kernel_us']:.1f} | "
                       f"{row['step_reference_us']:.1f} | {row['step_kernel_us']:.1f} | "
                       f"{best[0]} {best[1]:.1f} |")
        print(rows_md[-1], flush=True)
    md = ("| positions | reference µs | kernel µs | entropy step, reference µs | "
          "entropy step, kernel µs | sweep's best µs |\n|---|---|---|---|---|---|\n"
          + "\n".join(rows_md))
    print(md)
    when = stamp()
    path = write_report(args.out, "dream-unmask",
                        f"# Dream's greedy unmasking, {when}\n\n{json.dumps(env)}\n\n"
                        f"`{' '.join(sys.argv)}` (kernel: SPLITS {default[0]}, BLOCK "
                        f"{default[1]}, {default[2]} warps)\n\n{md}",
                        dict(env=env, argv=sys.argv, default=default, results=results), when)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
