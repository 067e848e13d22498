"""Dream (``DreamModel``) against the official generators' own output (DESIGN §11, oracle 1).

The vectors (``tests/data/refvectors/dream_*.json``) come from ``scripts/refvectors/dream.py``:
Fast-dLLM's ``dream/model/generation_utils.py`` (Dream's ``diffusion_generate``: ``alg``
``maskgit_plus``/``topk_margin``/``entropy``, and Fast-dLLM's ``confidence_threshold``) and
``generation_utils_block.py`` (the prefix and dual caches), run on the factory's tiny checkpoint.

Each reference function has ONE mapping rule from its own arguments to dllm's engine arguments
and ``SamplingParams`` (below), applied to whatever settings a vector carries. The reference
fills exactly ``max_new_tokens`` positions and ignores EOS, so the replay does too
(``ignore_eos=True``, the same ``max_new_tokens``) and compares every generated id. Every
reference here runs one forward per step on the whole batch, as dllm runs one forward per step
of a request, so the forward counts are compared too (``RequestOutput.num_forward_passes``:
the forwards the request took part in).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from dllm import SamplingParams
from tests.refvector_replay import (
    Replay,
    check_outputs,
    load_vectors,
    run_between,
    run_together,
    vector_ids,
)

VECTORS = load_vectors("dream_")
BY_NAME = {v["name"]: v for v in VECTORS}

FULL = "NVlabs/Fast-dLLM dream/model/generation_utils.py::DreamGenerationMixin.diffusion_generate"
BLOCK = ("NVlabs/Fast-dLLM dream/model/generation_utils_block.py::"
         "DreamGenerationMixin.diffusion_generate")

# What a setting left out of the call is: ``diffusion_generate`` (generation_config=None) starts
# from ``DreamGenerationConfig.from_model_config(model.config)``, so the sampler settings are
# transformers' PretrainedConfig defaults (temperature 1.0, top_p 1.0, top_k 50; not
# generation_config.json's), the diffusion ones DreamGenerationConfig's; ``threshold`` (and
# ``block_length``, ``dual_cache``) are ``kwargs.get`` defaults of diffusion_generate.
GENERATION_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 50, "eps": 1e-3, "steps": 512,
    "alg": "origin", "alg_temp": None, "threshold": 0.9,
}
BLOCK_DEFAULTS: dict[str, Any] = {**GENERATION_DEFAULTS, "block_length": 32, "dual_cache": False}


def _sampling(s: dict[str, Any], dllm: dict[str, Any]) -> SamplingParams:
    """The reference's sampler settings; it generates exactly ``max_new_tokens`` ids."""
    assert s["eps"] == 1e-3, "dllm's Dream schedules fix eps = 1e-3 (no key for it)"
    return SamplingParams(
        max_new_tokens=s["max_new_tokens"], temperature=float(s["temperature"]),
        top_p=1.0 if s["top_p"] is None else float(s["top_p"]),  # None/1.0: no filter
        top_k=0 if s["top_k"] is None else int(s["top_k"]),
        ignore_eos=True, dllm=dllm)


def full_rule(settings: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
    """``generation_utils.py::diffusion_generate``: the whole canvas is one block, recomputed
    every step (``cache_mode="exact"``), in ``steps`` steps. ``confidence_threshold``
    (Fast-dLLM: a fixed quota of masks/steps per step, the quota's tokens below ``threshold``
    carried to the next step, extra steps after the last) has no dllm algorithm yet: it is
    requested under its reference name with the reference's keys."""
    s = {**GENERATION_DEFAULTS, **settings}
    n = s["max_new_tokens"]
    dllm: dict[str, Any] = {"block_size": n, "cache_mode": "exact", "steps": s["steps"]}
    if s["alg"] == "confidence_threshold":
        dllm.update(algorithm="confidence_threshold", threshold=float(s["threshold"]))
    else:
        dllm.update(algorithm=s["alg"], alg_temp=float(s["alg_temp"] or 0.0))
    return {}, _sampling(s, dllm)


def block_rule(settings: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
    """``generation_utils_block.py::diffusion_generate``: blocks of ``block_length`` from the
    prompt end, Fast-dLLM's prefix cache (``dual_cache=False``) or dual cache; ``steps`` is the
    total, ``steps // num_blocks`` per block. Its ``confidence_threshold`` is dllm's
    ``threshold`` (every masked position of the block at or above ``threshold``, at least the
    top one, until none is left; ``steps`` unused); any other ``alg`` ranks by negative
    entropy (``sample_tokens(..., neg_entropy=True)`` whatever ``alg`` says), i.e. dllm's
    ``entropy``."""
    s = {**BLOCK_DEFAULTS, **settings}
    dllm: dict[str, Any] = {"block_size": s["block_length"],
                            "cache_mode": "dual" if s["dual_cache"] else "prefix"}
    if s["alg"] == "confidence_threshold":
        dllm.update(algorithm="threshold", threshold=float(s["threshold"]))
    else:
        dllm.update(algorithm="entropy", steps=s["steps"], alg_temp=float(s["alg_temp"] or 0.0))
    return {}, _sampling(s, dllm)


RULES = {FULL: full_rule, BLOCK: block_rule}


def replay_of(vector: dict[str, Any]) -> Replay:
    engine_args, params = RULES[vector["reference"]](vector["settings"])
    prompts = vector["prompts"]
    expected = [out[len(p):] for p, out in zip(prompts, vector["outputs"], strict=True)]
    return Replay(engine_args, prompts, [params] * len(prompts), expected,
                  num_forwards=vector["num_forwards"])


# An unrelated request batched with a vector's rows: another prompt, length and schedule.
OTHER_PROMPT = [17, 305, 88, 412, 9, 250, 131]
OTHER_PARAMS = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                              dllm={"algorithm": "maskgit_plus", "steps": 5})


@cache
def run_alone(name: str) -> list:
    vector = BY_NAME[name]
    return run_together(vector, replay_of(vector))


@pytest.mark.parametrize("vector", VECTORS, ids=vector_ids(VECTORS))
def test_tokens_alone(vector: dict[str, Any]) -> None:
    check_outputs(run_alone(vector["name"]), replay_of(vector), vector["name"])


@pytest.mark.parametrize("vector", VECTORS, ids=vector_ids(VECTORS))
def test_tokens_batched(vector: dict[str, Any]) -> None:
    replay = replay_of(vector)
    check_outputs(run_between(vector, replay, OTHER_PROMPT, OTHER_PARAMS), replay,
                  vector["name"])


@pytest.mark.parametrize("vector", VECTORS, ids=vector_ids(VECTORS))
def test_forwards(vector: dict[str, Any]) -> None:
    """The reference's forward count (one forward per step for the whole batch) equals each
    row's ``num_forward_passes``."""
    outs = run_alone(vector["name"])
    got = [o.num_forward_passes for o in outs]
    assert got == [vector["num_forwards"]] * len(outs), (
        f"{vector['name']}: forwards {got}, reference {vector['num_forwards']}")
