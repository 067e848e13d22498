"""SDAR (``SDARForCausalLM``) against the official generators' own output (DESIGN §11, oracle 1).

The vectors (``tests/data/refvectors/sdar_*.json``) come from ``scripts/refvectors/sdar.py``:
JetAstra/SDAR's ``generate.py::block_diffusion_generate`` (the README generator) and the
evaluation wrapper's ``huggingface_bd3.py::block_diffusion_generate``, run greedily (top-k 1,
the evaluation config's setting) with the released ``modeling_sdar.py`` on the factory's tiny
checkpoint.

Each reference function has ONE mapping rule from its own arguments to dllm's engine
arguments and ``SamplingParams`` (below), applied to whatever settings a vector carries.

Both references denoise ``ceil((prompt + gen_length) / block_length)`` whole blocks from
position 0 and return the canvas; they stop only on ``stopping_criteria_idx`` (after the block
that holds one), never on EOS by themselves. So the replay sets ``ignore_eos=True``,
``max_new_tokens=gen_length`` and ``stop_token_ids=stopping_criteria_idx``, and expects the
reference's generated ids cut to ``gen_length`` and after the first stop id.

Forwards. Each reference runs one prefill forward over the full prompt blocks (if any), then
per block one forward per denoise step and one ``store_kv`` forward over the finished block
(generate.py:96-106 and 119-137, huggingface_bd3.py:171-182 and 193-211): dllm's prefill /
denoise / commit structure. dllm skips the commit forward of the block a request finishes in (DESIGN §4:
nothing reads that KV), so a row's ``num_forward_passes`` must be the reference's count less
one, and ``num_denoise_forwards`` the reference's denoise count.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from dllm import SamplingParams
from tests.refvector_replay import (
    Replay,
    check_outputs,
    get_llm,
    load_vectors,
    run_between,
    vector_ids,
)

VECTORS = load_vectors("sdar_")
BY_NAME = {v["name"]: v for v in VECTORS}

GEN = "JetAstra/SDAR generate.py::block_diffusion_generate"
EVAL = ("JetAstra/SDAR evaluation/opencompass/opencompass/models/huggingface_bd3.py"
        "::block_diffusion_generate")

# The functions' own defaults (their signatures), under their own names.
GEN_DEFAULTS: dict[str, Any] = {
    "gen_length": 128, "block_length": 8, "denoising_steps": 8, "temperature": 1.0,
    "top_k": 0, "top_p": 1.0, "remasking_strategy": "low_confidence_dynamic",
    "confidence_threshold": 0.85, "eb_threshold": None, "stopping_criteria_idx": None,
}
EVAL_DEFAULTS: dict[str, Any] = {
    "gen_length": 128, "block_length": 8, "denoising_steps": 8, "temperature": 0.0,
    "top_k": 0, "top_p": 1.0, "remasking": "low_confidence", "threshold": 1.0,
    "stopping_criteria_idx": None,
}


def _params(s: dict[str, Any], temperature: float, top_k: int, top_p: float,
            dllm: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_new_tokens=s["gen_length"], temperature=temperature, top_k=top_k,
                          top_p=top_p, ignore_eos=True,
                          stop_token_ids=list(s["stopping_criteria_idx"] or []), seed=0,
                          dllm=dllm)


def _engine(s: dict[str, Any]) -> dict[str, Any]:
    return {"block_size": s["block_length"], "mask_token_id": s["mask_id"]}


def gen_rule(settings: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
    """``generate.py``: its sampler (``sample_with_temperature_topk_topp``) divides by the
    temperature, filters top-k then top-p, draws, and ranks by the probability of the drawn
    token under that filtered distribution: dllm's sampler at the same temperature / top-k /
    top-p (its confidence is the tempered, filtered softmax; at top-k 1 both are 1.0 for every
    position). ``denoising_steps`` is ``steps_per_block``; ``confidence_threshold`` the dynamic
    rule's ``threshold``; ``eb_threshold`` the entropy bound. ``sequential`` (the first
    ``quota`` masks left to right) has no dllm algorithm: it is requested under its own name."""
    s = {**GEN_DEFAULTS, **settings}
    strategy = s["remasking_strategy"]
    dllm: dict[str, Any] = {"algorithm": strategy, "steps_per_block": s["denoising_steps"]}
    if strategy == "low_confidence_dynamic":
        dllm["threshold"] = float(s["confidence_threshold"])
    elif strategy == "entropy_bounded":
        dllm = {"algorithm": strategy, "eb_gamma": float(s["eb_threshold"])}
    return _engine(s), _params(s, float(s["temperature"]), int(s["top_k"]), float(s["top_p"]),
                               dllm)


def eval_rule(settings: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
    """``huggingface_bd3.py``: ``threshold < 1`` is the dynamic rule (every masked position
    above ``threshold`` when at least the quota are, else the top quota), otherwise the static
    one; ``denoising_steps`` is ``steps_per_block``. Its confidence is the tempered but
    unfiltered softmax (``ori_probs``) of the drawn token: dllm's ``rank_unfiltered``, with the
    sampler's settings passed through (at top-k 1, its greedy setting, the draw is the
    argmax). ``remasking='random'`` ranks by ``torch.rand``: dllm's ``remasking='random'``."""
    s = {**EVAL_DEFAULTS, **settings}
    threshold = float(s["threshold"])
    dllm: dict[str, Any] = {"steps_per_block": s["denoising_steps"], "rank_unfiltered": True}
    if threshold < 1.0:
        dllm.update(algorithm="low_confidence_dynamic", threshold=threshold)
    else:
        dllm.update(algorithm="low_confidence_static")
    if s["remasking"] == "random":
        dllm.update(algorithm="low_confidence_static", remasking="random")
    return _engine(s), _params(s, float(s["temperature"]), int(s["top_k"]), float(s["top_p"]),
                               dllm)


RULES = {GEN: gen_rule, EVAL: eval_rule}


def expected_ids(vector: dict[str, Any]) -> list[list[int]]:
    """The reference's generated ids, cut to ``gen_length`` and after the first stop id."""
    s = vector["settings"]
    stops = set(s.get("stopping_criteria_idx") or [])
    out = []
    for p, x in zip(vector["prompts"], vector["outputs"], strict=True):
        gen = x[len(p):][: s["gen_length"]]
        cut = next((i + 1 for i, t in enumerate(gen) if t in stops), len(gen))
        out.append(gen[:cut])
    return out


def replay_of(vector: dict[str, Any]) -> Replay:
    engine_args, params = RULES[vector["reference"]](vector["settings"])
    prompts = vector["prompts"]
    return Replay(engine_args, prompts, [params] * len(prompts), expected_ids(vector))


# An unrelated request batched with a vector's rows: another prompt, length and schedule.
OTHER_PROMPT = [17, 305, 88, 412, 9, 250, 131, 77, 3]
OTHER_PARAMS = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True,
                              dllm={"algorithm": "low_confidence_dynamic", "threshold": 0.3,
                                    "steps_per_block": 2})


@cache
def run_alone(name: str) -> list:
    """Each row in its own ``generate`` call, as the reference ran it (batch 1)."""
    vector = BY_NAME[name]
    replay = replay_of(vector)
    llm = get_llm(vector, replay.engine_args)
    return [llm.generate([p], [sp])[0] for p, sp in zip(replay.prompts, replay.params,
                                                         strict=True)]


@pytest.mark.parametrize("vector", VECTORS, ids=vector_ids(VECTORS))
def test_tokens_alone(vector: dict[str, Any]) -> None:
    check_outputs(run_alone(vector["name"]), replay_of(vector), vector["name"])


@pytest.mark.parametrize("vector", VECTORS, ids=vector_ids(VECTORS))
def test_tokens_batched(vector: dict[str, Any]) -> None:
    """All rows in one batch, between two unrelated requests."""
    replay = replay_of(vector)
    check_outputs(run_between(vector, replay, OTHER_PROMPT, OTHER_PARAMS), replay,
                  vector["name"])


@pytest.mark.parametrize("vector", VECTORS, ids=vector_ids(VECTORS))
def test_forwards(vector: dict[str, Any]) -> None:
    """Per row: denoise forwards equal the reference's; all forwards equal the reference's
    prefill + denoise + store forwards less the final block's store forward."""
    outs = run_alone(vector["name"])
    want = [(f["denoise"], f["prefill"] + f["denoise"] + f["store"] - 1)
            for f in vector["row_forwards"]]
    got = [(o.num_denoise_forwards, o.num_forward_passes) for o in outs]
    assert got == want, (f"{vector['name']}: (denoise, all) forwards per row {got}, "
                         f"reference {want}")
