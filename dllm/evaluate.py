"""``dllm eval``: exact-match accuracy on freshly generated task questions (``dllm.tasks``).

For each unmasking setting (``threshold`` at several τ, and ``low_confidence_static`` with one
token per step) every question is answered through ``LLM.chat`` and the reply, stripped, must
equal the answer string. Parallelism is reported as tokens per denoise forward (generated
tokens, the stop token included, over forwards that unmask tokens: commit forwards excluded)
and denoise forwards per block. Each setting runs twice: on questions phrased by the training
templates (``train``) and by templates training never saw (``held-out``), reported apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from dllm import tasks

DEFAULT_THRESHOLDS = (0.5, 0.7, 0.9, 0.95)


@dataclass
class SettingResult:
    name: str
    dllm: dict[str, Any]
    accuracy: dict[str, float]  # per family, plus "overall"
    tokens_per_forward: float  # over denoise forwards
    forwards_per_block: float  # denoise forwards
    tokens: int
    denoise_forwards: int
    blocks: int
    # Forwards that only committed a block (a merged commit runs inside the next block's first
    # denoise step and adds none), and tokens over denoise and those forwards together.
    commit_forwards: int
    tokens_per_block_forward: float
    seconds: float
    failures: list[dict[str, str]]  # the first few wrong answers


def settings(block_size: int, thresholds: tuple[float, ...]) -> list[tuple[str, dict]]:
    out = [(f"threshold τ={t}", {"algorithm": "threshold", "threshold": t}) for t in thresholds]
    out.append(("low_confidence_static, 1 token/step",
                {"algorithm": "low_confidence_static", "steps_per_block": block_size}))
    return out


PHRASINGS = ("train", "held-out")


def evaluate(llm, families: list[str], per_family: int, seed: int,
             thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS,
             max_new_tokens: int = 64, progress: bool = False,
             phrasing: str = "train") -> list[SettingResult]:
    """One ``SettingResult`` per unmasking setting, on questions in ``phrasing``
    (``train``: the training templates; ``held-out``: templates training never used)."""
    from dllm.sampling_params import SamplingParams

    if phrasing not in PHRASINGS:
        raise ValueError(f"unknown phrasing {phrasing!r}; known: {', '.join(PHRASINGS)}")
    items = [(f, q, a) for f in families
             for q, a in tasks.generate(f, per_family, seed, held_out=phrasing == "held-out")]
    conversations = [[{"role": "user", "content": q}] for _, q, _ in items]
    results = []
    for name, dllm in settings(llm.engine.block_size, thresholds):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, dllm=dllm)
        start = time.perf_counter()
        if progress:
            print(f"dllm eval: {name}, {phrasing} phrasings ({len(conversations)} questions)",
                  file=sys.stderr)
        outs = llm.chat(conversations, params, use_tqdm=progress)
        seconds = time.perf_counter() - start
        hits: dict[str, list[bool]] = {f: [] for f in families}
        failures = []
        for (family, q, a), out in zip(items, outs, strict=True):
            ok = out.text.strip() == a
            hits[family].append(ok)
            if not ok and len(failures) < 10:
                failures.append({"family": family, "question": q, "expected": a,
                                 "got": out.text})
        accuracy = {f: sum(h) / len(h) for f, h in hits.items()}
        accuracy["overall"] = sum(sum(h) for h in hits.values()) / len(items)
        tokens = sum(len(o.token_ids) for o in outs)
        forwards = sum(o.num_denoise_forwards for o in outs)
        commits = sum(o.num_commit_forwards for o in outs)
        blocks = sum(o.num_blocks for o in outs)
        results.append(SettingResult(
            name=name, dllm=dllm, accuracy=accuracy,
            tokens_per_forward=tokens / max(forwards, 1),
            forwards_per_block=forwards / max(blocks, 1), tokens=tokens,
            denoise_forwards=forwards, blocks=blocks, commit_forwards=commits,
            tokens_per_block_forward=tokens / max(forwards + commits, 1),
            seconds=round(seconds, 2), failures=failures))
    return results


def markdown_table(results: list[SettingResult], families: list[str]) -> str:
    head = ["setting", *families, "overall", "tokens/denoise forward", "forwards/block",
            "tokens/forward, commits incl.", "commit forwards/block"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r.name, *(f"{100 * r.accuracy[f]:.1f}" for f in [*families, "overall"]),
                 f"{r.tokens_per_forward:.2f}", f"{r.forwards_per_block:.2f}",
                 f"{r.tokens_per_block_forward:.2f}",
                 f"{r.commit_forwards / max(r.blocks, 1):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--per-family", type=int, default=200, help="questions per task family")
    p.add_argument("--families", default=",".join(tasks.EVAL_FAMILIES),
                   help=f"comma-separated task families (known: {', '.join(tasks.FAMILIES)})")
    p.add_argument("--eval-seed", type=int, default=tasks.EVAL_SEED,
                   help="seed of the question generator (default: the held-out seed that "
                        "training never uses)")
    p.add_argument("--thresholds", default=",".join(str(t) for t in DEFAULT_THRESHOLDS),
                   help="τ values of the threshold algorithm")
    p.add_argument("--phrasings", default=",".join(PHRASINGS),
                   help="question phrasings to evaluate, each reported in its own table: "
                        "'train' (the training templates, fresh questions) and 'held-out' "
                        "(templates training never used)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--output", help="write the results as JSON here")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none either when stderr is not a terminal)")


def run_eval(args: argparse.Namespace) -> int:
    from dllm.cli_args import check_output_path, engine_config_from_args
    from dllm.llm import LLM

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in tasks.FAMILIES]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; known: {', '.join(tasks.FAMILIES)}")
    if args.per_family < 1:
        raise ValueError("--per-family must be at least 1")
    thresholds = tuple(float(t) for t in args.thresholds.split(",") if t.strip())
    phrasings = [x.strip() for x in args.phrasings.split(",") if x.strip()]
    if not phrasings or any(x not in PHRASINGS for x in phrasings):
        raise ValueError(f"--phrasings {args.phrasings!r}: give some of {', '.join(PHRASINGS)}")
    if args.output:  # checked before the model loads
        check_output_path(args.output, "a JSON file")
    cfg = engine_config_from_args(args)
    llm = LLM(**{k: getattr(cfg, k) for k in cfg.field_names()})
    progress = not args.no_progress and sys.stderr.isatty()
    results = {x: evaluate(llm, families, args.per_family, args.eval_seed, thresholds,
                           args.max_new_tokens, progress=progress, phrasing=x)
               for x in phrasings}
    print(f"model: {llm.engine.info.path} (block size {llm.engine.block_size}); "
          f"{args.per_family} questions per family, seed {args.eval_seed}")
    for x, rows in results.items():
        print(f"\n{x} phrasings:\n{markdown_table(rows, families)}")
    if args.output:
        report = {"model": llm.engine.info.path, "block_size": llm.engine.block_size,
                  "families": families, "per_family": args.per_family,
                  "eval_seed": args.eval_seed,
                  "results": {x: [asdict(r) for r in rows] for x, rows in results.items()}}
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return 0
