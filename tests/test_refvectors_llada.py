"""LLaDA (``LLaDAModelLM``) and LLaDA-MoE (``LLaDAMoEModelLM``) against the official generators'
own output (DESIGN §11, oracle 1).

The vectors (``tests/data/refvectors/llada_*.json``) come from ``scripts/refvectors/llada.py``:
ML-GSAI's ``generate.py::generate`` (LLaDA's fixed-quota low-confidence decoding, ``cfg_scale``,
batches; also run on LLaDA-MoE's hub model code) and Fast-dLLM's ``llada/generate.py``
(``generate``, ``generate_with_prefix_cache``, ``generate_with_dual_cache`` with a fixed quota,
``threshold`` or ``factor``), on the factory's tiny checkpoints with the official model code.

Each reference function has ONE mapping rule from its own arguments to dllm's engine arguments
and ``SamplingParams`` (below), applied to whatever settings a vector carries. The references
fill exactly ``gen_length`` positions after the prompt, in blocks of ``block_length`` counted
from the prompt end, and ignore EOS, so the replay does too (``ignore_eos=True``,
``max_new_tokens=gen_length``) and compares every generated id. ``mask_id`` becomes the engine's
``mask_token_id``. Prompts are replayed verbatim: the official LLaDA model code ignores
``attention_mask`` (its attention always runs with ``attn_mask=None``), so a left-padded
reference row attends to its pads exactly as dllm attends to the same ids given as prompt.

Forward counts: ``RequestOutput.num_forward_passes`` counts the forwards a request took part in
(a CFG request's conditional and unconditional rows share one forward, as in the reference's
batch of two). Each rule states which of the reference's forwards dllm must also take.
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

VECTORS = load_vectors("llada_")
BY_NAME = {v["name"]: v for v in VECTORS}

GSAI = "ML-GSAI/LLaDA generate.py::generate"
FAST = "NVlabs/Fast-dLLM llada/generate.py::"
FAST_MODES = {FAST + "generate": "exact", FAST + "generate_with_prefix_cache": "prefix",
              FAST + "generate_with_dual_cache": "dual"}

# The functions' own defaults (their signatures).
GSAI_DEFAULTS: dict[str, Any] = {
    "attention_mask": None, "steps": 128, "gen_length": 128, "block_length": 128,
    "temperature": 0.0, "cfg_scale": 0.0, "remasking": "low_confidence", "mask_id": 126336,
    "logits_eos_inf": False, "confidence_eos_eot_inf": False,
}
FAST_DEFAULTS: dict[str, Any] = {
    "steps": 128, "gen_length": 128, "block_length": 128, "temperature": 0.0,
    "remasking": "low_confidence", "mask_id": 126336, "threshold": None, "factor": None,
}


def _sampling(s: dict[str, Any], dllm: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_new_tokens=s["gen_length"], temperature=float(s["temperature"]),
                          ignore_eos=True, dllm=dllm)


def gsai_rule(vector: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams, int]:
    """ML-GSAI ``generate``: every step recomputes the whole canvas (``cache_mode="exact"``);
    ``steps`` is the total, ``steps // num_blocks`` per block, each step transferring
    ``get_num_transfer_tokens``' quota of the block's masks (dllm's
    ``low_confidence_static``), ranked by the plain softmax probability of the argmax token
    (``remasking="low_confidence"``) or by ``torch.rand`` (``"random"``); ``cfg_scale`` as
    dllm's; LLaDA's float64 Gumbel sampler (``gumbel_fp64``). ``logits_eos_inf`` and
    ``confidence_eos_eot_inf`` hard-code LLaDA-8B's ids 126081/126348: dllm has no such key.

    Forwards: the reference runs ``steps // num_blocks`` forwards per block whatever the
    quota (steps past the block's masks have quota 0 and change nothing); so does dllm
    (``all_steps``, set for the LLaDA family)."""
    s = {**GSAI_DEFAULTS, **vector["settings"]}
    assert not s["logits_eos_inf"] and not s["confidence_eos_eot_inf"], (
        "logits_eos_inf / confidence_eos_eot_inf have no dllm setting")
    dllm = {"algorithm": "low_confidence_static", "block_size": s["block_length"],
            "steps": s["steps"], "remasking": s["remasking"], "gumbel_fp64": True,
            "cache_mode": "exact", "cfg_scale": float(s["cfg_scale"]), "all_steps": True}
    num_blocks = s["gen_length"] // s["block_length"]
    forwards = num_blocks * (s["steps"] // num_blocks)
    return {"mask_token_id": s["mask_id"]}, _sampling(s, dllm), forwards


def fast_rule(vector: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams, int]:
    """Fast-dLLM ``llada/generate.py``: blocks of ``block_length`` from the prompt end;
    ``generate`` recomputes the canvas every step (``exact``), ``generate_with_prefix_cache``
    (``prefix``) and ``generate_with_dual_cache`` (``dual``) run the whole canvas at a block's
    first step and then query the block and the suffix (prefix) or the block (dual) against
    the KV cached then. Per step: ``factor`` set: ``get_transfer_index_dynamic`` (dllm's
    ``factor``); else ``threshold`` set: every masked position with float64 confidence
    ``>= threshold``, at least the top one (dllm's ``threshold``; ``steps`` unused); else
    ``get_num_transfer_tokens``' quota of ``steps // num_blocks`` steps
    (``low_confidence_static``). A block ends when it has no mask left.

    Forwards: one per step until the block resolves. The cached generators of the older
    checkout (24cc59e) also run one forward after a block that its first (full) forward
    resolved, which changes nothing (0 masks); those forwards, a query that is not the whole
    canvas with no mask among its first ``block_length`` ids, are not dllm's."""
    s = {**FAST_DEFAULTS, **vector["settings"]}
    dllm: dict[str, Any] = {"block_size": s["block_length"],
                            "cache_mode": FAST_MODES[vector["reference"]]}
    if s["factor"] is not None:
        dllm.update(algorithm="factor", factor=float(s["factor"]))
    elif s["threshold"] is not None:
        dllm.update(algorithm="threshold", threshold=float(s["threshold"]))
    else:
        dllm.update(algorithm="low_confidence_static", steps=s["steps"],
                    remasking=s["remasking"], gumbel_fp64=True)
    if s["factor"] is not None or s["threshold"] is not None:
        assert s["remasking"] == "low_confidence", "random remasking ranks by torch.rand"
    canvas = len(vector["prompts"][0]) + s["gen_length"]
    idle = sum(1 for ids in vector["forward_inputs"]
               if len(ids[0]) != canvas and s["mask_id"] not in ids[0][: s["block_length"]])
    return {"mask_token_id": s["mask_id"]}, _sampling(s, dllm), vector["num_forwards"] - idle


RULES = {GSAI: gsai_rule, **dict.fromkeys(FAST_MODES, fast_rule)}


def replay_of(vector: dict[str, Any]) -> Replay:
    engine_args, params, forwards = RULES[vector["reference"]](vector)
    prompts = vector["prompts"]
    expected = [out[len(p):] for p, out in zip(prompts, vector["outputs"], strict=True)]
    return Replay(engine_args, prompts, [params] * len(prompts), expected,
                  num_forwards=forwards)


# An unrelated request batched with a vector's rows: another prompt, length and schedule.
OTHER_PROMPT = [17, 305, 88, 412, 9, 250, 131, 64, 3]
OTHER_PARAMS = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                              dllm={"algorithm": "threshold", "threshold": 0.8,
                                    "block_size": 4})


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
    """Each row's ``num_forward_passes`` equals the reference's forwards that the rule says
    dllm takes too."""
    replay = replay_of(vector)
    got = [o.num_forward_passes for o in run_alone(vector["name"])]
    assert got == [replay.num_forwards] * len(got), (
        f"{vector['name']}: forwards {got}, reference {replay.num_forwards} "
        f"(recorded {vector['num_forwards']})")
