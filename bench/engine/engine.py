"""Offline engine benchmark for any checkpoint, batch size and algorithm (CPU or GPU):
requests/s, output tokens/s, tokens per forward and forwards per block.

    python -m dllm.testing SDARForCausalLM /tmp/tiny-sdar
    python bench/engine/engine.py --model /tmp/tiny-sdar --batch-size 1,16 --algorithm threshold
    python bench/engine/engine.py --shape sdar-8b --batch-size 1 --prompt-len 128 \
        --max-new-tokens 256 --algorithm low_confidence_static \
        --algorithm-config '{"steps_per_block": 4}' --merged-commit on,off   # GPU

``--shape`` takes a random-weight model of a real shape (``bench/engine/offline.py``'s names,
bf16, ``load_format="dummy"``) instead of ``--model``. ``--merged-commit on,off`` runs each
case with the commit forward merged into the next block's first denoise step and with
separate commit forwards (``--disable-merged-commit``); ``forwards/block`` counts every
forward of a request (prefill included) over its blocks, ``commits/block`` the separate
commit forwards.

Every request gets the same prompt length and ``max_new_tokens`` with ``ignore_eos``; the
``--batch-size`` requests are submitted at once and run to completion (continuous batching
with ``max_running_requests`` = batch size). Prints a table and writes
``bench/results/engine-*.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/report.py
from report import stamp, write_report  # noqa: E402


def run(model: str | None, bs: int, algorithm: str, config: dict, prompt_len: int,
        max_new: int, device: str, seed: int, merged: bool = True, dummy: bool = False) -> dict:
    from dllm import LLM, SamplingParams

    extra = {"load_format": "dummy", "dtype": "bfloat16"} if dummy else {}
    llm = LLM(model, max_running_requests=bs, device=device, algorithm=algorithm,
              algorithm_config=config, seed=seed, merged_commit=merged, **extra)
    vocab = llm.engine.info.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(bs)]
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    denoise = sum(o.num_denoise_forwards for o in outs)
    blocks = sum(o.num_blocks for o in outs)
    commits = sum(o.num_commit_forwards for o in outs)
    return {"batch": bs, "algorithm": algorithm, "config": config, "merged_commit": merged,
            "seconds": dt, "commits_per_block": commits / max(blocks, 1),
            "requests_per_s": bs / dt, "output_tok_s": tokens / dt,
            "tokens_per_forward": tokens / max(sum(o.num_forward_passes for o in outs), 1),
            "tokens_per_denoise_forward": tokens / max(denoise, 1),
            "forwards_per_block": sum(o.num_forward_passes for o in outs) / max(blocks, 1),
            "engine_steps": llm.engine.step_count}


def table(rows: list[dict]) -> str:
    head = ("| batch | algorithm | merged commit | requests/s | output tok/s | tokens/forward | "
            "tokens/denoise forward | forwards/block | commits/block |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['batch']} | {r['algorithm']} {json.dumps(r['config'])} | "
        f"{'on' if r['merged_commit'] else 'off'} | "
        f"{r['requests_per_s']:.2f} | {r['output_tok_s']:.1f} | {r['tokens_per_forward']:.2f} | "
        f"{r['tokens_per_denoise_forward']:.2f} | {r['forwards_per_block']:.2f} | "
        f"{r['commits_per_block']:.2f} |\n"
        for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: built-in)")
    ap.add_argument("--shape", default=None,
                    help="a random-weight model of this shape instead (bench/engine/offline.py "
                         "names, e.g. sdar-8b; GPU)")
    ap.add_argument("--merged-commit", default="on",
                    help="on, off or on,off: commit forwards merged into the next block's "
                         "first denoise step, or separate")
    ap.add_argument("--batch-size", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--algorithm", default="threshold")
    ap.add_argument("--algorithm-config", type=json.loads, default={})
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    merged = [{"on": True, "off": False}[m.strip()] for m in args.merged_commit.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.shape is not None:
            from offline import checkpoint_dir

            model = checkpoint_dir(args.shape, Path(tmp))
        rows = [run(model, int(bs), args.algorithm, args.algorithm_config, args.prompt_len,
                    args.max_new_tokens, args.device, args.seed, m, args.shape is not None)
                for bs in args.batch_size.split(",") for m in merged]
    text = table(rows)
    print(text)
    meta = {"model": args.shape or args.model or "built-in", "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
            "device": args.device, "threads": torch.get_num_threads()}
    when = stamp()
    write_report(args.out, "engine",
                 f"# Engine benchmark {when}\n\n{json.dumps(meta)}\n\n{text}",
                 {"meta": meta, "rows": rows}, when)
    return 0


if __name__ == "__main__":
    sys.exit(main())
