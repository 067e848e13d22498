"""LLaDA2.0 / LLaDA2.1 (``LLaDA2MoeModelLM``) against the official generators' own output
(DESIGN §11, oracle 1).

The vectors (``tests/data/refvectors/llada2_*.json``) come from ``scripts/refvectors/llada2.py``:
dFactory's ``LLaDA2MoeModelLM.generate`` (LLaDA2.0: static schedule, ``threshold``,
``minimal_topk``, ``eos_early_stop``), as published (``llada2_topk1_*``) and with the LLaDA2.1
hub file's temperature-0 sampler (``llada2_gen_*``), and the LLaDA2.1 hub file's ``generate``
(token editing, ``llada2_edit_*``), on the factory's tiny checkpoint. The script's docstring
lists the adaptations each vector records.

Each reference function has ONE mapping rule from its own arguments to dllm's engine arguments
and ``SamplingParams`` (below), applied to whatever settings a vector carries. Both generators
stop at ``eos_id`` and nowhere else (dFactory's loop breaks after the block that holds it
whatever ``eos_early_stop`` says; both cut the output after the first one), so the replay
stops on that id alone (``stop_token_ids=[eos_id]``, ``ignore_eos=True``) with
``max_new_tokens=gen_length``. Neither keeps a KV cache: every step is one forward over the
whole prefix, with no prefill and no commit forward, so a reference forward is one dllm denoise
step (``RequestOutput.num_denoise_forwards``), compared where the reference's loop ends where
dllm's does.
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

VECTORS = load_vectors("llada2_")
BY_NAME = {v["name"]: v for v in VECTORS}

GEN = "inclusionAI/dFactory models/llada2_moe/modeling_llada2_moe.py::LLaDA2MoeModelLM.generate"
GEN21 = GEN + " + LLaDA2.1-mini hub _sample_with_temperature_topk_topp"
EDIT = "inclusionAI/LLaDA2.1-mini (model hub) modeling_llada2_moe.py::LLaDA2MoeModelLM.generate"

# The generators' own argument defaults.
GEN_DEFAULTS: dict[str, Any] = {
    "temperature": 0.0, "block_length": 32, "steps": 32, "gen_length": 2048, "top_p": None,
    "top_k": None, "eos_early_stop": False, "minimal_topk": 1, "threshold": 0.95,
    "eos_id": 156892, "mask_id": 156895,
}
EDIT_DEFAULTS: dict[str, Any] = {
    **GEN_DEFAULTS, "editing_threshold": 0.9, "max_post_steps": 16, "num_to_transfer": 1,
}


def _sampling(s: dict[str, Any], temperature: float, dllm: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=s["gen_length"], temperature=temperature,
        top_k=int(s["top_k"] or 0), top_p=1.0 if s["top_p"] is None else float(s["top_p"]),
        ignore_eos=True, stop_token_ids=[s["eos_id"]], dllm=dllm)


def _gen_dllm(s: dict[str, Any]) -> dict[str, Any]:
    """dFactory's loop: ``steps`` capped at ``gen_length // minimal_topk``; each step the masked
    positions strictly above ``threshold`` if at least the step's quota of them are, else the
    quota's most confident ones: dllm's ``low_confidence_dynamic`` (``threshold >= 1`` leaves
    the fixed schedule alone)."""
    return {"algorithm": "low_confidence_dynamic", "threshold": float(s["threshold"]),
            "steps_per_block": min(s["steps"], s["gen_length"] // s["minimal_topk"]),
            "block_size": s["block_length"]}


def gen_rule(settings: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
    """dFactory's ``generate`` as published: its sampler always draws with
    ``torch.multinomial``, at temperature 1 when ``temperature`` is 0, after top-k / top-p."""
    s = {**GEN_DEFAULTS, **settings}
    temperature = float(s["temperature"]) or 1.0
    return ({"mask_token_id": s["mask_id"], "block_size": s["block_length"]},
            _sampling(s, temperature, _gen_dllm(s)))


def gen21_rule(settings: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
    """The same loop with the LLaDA2.1 sampler: ``temperature`` 0 is the argmax."""
    s = {**GEN_DEFAULTS, **settings}
    return ({"mask_token_id": s["mask_id"], "block_size": s["block_length"]},
            _sampling(s, float(s["temperature"]), _gen_dllm(s)))


def edit_rule(settings: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
    """LLaDA2.1's ``generate``: per step, masked positions strictly above ``threshold`` (at
    least ``num_to_transfer``), plus edits of generated positions whose new token's confidence
    is strictly above ``editing_threshold``; after the block is filled, up to
    ``max_post_steps`` editing steps, until one edits nothing. ``steps`` and ``minimal_topk``
    are read but unused by its loop. dllm's ``joint_threshold`` guarantees one fill per step,
    i.e. ``num_to_transfer=1``."""
    s = {**EDIT_DEFAULTS, **settings}
    assert s["num_to_transfer"] == 1, (
        f"num_to_transfer={s['num_to_transfer']}: dllm's joint_threshold has no key for it")
    dllm = {"algorithm": "joint_threshold", "threshold": float(s["threshold"]),
            "edit_threshold": float(s["editing_threshold"]),
            "max_post_edit_steps": int(s["max_post_steps"]), "block_size": s["block_length"]}
    return ({"mask_token_id": s["mask_id"], "block_size": s["block_length"]},
            _sampling(s, float(s["temperature"]), dllm))


RULES = {GEN: gen_rule, GEN21: gen21_rule, EDIT: edit_rule}
DEFAULTS = {GEN: GEN_DEFAULTS, GEN21: GEN_DEFAULTS, EDIT: EDIT_DEFAULTS}


def expected_of(vector: dict[str, Any]) -> list[list[int]]:
    """The generated ids. dFactory's early-stop return is ``x[:, :eos_pos + 1]``, the prompt
    included and not cut to ``gen_length`` (``returned_with_prompt``); dllm's output is cut
    at ``max_new_tokens``."""
    s = {**DEFAULTS[vector["reference"]], **vector["settings"]}
    out = []
    for prompt, got in zip(vector["prompts"], vector["outputs"], strict=True):
        ids = got[len(prompt):] if vector.get("returned_with_prompt") else got
        out.append(ids[: s["gen_length"]])
    return out


def forwards_comparable(vector: dict[str, Any]) -> bool:
    """Where the reference's loop ends where dllm's does: dllm finishes the block that holds
    the EOS and stops. dFactory's early-stop return leaves that block mid-way; LLaDA2.1
    without ``eos_early_stop`` goes on to ``gen_length`` after it."""
    s = {**DEFAULTS[vector["reference"]], **vector["settings"]}
    if vector.get("returned_with_prompt"):
        return False
    has_eos = any(s["eos_id"] in e for e in expected_of(vector))
    return not (vector["reference"] == EDIT and has_eos and not s["eos_early_stop"])


def replay_of(vector: dict[str, Any]) -> Replay:
    engine_args, params = RULES[vector["reference"]](vector["settings"])
    prompts = vector["prompts"]
    return Replay(engine_args, prompts, [params] * len(prompts), expected_of(vector),
                  num_forwards=vector["num_forwards"] if forwards_comparable(vector) else None)


# An unrelated request batched with a vector's rows: another prompt, length and rule.
OTHER_PROMPT = [17, 305, 88, 412, 9, 250, 131]
OTHER_PARAMS = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                              dllm={"algorithm": "threshold", "threshold": 0.8})


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
    """One reference forward per denoise step: ``num_denoise_forwards`` equals the
    reference's count. Where the loops end elsewhere: after dFactory's mid-block early-stop
    return dllm still finishes that block (at least as many steps); LLaDA2.1 without
    ``eos_early_stop`` goes on past the EOS block (at most as many)."""
    replay = replay_of(vector)
    got = [o.num_denoise_forwards for o in run_alone(vector["name"])]
    want = vector["num_forwards"]
    if replay.num_forwards is not None:
        ok = all(n == want for n in got)
    elif vector.get("returned_with_prompt"):
        ok = all(n >= want for n in got)
    else:
        ok = all(n <= want for n in got)
    assert ok, f"{vector['name']}: denoise forwards {got}, reference {want}" + (
        "" if replay.num_forwards is not None else " (bound, not equality)")
