"""Fast-dLLM v2 (``Fast_dLLM_QwenForCausalLM``) against the official generators' own output
(DESIGN §11, oracle 1).

The vectors (``tests/data/refvectors/fast_dllm_v2_*.json``) come from
``scripts/refvectors/fast_dllm_v2.py``: the model hub's ``Fast_dLLM_QwenForCausalLM.generate``
(``modeling.py`` of Efficient-Large-Model/Fast_dLLM_v2_7B) and NVlabs/Fast-dLLM
``v2/generation_functions.py::batch_sample`` (what ``v2/eval.py`` runs), on the factory's tiny
checkpoint, batch of one.

Each reference function has ONE mapping rule from its own arguments to dllm's engine arguments
and ``SamplingParams`` (below), applied to whatever settings a vector carries. Both run blocks
of ``block_size`` from position 0, sub-blocks of ``small_block_size`` in order (every masked
position of the sub-block above ``threshold``, strictly, plus its most confident one): dllm's
``hierarchical``. Both stop at ``stop_token`` and nowhere else (``stop_token_ids``,
``ignore_eos=True``). Neither fills exactly ``max_new_tokens`` ids: they generate
``max_new_tokens // block_size`` blocks, each followed by its commit forward, whose last logits
give the next block's first token, so the output is ``blocks * block_size - prompt_len %
block_size + 1`` ids (``+ 1`` also when the prompt ends on a block boundary: the prefill's last
logits give the first id); that is the replay's ``max_new_tokens``. Expected: the ids after the
prompt, cut after the first ``stop_token`` (``batch_sample`` pads after it).

Forwards: the references' structure is dllm's (one prefill forward over the full prompt blocks
when the prompt is longer than a block, one forward per sub-block step, one commit forward per
block that does not end the output), so ``num_forward_passes`` is compared, except where their
loop ends elsewhere: ``generate`` stops as soon as the stop token has no mask before it (dllm
finishes the block: at least as many forwards); ``batch_sample`` does not see a stop token that
is a block's first id (read from the commit forward) and goes on (at most as many).
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

VECTORS = load_vectors("fast_dllm_v2_")
BY_NAME = {v["name"]: v for v in VECTORS}

GEN = ("Efficient-Large-Model/Fast_dLLM_v2_7B (model hub) modeling.py::"
       "Fast_dLLM_QwenForCausalLM.generate")
BATCH = "NVlabs/Fast-dLLM v2/generation_functions.py::Fast_dLLM_QwenForCausalLM.batch_sample"

# The generators' own argument defaults.
DEFAULTS: dict[str, dict[str, Any]] = {
    GEN: {"mask_id": 151665, "threshold": 1, "small_block_size": 8, "block_size": 32,
          "stop_token": 151645, "top_p": 0.95, "temperature": 0, "use_block_cache": False},
    BATCH: {"mask_id": 151665, "threshold": 0.95, "stop_token": 151645,
            "use_block_cache": False, "top_p": 0.95, "temperature": 0.0},
}


def num_generated(settings: dict[str, Any], prompt_len: int) -> int:
    """How many ids the reference appends without a stop (module docstring)."""
    b = settings["block_size"]
    blocks = settings["max_new_tokens"] // b
    return blocks * b - prompt_len % b + 1 if blocks else int(prompt_len % b == 0
                                                              and prompt_len > b)


def rule(reference: str, settings: dict[str, Any], prompt_len: int
         ) -> tuple[dict[str, Any], SamplingParams]:
    """Both references: ``hierarchical`` with their threshold and sub-block size, the
    temperature-0 draw the argmax of the softmax (``sample_with_top_p``: top-p only when
    sampling). ``use_block_cache=True`` (the sub-block KV reuse) has no dllm counterpart."""
    s = {**DEFAULTS[reference], **settings}
    assert not s["use_block_cache"], "use_block_cache: no dllm counterpart"
    temperature = float(s["temperature"])
    dllm = {"algorithm": "hierarchical", "threshold": float(s["threshold"]),
            "sub_block_size": s["small_block_size"], "block_size": s["block_size"]}
    params = SamplingParams(
        max_new_tokens=num_generated(s, prompt_len), temperature=temperature,
        top_p=float(s["top_p"]) if temperature > 0 else 1.0, ignore_eos=True,
        stop_token_ids=[s["stop_token"]], dllm=dllm)
    return {"mask_token_id": s["mask_id"], "block_size": s["block_size"]}, params


def _cut_after_stop(ids: list[int], stop: int) -> list[int]:
    return ids[: ids.index(stop) + 1] if stop in ids else ids


def replay_of(vector: dict[str, Any]) -> Replay:
    ref = vector["reference"]
    s = {**DEFAULTS[ref], **vector["settings"]}
    prompts = vector["prompts"]
    engine_args: dict[str, Any] = {}
    params, expected = [], []
    for prompt, out in zip(prompts, vector["outputs"], strict=True):
        engine_args, p = rule(ref, vector["settings"], len(prompt))
        params.append(p)
        expected.append(_cut_after_stop(out[len(prompt):], s["stop_token"]))
    return Replay(engine_args, prompts, params, expected,
                  num_forwards=vector["num_forwards"] if forwards_bound(vector) == "==" else None)


def forwards_bound(vector: dict[str, Any]) -> str:
    """How dllm's forward count compares with the reference's (module docstring)."""
    ref = vector["reference"]
    s = {**DEFAULTS[ref], **vector["settings"]}
    prompt, out = vector["prompts"][0], vector["outputs"][0]
    generated = out[len(prompt):]
    if s["stop_token"] not in generated:
        return "=="
    if ref == GEN:
        return ">="
    first_stop = len(prompt) + generated.index(s["stop_token"])
    return "<=" if first_stop % s["block_size"] == 0 else "=="


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
    """``num_forward_passes`` (prefill, denoise and commit forwards the request took part
    in) against the reference's forward count: equal, or the bound where the loops end
    elsewhere."""
    bound = forwards_bound(vector)
    got = [o.num_forward_passes for o in run_alone(vector["name"])]
    want = vector["num_forwards"]
    ok = {"==": lambda n: n == want, ">=": lambda n: n >= want,
          "<=": lambda n: n <= want}[bound]
    assert all(ok(n) for n in got), f"{vector['name']}: forwards {got}, reference {bound} {want}"
