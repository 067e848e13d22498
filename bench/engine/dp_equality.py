"""Data-parallel attention against one process, family by family (CPU, Gloo; tiny random
checkpoints from ``dllm.testing``): for each family, greedy and sampled tokens of a few
requests on a ``--dp 2`` engine (staggered: the first request runs alone for a few steps,
so rank 1 idles) against each request alone on a single-process engine, and the forwards
each rank ran (its own batches, IDLE). Prints a table and writes it (``.md``) and the numbers
(``.json``) under ``--out``.

    python bench/engine/dp_equality.py [--out bench/results] [--families Qwen3ForCausalLM,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from dllm import LLM, SamplingParams
from dllm.testing import make_tiny_checkpoint

SHAPES = {  # every size splits over 2 ranks; 6 experts, 3 per rank under --ep 2
    "Qwen3ForCausalLM": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=16, intermediate_size=64),
    "SDARForCausalLM": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                            head_dim=16, intermediate_size=64),
    "LLaDAModelLM": dict(d_model=64, n_heads=4, n_kv_heads=4, mlp_hidden_size=64),
    "LLaDA2MoeModelLM": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                             head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                             num_experts=6, n_group=3, topk_group=2, first_k_dense_replace=1),
    "SDARMoeForCausalLM": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                               head_dim=16, moe_intermediate_size=32, intermediate_size=64,
                               num_experts=6),
}
MOE = ("LLaDA2MoeModelLM", "SDARMoeForCausalLM")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]
LENGTHS = [4, 12, 8]


def _params(family: str, sampled: bool, n: int) -> SamplingParams:
    extra = dict(temperature=0.9, top_k=20, seed=7) if sampled else {}
    dllm = {"steps": n, "block_size": 4} if family == "LLaDAModelLM" else None
    return SamplingParams(max_new_tokens=n, ignore_eos=True, dllm=dllm, **extra)


def _staggered(llm: LLM, family: str, sampled: bool) -> list[list[int]]:
    engine = llm.engine
    reqs = [engine.make_request(p, _params(family, sampled, n))
            for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    engine.add_request(reqs[0])
    for _ in range(3):
        engine.step()
    for req in reqs[1:]:
        engine.add_request(req)
    while any(not r.finished for r in reqs):
        engine.step()
    return [engine.output_of(r).token_ids for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--families", default=",".join(SHAPES))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            path = str(make_tiny_checkpoint(family, Path(tmp) / family, seed=1,
                                            **SHAPES[family]))
            kw = dict(max_running_requests=4, page_size=4)
            if family not in ("LLaDAModelLM", "Qwen3ForCausalLM"):
                kw["block_size"] = 4
            single = LLM(path, **kw)
            start = time.monotonic()
            dp = LLM(path, data_parallel_size=2, expert_parallel_size=2 if family in MOE else 1,
                     **kw)
            try:
                for sampled in (False, True):
                    want = [single.generate([p], _params(family, sampled, n))[0].token_ids
                            for p, n in zip(PROMPTS, LENGTHS, strict=True)]
                    before = dp.engine.dp_forward_counts()
                    got = _staggered(dp, family, sampled)
                    after = dp.engine.dp_forward_counts()
                    dp.engine.check_memory()
                    counts = [(a - c, b - d) for (a, b), (c, d) in zip(after, before,
                                                                       strict=True)]
                    rows.append(dict(family=family, ep=2 if family in MOE else 1,
                                     sampled=sampled, equal=got == want,
                                     forwards=counts))
                    print(rows[-1], flush=True)
            finally:
                dp.engine.shutdown()
            rows[-1]["seconds"] = round(time.monotonic() - start, 1)
    lines = ["| family | ep | tokens | dp 2 = single | rank 0 (own, IDLE) | rank 1 (own, IDLE) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['ep']} | {'sampled' if r['sampled'] else 'greedy'} "
                     f"| {'yes' if r['equal'] else 'NO'} | {r['forwards'][0]} "
                     f"| {r['forwards'][1]} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"dp-equality-{stamp}.md").write_text(table + "\n")
    (out / f"dp-equality-{stamp}.json").write_text(json.dumps(
        [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rows], indent=1))
    print(f"wrote {out}/dp-equality-{stamp}.md")


if __name__ == "__main__":
    main()
