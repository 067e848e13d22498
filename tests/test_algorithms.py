"""Unmasking algorithms (dllm.algorithms): registry, per-request config, and each step
rule on hand-built logits with known answers."""

from __future__ import annotations

import contextlib
import math
import zlib

import pytest
import torch

from dllm.algorithms import ALGORITHMS, KNOWN_KEYS, get_algorithm
from dllm.algorithms.base import DenoiseInput, DenoiseOutput, SamplingTensors
from dllm.algorithms.dream import dream_timestep
from dllm.algorithms.selection import llada_quota
from dllm.denoise import GRAPH_FLAGS, graph_flags, sampling_flags

V = 10
M = 9  # mask id; tokens 0..8 are real
NEG = float("-inf")


# ---------------------------------------------------------------- builders


def peaked(p: float, token: int, other: int | None = None) -> torch.Tensor:
    """Logits of one position: probability ``p`` on ``token``, ``1 - p`` on ``other``.

    Keep ``p >= 0.5`` so that ``token`` is the argmax."""
    other = (token + 1) % M if other is None else other
    row = torch.full((V,), NEG)
    row[token] = math.log(p)
    if p < 1.0:
        row[other] = math.log(1.0 - p)
    return row


def spread(p: float, token: int) -> torch.Tensor:
    """Probability ``p`` on ``token``, the rest evenly over four other tokens."""
    row = torch.full((V,), NEG)
    others = [t for t in range(M) if t != token][:4]
    row[others] = math.log((1.0 - p) / 4)
    row[token] = math.log(p)
    return row


def logits_of(rows: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.stack([torch.stack(r) for r in rows])


def run(
    name: str,
    logits: torch.Tensor,
    tokens: list[list[int]] | torch.Tensor,
    *,
    editable: list[list[bool]] | torch.Tensor | None = None,
    step: int | list[int] = 0,
    num_initial_masks: list[int] | None = None,
    config: dict | list[dict] | None = None,
    state: dict | None = None,
    temperature: float | list[float] = 0.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    seed: int | list[int] = 0,
    positions: torch.Tensor | None = None,
    flags: tuple[bool, bool, bool] = (True, True, True),
) -> DenoiseOutput:
    algo = get_algorithm(name)
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    bs, block = tokens.shape
    editable = torch.ones(bs, block, dtype=torch.bool) if editable is None else editable
    editable = torch.as_tensor(editable, dtype=torch.bool)
    configs = config if isinstance(config, list) else [config or {}] * bs
    if num_initial_masks is None:
        num_initial_masks = ((tokens == M) & editable).sum(-1).tolist()

    def row(v, dtype):
        return torch.as_tensor(v if isinstance(v, list) else [v] * bs, dtype=dtype)

    x = DenoiseInput(
        logits=logits,
        tokens=tokens,
        editable=editable,
        mask_id=M,
        step=row(step, torch.int64),
        num_initial_masks=row(num_initial_masks, torch.int64),
        positions=torch.arange(block).expand(bs, block) if positions is None else positions,
        sampling=SamplingTensors(
            temperature=row(temperature, torch.float32),
            top_k=row(top_k, torch.int64),
            top_p=row(top_p, torch.float32),
            seed=row(seed, torch.int64),
            may_sample=flags[0], may_filter=flags[1], may_filter_any=flags[2],
        ),
        config=algo.stack_configs([algo.validate(c, block) for c in configs], "cpu"),
        state=algo.init_state(bs, "cpu") if state is None else state,
    )
    return algo.step(x)


def filled(out: DenoiseOutput, row: int = 0) -> list[int]:
    """Positions of ``row`` that hold a real token after the step."""
    return (out.tokens[row] != M).nonzero().flatten().tolist()


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Make every tensor -> host conversion raise (a hook on torch, not on dllm)."""

    def refuse(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name} called in the step path")

        return raiser

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__",
                     "__index__", "nonzero"):  # fmt: skip
            m.setattr(torch.Tensor, name, refuse(name))
        m.setattr(torch, "nonzero", refuse("torch.nonzero"))
        yield


# ---------------------------------------------------------------- registry and config

NAMES = {
    "low_confidence_static",
    "low_confidence_dynamic",
    "threshold",
    "joint_threshold",
    "entropy_bounded",
    "origin",
    "maskgit_plus",
    "topk_margin",
    "entropy",
    "factor",
    "hierarchical",
    "sequential",
    "confidence_threshold",
}


def test_registry_lists_every_algorithm():
    assert set(ALGORITHMS) == NAMES
    for name, cls in ALGORITHMS.items():
        algo = get_algorithm(name)
        assert isinstance(algo, cls) and algo.name == name
        assert set(algo.defaults) <= KNOWN_KEYS


def test_get_algorithm_unknown_lists_names():
    with pytest.raises(ValueError, match="'nope'") as err:
        get_algorithm("nope")
    assert "low_confidence_static" in str(err.value) and "hierarchical" in str(err.value)


def test_known_keys_cover_the_engine_keys():
    engine = {"algorithm", "threshold", "steps_per_block", "edit_threshold",
              "max_post_edit_steps", "eb_gamma", "block_size", "steps", "cfg_scale",
              "cache_mode", "alg_temp", "sub_block_size", "factor", "remasking"}  # fmt: skip
    assert engine <= KNOWN_KEYS


def test_validate_merges_defaults_and_resolves_block_size():
    algo = get_algorithm("low_confidence_static")
    assert algo.validate({}, 32) == {
        "steps_per_block": 32,
        "remasking": "low_confidence",
        "gumbel_fp64": False,
        "all_steps": False,
        "rank_unfiltered": False,
    }
    assert algo.validate({"steps_per_block": 8, "remasking": "random"}, 32)["steps_per_block"] == 8
    assert get_algorithm("maskgit_plus").validate({}, 256) == {"steps": 256, "alg_temp": 0.0}
    assert get_algorithm("joint_threshold").validate({"threshold": 1}, 32) == {
        "threshold": 1.0,
        "edit_threshold": 0.5,
        "max_post_edit_steps": 16,
    }


def test_validate_ignores_known_keys_of_others():
    cfg = {"algorithm": "x", "block_size": 32, "cache_mode": "exact", "cfg_scale": 1.0,
           "threshold": "not read here", "steps": 4}  # fmt: skip
    assert get_algorithm("low_confidence_static").validate(cfg, 32)["steps_per_block"] == 32


def test_validate_rejects_unknown_keys():
    with pytest.raises(ValueError, match="'thresh'"):
        get_algorithm("threshold").validate({"thresh": 0.5}, 32)


@pytest.mark.parametrize(
    "name, key, value",
    [
        ("threshold", "threshold", "0.5"),
        ("threshold", "threshold", True),
        ("threshold", "threshold", None),
        ("threshold", "threshold", float("nan")),
        ("low_confidence_static", "steps_per_block", 2.0),
        ("low_confidence_static", "steps_per_block", True),
        ("low_confidence_static", "remasking", "greedy"),
        ("low_confidence_static", "remasking", 0),
        ("low_confidence_static", "gumbel_fp64", 1),
        ("entropy_bounded", "eb_gamma", float("inf")),
        ("hierarchical", "sub_block_size", 4.0),
    ],
)
def test_validate_rejects_wrong_types(name, key, value):
    with pytest.raises(ValueError, match=f"'{key}'"):
        get_algorithm(name).validate({key: value}, 32)


@pytest.mark.parametrize(
    "name, key, value",
    [
        ("threshold", "threshold", 1.5),
        ("threshold", "threshold", -0.1),
        ("joint_threshold", "edit_threshold", 1.01),
        ("joint_threshold", "max_post_edit_steps", -1),
        ("low_confidence_static", "steps_per_block", -2),
        ("sequential", "steps_per_block", -1),
        ("confidence_threshold", "threshold", 1.5),
        ("low_confidence_dynamic", "steps_per_block", -1),
        ("hierarchical", "sub_block_size", 0),
        ("hierarchical", "sub_block_size", 33),
        ("factor", "factor", 0.0),
        ("entropy_bounded", "eb_gamma", -0.5),
        ("maskgit_plus", "alg_temp", -1.0),
        ("origin", "steps", -3),
    ],
)
def test_validate_rejects_out_of_range(name, key, value):
    with pytest.raises(ValueError, match=f"'{key}'"):
        get_algorithm(name).validate({key: value}, 32)


def test_validate_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        get_algorithm("threshold").validate({}, 0)


def test_stack_configs_dtypes_and_values():
    algo = get_algorithm("low_confidence_static")
    configs = [algo.validate({"steps_per_block": 4}, 8),
               algo.validate({"remasking": "random", "gumbel_fp64": True}, 8)]  # fmt: skip
    stacked = algo.stack_configs(configs, "cpu")
    assert stacked["steps_per_block"].dtype == torch.int64
    assert stacked["steps_per_block"].tolist() == [4, 8]
    assert stacked["remasking"].tolist() == [0, 1]
    assert stacked["gumbel_fp64"].dtype == torch.bool
    assert stacked["gumbel_fp64"].tolist() == [False, True]
    t = get_algorithm("threshold")
    th = t.stack_configs([t.validate({"threshold": 0.25}, 8)], "cpu")["threshold"]
    assert th.dtype == torch.float32 and th.tolist() == [0.25]


def test_init_state_is_zero_int64():
    state = get_algorithm("joint_threshold").init_state(3, "cpu")
    assert set(state) == {"post_edit_steps"}
    assert state["post_edit_steps"].dtype == torch.int64
    assert state["post_edit_steps"].tolist() == [0, 0, 0]
    assert get_algorithm("threshold").init_state(3, "cpu") == {}


# ---------------------------------------------------------------- LLaDA quota


def llada_get_num_transfer_tokens(n: int, steps: int) -> list[int]:
    base, rem = divmod(n, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def test_llada_quota_split_exact():
    def quotas(n, steps):
        t = torch.tensor
        return [llada_quota(t([n]), t([steps]), t([i])).item() for i in range(steps)]

    assert quotas(10, 4) == [3, 3, 2, 2]
    assert quotas(3, 8) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert quotas(32, 32) == [1] * 32
    for n in range(0, 41):
        for steps in range(1, 17):
            assert quotas(n, steps) == llada_get_num_transfer_tokens(n, steps)


# ---------------------------------------------------------------- low_confidence_static

CONF10 = [0.55, 0.95, 0.60, 0.99, 0.70, 0.93, 0.51, 0.80, 0.53, 0.91]


def test_static_transfers_the_quota_by_confidence():
    logits = logits_of([[peaked(p, i % M) for i, p in enumerate(CONF10)]])
    tokens = [[M] * 10]
    cfg = {"steps_per_block": 4}
    order = sorted(range(10), key=lambda i: -CONF10[i])
    seen: list[int] = []
    for step, quota in enumerate([3, 3, 2, 2]):
        out = run("low_confidence_static", logits, tokens, step=step, config=cfg,
                  num_initial_masks=[10])  # fmt: skip
        seen += order[len(seen) : len(seen) + quota]
        assert filled(out) == sorted(seen)
        assert out.num_transferred.tolist() == [quota]
        assert out.done.tolist() == [step == 3]
        assert out.tokens[0, seen].tolist() == [i % M for i in seen]
        tokens = out.tokens


def test_static_ties_go_to_the_lower_position():
    logits = torch.zeros(1, 6, V)
    out = run("low_confidence_static", logits, [[3, M, M, M, M, M]], config={"steps_per_block": 2})
    assert filled(out) == [0, 1, 2, 3]  # quota 5 // 2 + 1 = 3: positions 1, 2, 3


def test_static_never_touches_prompt_or_filled_positions():
    logits = torch.zeros(1, 6, V)
    logits[..., 7] = 5.0
    tokens = [[1, 2, M, 4, M, M]]
    editable = [[False, False, True, True, True, True]]
    out = run("low_confidence_static", logits, tokens, editable=editable,
              config={"steps_per_block": 1})  # fmt: skip
    assert out.tokens.tolist() == [[1, 2, 7, 4, 7, 7]]
    assert out.num_transferred.tolist() == [3] and out.done.tolist() == [True]


def test_static_random_remasking_ignores_confidence():
    logits = logits_of([[peaked(p, 1) for p in CONF10]] * 4)
    tokens = [[M] * 10] * 4
    cfg = {"steps_per_block": 5, "remasking": "random"}
    out = run("low_confidence_static", logits, tokens, config=cfg, seed=[1, 1, 2, 3])
    assert out.num_transferred.tolist() == [2, 2, 2, 2]
    assert torch.equal(out.tokens[0], out.tokens[1])  # same seed, same draw
    picks = {tuple(filled(out, r)) for r in (1, 2, 3)}
    assert len(picks) > 1  # different seeds pick differently
    greedy = run("low_confidence_static", logits[:1], tokens[:1], config={"steps_per_block": 5})
    assert filled(greedy) == [1, 3]


def test_static_gumbel_fp64_greedy_equals_default():
    torch.manual_seed(0)
    logits = torch.randn(2, 8, V)
    tokens = [[M] * 8] * 2
    a = run("low_confidence_static", logits, tokens, config={"steps_per_block": 3})
    b = run("low_confidence_static", logits, tokens,
            config={"steps_per_block": 3, "gumbel_fp64": True})  # fmt: skip
    assert torch.equal(a.tokens, b.tokens)


def test_static_quota_is_the_schedule_and_the_block_ends_with_it():
    """LLaDA/SDAR: the last step takes its own quota (``get_num_transfer_tokens``), not
    whatever is left; the block ends when the schedule does."""
    logits = torch.zeros(1, 6, V)
    logits[..., M] = NEG
    out = run("low_confidence_static", logits, [[M] * 6], step=2, num_initial_masks=[6],
              config={"steps_per_block": 3})  # fmt: skip
    assert out.num_transferred.tolist() == [2] and out.done.tolist() == [True]


def test_static_quota_splits_the_block_length_in_a_prompt_block():
    """SDAR / LLaDA2: the schedule splits the block length even when prompt positions fill
    part of the block, capped by the masks left: the block takes fewer steps."""
    logits = torch.zeros(1, 4, V)
    logits[..., M] = NEG
    editable = [[False, False, True, True]]
    out = run("low_confidence_static", logits, [[1, 2, M, M]], editable=editable,
              config={"steps_per_block": 2})  # quota 4 // 2 = 2: both masks at once
    assert out.num_transferred.tolist() == [2] and out.done.tolist() == [True]
    out = run("low_confidence_static", logits, [[1, 2, 3, M]], editable=[[False] * 3 + [True]],
              step=0, config={"steps_per_block": 2})  # quota 2, capped by the one mask
    assert out.num_transferred.tolist() == [1] and out.done.tolist() == [True]


def test_static_zero_token_steps_and_all_steps():
    """More steps than positions: the later steps have quota 0 (LLaDA). The block ends when
    no mask is left (SDAR, LLaDA2), or with ``all_steps`` only at the last step (LLaDA)."""
    logits = torch.zeros(1, 2, V)
    logits[..., M] = NEG
    cfg = {"steps_per_block": 4}
    first = run("low_confidence_static", logits, [[M, M]], step=0, config=cfg)
    assert first.num_transferred.tolist() == [1] and first.done.tolist() == [False]
    second = run("low_confidence_static", logits, first.tokens, step=1, config=cfg)
    assert second.num_transferred.tolist() == [1] and second.done.tolist() == [True]
    cfg = {**cfg, "all_steps": True}
    second = run("low_confidence_static", logits, first.tokens, step=1, config=cfg)
    assert second.done.tolist() == [False]
    third = run("low_confidence_static", logits, second.tokens, step=2, config=cfg)
    last = run("low_confidence_static", logits, third.tokens, step=3, config=cfg)
    assert third.num_transferred.tolist() == [0] and third.done.tolist() == [False]
    assert last.num_transferred.tolist() == [0] and last.done.tolist() == [True]


def test_the_mask_token_stays_in_the_vocabulary():
    """LLaDA / SDAR / Dream: a position whose argmax is the mask id "transfers" the mask id,
    so it stays masked and is ranked again; the softmax includes the mask token."""
    logits = torch.full((1, 2, V), NEG)
    logits[0, 0, M] = 5.0  # position 0 proposes the mask token
    logits[0, 1, 3] = 1.0
    logits[0, 1, M] = 1.0  # position 1: token 3 and the mask id tie: confidence 0.5
    out = run("low_confidence_static", logits, [[M, M]], config={"steps_per_block": 2})
    assert out.tokens.tolist() == [[M, M]] and out.num_transferred.tolist() == [1]
    assert out.done.tolist() == [False]
    out = run("low_confidence_static", logits, [[M, 7]], step=1, editable=[[True, True]],
              num_initial_masks=[2], config={"steps_per_block": 2})
    assert out.tokens.tolist() == [[M, 7]] and out.done.tolist() == [True]  # schedule over
    conf = run("threshold", logits, [[7, M]], config={"threshold": 0.5})
    assert conf.tokens.tolist() == [[7, 3]]  # 0.5 >= 0.5: the mask's probability counts


def test_sequential_takes_the_leftmost_masks():
    logits = torch.zeros(1, 6, V)
    logits[..., M] = NEG
    tokens = [[1, M, 2, M, M, M]]
    editable = [[False, True, False, True, True, True]]
    out = run("sequential", logits, tokens, editable=editable, config={"steps_per_block": 3})
    assert filled(out) == [0, 1, 2, 3]  # quota 6 // 3 = 2: positions 1 and 3
    assert out.done.tolist() == [False]


# ---------------------------------------------------------------- low_confidence_dynamic


def test_dynamic_takes_everything_above_threshold_when_it_meets_the_quota():
    logits = logits_of([[peaked(p, 2) for p in CONF10]])
    # quota 10 // 4 + 1 = 3; four confidences are above 0.85.
    out = run("low_confidence_dynamic", logits, [[M] * 10],
              config={"threshold": 0.85, "steps_per_block": 4})  # fmt: skip
    assert filled(out) == [1, 3, 5, 9]
    assert out.num_transferred.tolist() == [4]


def test_dynamic_falls_back_to_the_quota():
    logits = logits_of([[peaked(p, 2) for p in CONF10]])
    out = run("low_confidence_dynamic", logits, [[M] * 10],
              config={"threshold": 0.96, "steps_per_block": 4})  # fmt: skip
    assert filled(out) == [1, 3, 5]  # only 0.99 passes; the quota of 3 wins


def test_dynamic_threshold_is_strict():
    logits = torch.zeros(1, 4, V)
    logits[..., 2:] = NEG
    logits[..., :2] = 0.0  # confidence exactly 0.5 everywhere
    out = run("low_confidence_dynamic", logits, [[M] * 4],
              config={"threshold": 0.5, "steps_per_block": 4})  # fmt: skip
    assert filled(out) == [0]


# ---------------------------------------------------------------- threshold


def test_threshold_takes_everything_above():
    logits = logits_of([[peaked(p, 4) for p in [0.95, 0.5, 0.92, 0.6]]])
    out = run("threshold", logits, [[M] * 4], config={"threshold": 0.9})
    assert filled(out) == [0, 2] and out.tokens[0, [0, 2]].tolist() == [4, 4]


def test_threshold_takes_at_least_the_most_confident():
    logits = logits_of([[peaked(p, 4) for p in [0.6, 0.8, 0.7]]])
    out = run("threshold", logits, [[M] * 3], config={"threshold": 0.9})
    assert filled(out) == [1] and out.num_transferred.tolist() == [1]
    assert out.done.tolist() == [False]


def test_threshold_keeps_equality_and_ties_go_low():
    """Fast-dLLM: the top-1 always, the others unless ``conf < threshold``."""
    logits = torch.full((1, 4, V), NEG)
    logits[..., :2] = 0.0  # every confidence is exactly 0.5
    out = run("threshold", logits, [[5, M, M, M]], config={"threshold": 0.5})
    assert out.tokens.tolist() == [[5, 0, 0, 0]]
    out = run("threshold", logits, [[5, M, M, M]], config={"threshold": 0.6})
    assert out.tokens.tolist() == [[5, 0, M, M]]


# ---------------------------------------------------------------- factor


def test_factor_takes_the_passing_prefix():
    # factor 1: n-th best must reach 1 - 1/(n+1): 0.667, 0.75, 0.8, ...
    conf = [0.5, 0.9, 0.55, 0.99, 0.7]
    logits = logits_of([[peaked(p, 6) for p in conf]])
    out = run("factor", logits, [[M] * 5], config={"factor": 1.0})
    assert filled(out) == [1, 3]  # 0.99 (always), 0.9 >= 0.667; 0.7 < 0.75 stops


def test_factor_reproduces_the_last_position_quirk():
    conf = [0.99, 0.9, 0.5]  # the first two pass, only the last fails
    logits = logits_of([[peaked(p, 6) for p in conf]])
    out = run("factor", logits, [[M] * 3], config={"factor": 1.0})
    assert filled(out) == [0, 1, 2]


def test_factor_single_mask_and_large_factor():
    logits = logits_of([[peaked(0.6, 6), peaked(0.55, 6), peaked(0.7, 6)]])
    out = run("factor", logits, [[1, M, 2]])
    assert out.tokens.tolist() == [[1, 6, 2]]
    out = run("factor", logits, [[M] * 3], config={"factor": 10.0})
    assert filled(out) == [0, 1, 2]


# ---------------------------------------------------------------- entropy_bounded


def binary_entropy(p: float) -> float:
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


ENTROPY_P = [0.8, 0.99, 0.6, 0.95, 0.9]  # entropies 0.500, 0.056, 0.673, 0.199, 0.325


@pytest.mark.parametrize("gamma, expected", [(0.0, [1]), (0.06, [1, 3]), (0.3, [1, 3, 4]),
                                             (0.57, [1, 3, 4]), (0.58, [0, 1, 3, 4]),
                                             (5.0, [0, 1, 2, 3, 4])])  # fmt: skip
def test_entropy_bounded_cumulative_rule(gamma, expected):
    h = sorted(binary_entropy(p) for p in ENTROPY_P)
    assert [round(sum(h[:k]), 3) for k in range(5)] == [0.0, 0.056, 0.255, 0.58, 1.08]
    logits = logits_of([[peaked(p, 3) for p in ENTROPY_P]])
    out = run("entropy_bounded", logits, [[M] * 5], config={"eb_gamma": gamma})
    assert filled(out) == expected


def test_entropy_bounded_ties_go_low_and_skip_filled():
    logits = logits_of([[peaked(0.9, 3)] * 5])
    out = run("entropy_bounded", logits, [[0, M, M, M, M]], config={"eb_gamma": 0.4})
    # each entropy is 0.325: the second joins (0.325 <= 0.4), the third does not
    assert out.tokens.tolist() == [[0, 3, 3, M, M]]


# ---------------------------------------------------------------- joint_threshold


def joint_step(logit_rows, tokens, state, step, budget=2, editable=(False, True, True, True)):
    out = run("joint_threshold", logits_of([logit_rows]), [tokens], editable=[list(editable)],
              step=step, state=state,
              config={"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": budget})  # fmt: skip
    return out, out.tokens[0].tolist()


def test_joint_threshold_fill_edit_and_post_phase():
    state = {"post_edit_steps": torch.zeros(1, dtype=torch.int64)}
    # Step 0: the prompt position disagrees with the model at 0.99 but is never edited.
    out, tokens = joint_step([peaked(0.99, 3), peaked(0.8, 1), peaked(0.6, 2), peaked(0.65, 3)],
                             [7, M, M, M], state, 0)  # fmt: skip
    assert tokens == [7, 1, M, M]
    assert out.num_transferred.tolist() == [1] and out.done.tolist() == [False]
    # Step 1: an edit during the fill phase (1 -> 4 at 0.9), one fill at 0.75.
    out, tokens = joint_step([peaked(0.99, 3), peaked(0.9, 4), peaked(0.75, 2), peaked(0.5, 3)],
                             tokens, out.state, 1)  # fmt: skip
    assert tokens == [7, 4, 2, M]
    assert out.num_transferred.tolist() == [1] and out.done.tolist() == [False]
    # Step 2: nothing above 0.7; the best mask fills. No mask left, but a verifying
    # post-fill forward follows. Agreeing or weak predictions are not edits.
    out, tokens = joint_step([peaked(0.99, 3), peaked(0.99, 4), spread(0.4, 6), peaked(0.6, 3)],
                             tokens, out.state, 2)  # fmt: skip
    assert tokens == [7, 4, 2, 3]
    assert out.done.tolist() == [False] and out.state["post_edit_steps"].tolist() == [0]
    # Step 3 (post-fill 1 of 2): an edit, so not done.
    out, tokens = joint_step([peaked(0.99, 3), peaked(0.99, 4), peaked(0.6, 5), peaked(0.9, 3)],
                             tokens, out.state, 3)  # fmt: skip
    assert tokens == [7, 4, 5, 3]
    assert out.num_transferred.tolist() == [0] and out.done.tolist() == [False]
    assert out.state["post_edit_steps"].tolist() == [1]
    # Step 4 (post-fill 2 of 2): it edits, and the budget is spent.
    out, tokens = joint_step([peaked(0.99, 3), peaked(0.99, 4), peaked(0.6, 6), peaked(0.9, 3)],
                             tokens, out.state, 4)  # fmt: skip
    assert tokens == [7, 4, 6, 3]
    assert out.done.tolist() == [True] and out.state["post_edit_steps"].tolist() == [2]


def test_joint_threshold_post_step_without_edit_is_done():
    state = {"post_edit_steps": torch.zeros(1, dtype=torch.int64)}
    out, tokens = joint_step([peaked(0.99, 3), peaked(0.99, 4), spread(0.45, 6), peaked(0.9, 3)],
                             [7, 4, 2, 3], state, 5)  # fmt: skip
    assert tokens == [7, 4, 2, 3] and out.done.tolist() == [True]


def test_joint_threshold_zero_budget_finishes_on_fill():
    state = {"post_edit_steps": torch.zeros(1, dtype=torch.int64)}
    out, tokens = joint_step([peaked(0.99, 3), peaked(0.99, 4), peaked(0.9, 6), peaked(0.9, 3)],
                             [7, 4, 2, M], state, 0, budget=0)  # fmt: skip
    assert tokens == [7, 4, 6, 3]  # the edit of the fill step still applies
    assert out.done.tolist() == [True]


def test_joint_threshold_beyond_budget_makes_no_edit():
    state = {"post_edit_steps": torch.tensor([2])}
    out, tokens = joint_step([peaked(0.99, 3), peaked(0.99, 5), peaked(0.99, 6), peaked(0.9, 5)],
                             [7, 4, 2, 3], state, 9)  # fmt: skip
    assert tokens == [7, 4, 2, 3] and out.done.tolist() == [True]


# ---------------------------------------------------------------- hierarchical


def test_hierarchical_decodes_only_the_first_open_sub_block():
    conf = [0.5, 0.6, 0.55, 0.4, 0.99, 0.99, 0.99, 0.99]
    logits = logits_of([[peaked(p, 2) for p in conf]])
    cfg = {"sub_block_size": 4, "threshold": 0.9}
    out = run("hierarchical", logits, [[M] * 8], config=cfg)
    assert filled(out) == [1]  # at least one, from sub-block 0 only
    out = run("hierarchical", logits, [[1, 1, 1, 1, M, M, 5, M]], config=cfg)
    assert out.tokens.tolist() == [[1, 1, 1, 1, 2, 2, 5, 2]] and out.done.tolist() == [True]


def test_hierarchical_partial_last_sub_block_and_done():
    logits = logits_of([[peaked(0.95, 2)] * 6])
    cfg = {"sub_block_size": 4, "threshold": 0.9}
    out = run("hierarchical", logits, [[1, 1, 1, 1, M, M]], config=cfg)
    assert out.tokens.tolist() == [[1, 1, 1, 1, 2, 2]] and out.done.tolist() == [True]
    out = run("hierarchical", logits, [[1, M, 1, 1, M, M]], config=cfg)
    assert out.tokens.tolist() == [[1, 2, 1, 1, M, M]] and out.done.tolist() == [False]


# ---------------------------------------------------------------- Dream schedules


def dream_counts_reference(n: int, steps: int) -> list[int]:
    """Dream's ``number_transfer_tokens`` of each of its ``steps`` steps (0 allowed)."""
    timesteps = torch.linspace(1, 1e-3, steps + 1)
    counts = []
    for i in range(steps):
        k = (
            int(torch.tensor(float(n)) * (1 - timesteps[i + 1] / timesteps[i]))
            if i < steps - 1
            else n
        )
        counts.append(k)
        n -= k
    return counts


def run_dream(name, n, steps, config=None, seed=0):
    logits = torch.randn(1, n, V, generator=torch.Generator().manual_seed(seed))
    logits[..., M] = NEG  # the schedule alone (no proposal of the mask token)
    tokens = torch.full((1, n), M)
    counts = []
    for i in range(steps + 1):
        out = run(name, logits, tokens, step=i, config={"steps": steps, **(config or {})},
                  seed=seed, num_initial_masks=[n])  # fmt: skip
        counts.append(out.num_transferred.item())
        tokens = out.tokens
        if out.done.item():
            return counts
    raise AssertionError("did not finish")


def test_dream_timestep_is_linspace():
    for steps in [1, 2, 3, 7, 8, 64, 255, 256, 512]:
        ref = torch.linspace(1, 1e-3, steps + 1)
        got = dream_timestep(torch.arange(steps + 1), torch.full((steps + 1,), steps))
        # the CPU kernel vectorises with another rounding; CUDA's is matched bit for bit
        assert (got - ref).abs().max() <= 6e-8


def test_dream_timestep_matches_cuda_values_on_any_device():
    # torch.linspace(1, 1e-3, steps + 1, device="cuda")[index] read on an H200 (torch 2.11)
    cuda = {
        11: {1: 0.9091818332672119, 2: 0.8183636665344238, 5: 0.5459091067314148,
             10: 0.0918181836605072},
        256: {1: 0.9960976839065552, 2: 0.9921953082084656, 128: 0.5005000233650208,
              255: 0.0049023437313735485},
    }  # fmt: skip
    for steps, values in cuda.items():
        index = torch.tensor(list(values))
        got = dream_timestep(index, torch.full_like(index, steps))
        assert torch.equal(got, torch.tensor(list(values.values()), dtype=torch.float32))


def test_dream_transfer_counts():
    assert run_dream("maskgit_plus", 8, 4) == [1, 2, 2, 3]
    # Dream's int(...) is 0 on the first steps here; the block still takes its 4 forwards.
    assert run_dream("maskgit_plus", 4, 4) == [0, 1, 1, 2]
    assert run_dream("entropy", 3, 6) == dream_counts_reference(3, 6)
    for name in ("maskgit_plus", "topk_margin", "entropy"):
        for n, steps in [(16, 8), (32, 32), (32, 5), (7, 12), (64, 16)]:
            assert run_dream(name, n, steps) == dream_counts_reference(n, steps)


def test_dream_ranking_signals_differ():
    # A: [0.5, 0.5]; B: 0.45 on token 3, the rest spread over seven tokens.
    a = torch.full((V,), NEG)
    a[0] = a[1] = math.log(0.5)
    b = torch.full((V,), math.log(0.55 / 7))
    b[3], b[M], b[4] = math.log(0.45), NEG, NEG
    b[5] = math.log(0.55 / 7)
    c = torch.zeros(V)  # uniform over the nine real tokens: last by every signal
    c[M] = NEG
    logits = logits_of([[a, b, c, c]])
    one = {"steps": 2}  # first of two steps: int(4 * 0.4995) = 1
    assert filled(run("maskgit_plus", logits, [[M] * 4], config=one)) == [0]
    assert filled(run("topk_margin", logits, [[M] * 4], config=one)) == [1]
    assert filled(run("entropy", logits, [[M] * 4], config=one)) == [0]


def test_graph_flags_keep_dream_filters_on_greedy_rows():
    """A greedy batch whose row sets top-p replays a graph keyed by flags that still filter:
    Dream's top-p applies at temperature 0 (the truncated distribution's entropy ranks)."""
    # b: 0.7 on token 3, the rest over the eight other real tokens; a: 0.6 / 0.4
    b = torch.full((V,), math.log(0.3 / 8))
    b[3], b[M] = math.log(0.7), NEG
    a = torch.full((V,), NEG)
    a[0], a[1] = math.log(0.6), math.log(0.4)
    c = torch.zeros(V)  # uniform over the nine real tokens: last by every signal
    c[M] = NEG
    logits = logits_of([[b, a, c, c]])
    one = {"steps": 2}  # one position this step
    rows = {"temperature": [0.0], "top_k": [0], "top_p": [0.5]}
    flags = graph_flags(rows)
    assert flags == sampling_flags(rows) == (False, False, True)
    exact = run("entropy", logits, [[M] * 4], config=one, top_p=0.5)
    keyed = run("entropy", logits, [[M] * 4], config=one, top_p=0.5, flags=flags)
    # top-p 0.5 leaves b and a one token each: entropy 0, the tie to the lower position
    assert filled(exact) == filled(keyed) == [0]
    # the plain greedy graph skips the filter (a wins on its unfiltered entropy): the key
    # this batch must not take
    assert filled(run("entropy", logits, [[M] * 4], config=one, top_p=0.5,
                      flags=GRAPH_FLAGS[0])) == [1]
    assert graph_flags({"temperature": [0.0], "top_k": [0], "top_p": [1.0]}) == GRAPH_FLAGS[0]
    assert graph_flags({"temperature": [0.7, 0.0], "top_k": [0, 5], "top_p": [1.0, 1.0]}
                       ) == GRAPH_FLAGS[1]


def test_dream_alg_temp_draws_positions():
    torch.manual_seed(1)
    logits = torch.randn(16, 12, V)
    tokens = [[M] * 12] * 16
    cfg = {"steps": 3, "alg_temp": 0.5}
    a = run("maskgit_plus", logits, tokens, config=cfg, seed=list(range(16)))
    b = run("maskgit_plus", logits, tokens, config=cfg, seed=list(range(16)))
    greedy = run("maskgit_plus", logits, tokens, config={"steps": 3})
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.num_transferred, greedy.num_transferred)  # same schedule
    assert not torch.equal(a.tokens, greedy.tokens)


def test_dream_origin_transfers_by_coin_and_finishes():
    logits = torch.zeros(64, 32, V)
    tokens = torch.full((64, 32), M)
    out = run("origin", logits, tokens, config={"steps": 4}, seed=list(range(64)))
    rate = out.num_transferred.sum().item() / (64 * 32)
    assert abs(rate - 0.24975) < 0.02  # 1 - s/t at the first of four steps
    assert (out.num_transferred >= 1).all()
    again = run("origin", logits, tokens, config={"steps": 4}, seed=list(range(64)))
    assert torch.equal(out.tokens, again.tokens)
    last = run("origin", logits, out.tokens, step=3, config={"steps": 4})
    assert last.done.all() and (last.tokens != M).all()


def test_dream_origin_may_transfer_nothing():
    logits = torch.zeros(1, 2, V)
    logits[..., M] = NEG
    # p = 1 - s/t is tiny at the first of 1000 steps: Dream's coins rarely land.
    moved = [run("origin", logits, [[M, M]], config={"steps": 1000}, seed=seed)
             .num_transferred.item() for seed in range(20)]
    assert moved.count(0) >= 18


# ---------------------------------------------------------------- properties of all


def random_case(seed: int, bs: int = 5, block: int = 12):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((bs, block), M)
    editable = torch.ones(bs, block, dtype=torch.bool)
    editable[1, :5] = False  # prompt positions inside the block
    tokens[1, :5] = torch.tensor([1, 2, 3, 4, 5])
    tokens[2, 3] = 6  # an already-filled generated position
    editable[3, :11] = False  # a single generated position
    tokens[3, :11] = 2
    return g, tokens, editable


CONFIGS = {
    "low_confidence_static": [{"steps_per_block": 4}, {"remasking": "random"},
                              {"gumbel_fp64": True, "steps_per_block": 5},
                              {"steps_per_block": 20, "all_steps": True}],
    "low_confidence_dynamic": [{"steps_per_block": 3, "threshold": 0.5}],
    "sequential": [{"steps_per_block": 5}],
    "threshold": [{"threshold": 0.3}, {}],
    "joint_threshold": [{"threshold": 0.4, "edit_threshold": 0.2, "max_post_edit_steps": 3}],
    "entropy_bounded": [{"eb_gamma": 1.0}],
    "origin": [{"steps": 6}],
    "maskgit_plus": [{"steps": 5}, {"steps": 4, "alg_temp": 0.3}],
    "topk_margin": [{"steps": 5}],
    "entropy": [{"steps": 50}],
    "confidence_threshold": [{"steps": 1, "threshold": 0.5}],  # its masks % steps == 0
    "factor": [{"factor": 2.0}],
    "hierarchical": [{"sub_block_size": 4, "threshold": 0.5}],
}  # fmt: skip
# Rules that move at least one masked position every step (the threshold family); the
# scheduled ones (LLaDA, SDAR, Dream) may take zero-token steps, as their references do.
AT_LEAST_ONE = {"threshold", "joint_threshold", "entropy_bounded", "factor", "hierarchical"}
# Rules whose block ends exactly at the last scheduled step (Dream: exactly ``steps`` forwards).
EXACT_STEPS = {"origin", "maskgit_plus", "topk_margin", "entropy"}


def step_bound(name: str, cfg: dict, block: int) -> int:
    if name in ("low_confidence_static", "low_confidence_dynamic", "sequential"):
        return cfg.get("steps_per_block", block)
    if name in EXACT_STEPS:
        return cfg.get("steps", block)
    if name == "confidence_threshold":
        return 2 * block
    if name == "joint_threshold":
        return block + cfg.get("max_post_edit_steps", 16) + 1
    return block


@pytest.mark.parametrize("name", sorted(NAMES))
def test_step_invariants_progress_and_termination(name):
    """With logits that never propose the mask token: prompt and filled positions never
    change, every masked position is filled by the end, the threshold family moves at least
    one position a step, and each rule ends its block as its reference does."""
    for case, cfg in enumerate(CONFIGS[name]):
        g, tokens, editable = random_case(case)
        bs, block = tokens.shape
        n0 = ((tokens == M) & editable).sum(-1).tolist()
        state = get_algorithm(name).init_state(bs, "cpu")
        done = torch.zeros(bs, dtype=torch.bool)
        bound = step_bound(name, cfg, block)
        for step in range(bound):
            logits = torch.randn(bs, block, V, generator=g) * 2.5
            logits[..., M] = NEG
            out = run(name, logits, tokens, editable=editable, step=step, config=cfg, state=state,
                      num_initial_masks=n0, temperature=[0.0, 1.0, 0.7, 1.0, 0.0],
                      top_k=[0, 0, 4, 0, 0], top_p=[1.0, 0.9, 1.0, 1.0, 1.0],
                      seed=[1, 2, 3, 4, 5])  # fmt: skip
            masked = (tokens == M) & editable
            # never touches prompt positions; never un-masks into the mask id
            assert torch.equal(out.tokens[~editable], tokens[~editable])
            assert not ((out.tokens == M) & ~masked).any()
            changed = out.tokens != tokens
            if name != "joint_threshold":
                assert not (changed & ~masked).any(), "a non-masked position changed"
            fills = (changed & masked).sum(-1)
            assert torch.equal(out.num_transferred, fills)
            live = ~done
            left = ((out.tokens == M) & editable).any(-1)
            if name in AT_LEAST_ONE:
                assert (fills[live & masked.any(-1)] >= 1).all(), "no progress"
            if name in EXACT_STEPS:
                assert torch.equal(out.done, torch.full_like(out.done, step + 1 == bound))
            elif name == "joint_threshold" or (name == "low_confidence_static"
                                                 and cfg.get("all_steps")):
                assert not (out.done & left).any()
            elif name != "confidence_threshold":
                assert torch.equal(out.done, ~left)
            # rows already done are not stepped again (as in the engine)
            tokens = torch.where(done[:, None], tokens, out.tokens)
            state = {k: torch.where(done, state[k], v) for k, v in out.state.items()}
            done |= out.done
            if done.all():
                break
        assert done.all(), f"{name} {cfg}: not done within {step + 1} steps"
        assert not ((tokens == M) & editable).any()


def batch_invariance_case(name: str):
    torch.manual_seed(7)
    bs, block = 6, 8
    logits = torch.randn(bs, block, V) * 2
    tokens = torch.full((bs, block), M)
    tokens[2, :3] = 4
    tokens[4, ::2] = 1
    editable = torch.ones(bs, block, dtype=torch.bool)
    editable[2, :3] = False
    configs = CONFIGS[name] * bs
    state = None
    if name == "joint_threshold":
        state = {"post_edit_steps": torch.tensor([0, 1, 0, 2, 0, 1])}
    return dict(
        logits=logits, tokens=tokens, editable=editable, step=[0, 1, 2, 0, 1, 3],
        config=configs[:bs], state=state, temperature=[0.0, 1.0, 0.5, 1.0, 0.0, 2.0],
        top_k=[0, 3, 0, 0, 2, 0], top_p=[1.0, 1.0, 0.8, 0.9, 1.0, 1.0], seed=[5, 6, 7, 8, 9, 10],
        positions=torch.stack([torch.arange(block) + 8 * r for r in range(bs)]),
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(NAMES))
def test_step_is_batch_invariant(name):
    case = batch_invariance_case(name)
    full = run(name, **case)
    for r in range(6):
        one = {}
        for k, v in case.items():
            if isinstance(v, torch.Tensor):
                one[k] = v[r : r + 1]
            elif isinstance(v, list):
                one[k] = v[r : r + 1]
            elif isinstance(v, dict):
                one[k] = {s: t[r : r + 1] for s, t in v.items()}
            else:
                one[k] = v
        alone = run(name, **one)
        assert torch.equal(alone.tokens[0], full.tokens[r])
        assert torch.equal(alone.done[0], full.done[r])
        assert torch.equal(alone.num_transferred[0], full.num_transferred[r])
        for k in full.state:
            assert torch.equal(alone.state[k][0], full.state[k][r])


@pytest.mark.parametrize("name", sorted(NAMES))
def test_step_makes_no_host_sync(name, monkeypatch):
    case = batch_invariance_case(name)
    algo = get_algorithm(name)
    configs = [algo.validate(c, 8) for c in case["config"]]
    stacked = algo.stack_configs(configs, "cpu")
    x = DenoiseInput(
        logits=case["logits"].bfloat16(),
        tokens=case["tokens"],
        editable=case["editable"],
        mask_id=M,
        step=torch.tensor(case["step"]),
        num_initial_masks=((case["tokens"] == M) & case["editable"]).sum(-1),
        positions=case["positions"],
        sampling=SamplingTensors(
            temperature=torch.tensor(case["temperature"]),
            top_k=torch.tensor(case["top_k"]),
            top_p=torch.tensor(case["top_p"]),
            seed=torch.tensor(case["seed"]),
        ),
        config=stacked,
        state=case["state"] or algo.init_state(6, "cpu"),
    )
    with no_host_sync(monkeypatch):
        out = algo.step(x)
    assert out.tokens.shape == (6, 8) and out.done.shape == (6,)


# ---------------------------------------------------------------- on the device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dream_timestep_matches_cuda_linspace_bitwise():
    for steps in range(1, 1025):
        ref = torch.linspace(1, 1e-3, steps + 1, device="cuda")
        idx = torch.arange(steps + 1, device="cuda")
        got = dream_timestep(idx, torch.full_like(idx, steps))
        assert torch.equal(got, ref), steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(NAMES))
def test_step_is_sync_free_and_graph_capturable_on_cuda(name):
    case = batch_invariance_case(name)
    algo = get_algorithm(name)
    dev = torch.device("cuda")
    configs = [algo.validate(c, 8) for c in case["config"]]

    def build():
        return DenoiseInput(
            logits=case["logits"].to(dev, torch.bfloat16),
            tokens=case["tokens"].to(dev),
            editable=case["editable"].to(dev),
            mask_id=M,
            step=torch.tensor(case["step"], device=dev),
            num_initial_masks=((case["tokens"] == M) & case["editable"]).sum(-1).to(dev),
            positions=case["positions"].to(dev),
            sampling=SamplingTensors(
                temperature=torch.tensor(case["temperature"], device=dev),
                top_k=torch.tensor(case["top_k"], device=dev),
                top_p=torch.tensor(case["top_p"], device=dev),
                seed=torch.tensor(case["seed"], device=dev),
            ),
            config=algo.stack_configs(configs, dev),
            state={k: v.to(dev) for k, v in (case["state"] or algo.init_state(6, dev)).items()},
        )

    x = build()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = algo.step(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        algo.step(x)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = algo.step(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.tokens, eager.tokens)
    assert torch.equal(captured.done, eager.done)
    assert torch.equal(captured.num_transferred, eager.num_transferred)


# ---------------------------------------------------------------- parity with the references
#
# Greedy decoding of one block against loops re-implementing each reference's rule in
# float64, with a stand-in model whose logits depend on the whole current block.


def fake_model(tokens: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` float32 logits, a deterministic function of the block's tokens."""
    seed = zlib.crc32(bytes(str(tokens.tolist()), "ascii"))
    logits = torch.randn(tokens.numel(), V, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, M] = NEG  # a trained model never proposes the mask token
    return logits


def decode_with(name: str, tokens: list[int], config: dict, editable=None, max_steps=100):
    x = torch.tensor([tokens])
    editable = (
        torch.ones_like(x, dtype=torch.bool) if editable is None else torch.tensor([editable])
    )
    n0 = ((x == M) & editable).sum().item()
    state = None
    for step in range(max_steps):
        out = run(name, fake_model(x[0])[None], x, editable=editable, step=step, config=config,
                  state=state, num_initial_masks=[n0])  # fmt: skip
        x, state = out.tokens, out.state
        if out.done.item():
            return x[0].tolist(), step + 1
    raise AssertionError("did not finish")


def greedy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = fake_model(x).double()
    probs = torch.softmax(logits, -1)
    x0 = logits.argmax(-1)
    return x0, probs.gather(-1, x0[:, None]).squeeze(-1), probs


def ref_llada(tokens: list[int], steps: int):
    x = torch.tensor(tokens)
    quotas = llada_get_num_transfer_tokens(int((x == M).sum()), steps)
    for i in range(steps):
        x0, p, _ = greedy(x)
        conf = torch.where(x == M, p, NEG)
        idx = torch.topk(conf, quotas[i]).indices
        x[idx] = x0[idx]
    return x.tolist(), steps


def ref_sdar_dynamic(tokens: list[int], steps: int, threshold: float, rewrite: bool = True):
    """SDAR's loop. With ``rewrite`` (as SDAR) a quota larger than the masks left makes
    its top-k pick already-decoded positions and overwrite them."""
    x = torch.tensor(tokens)
    quotas = llada_get_num_transfer_tokens(len(tokens), steps)
    for i in range(steps + 1):
        if not (x == M).any():
            return x.tolist(), i
        x0, p, _ = greedy(x)
        conf = torch.where(x == M, p, NEG)
        quota = quotas[i] if rewrite else min(quotas[i], int((x == M).sum()))
        high = conf > threshold
        if high.sum() >= quota:
            transfer = high
        else:
            transfer = torch.zeros_like(high)
            transfer[torch.topk(conf, quota).indices] = True
        x[transfer] = x0[transfer]
    raise AssertionError


def ref_fast_dllm(tokens: list[int], threshold: float | None = None, factor: float | None = None):
    x, forwards = torch.tensor(tokens), 0
    while (x == M).any():
        forwards += 1
        x0, p, _ = greedy(x)
        mask = x == M
        conf = torch.where(mask, p, NEG)
        n = int(mask.sum())
        if factor is None:
            order = torch.topk(conf, n).indices
            keep = [order[0]] + [j for j in order[1:] if conf[j] >= threshold]
        else:
            bounds = [-1.0] + [1 - factor / (k + 1) for k in range(2, n + 1)]
            ordered = torch.sort(conf[mask], descending=True).values
            for top in range(n):
                if ordered[top] < bounds[top]:
                    break
            if top == 0 or top == n - 1:
                top += 1
            keep = torch.topk(conf, top).indices
        for j in keep:
            x[j] = x0[j]
    return x.tolist(), forwards


def ref_joint(tokens: list[int], prompt: list[bool], threshold, edit_threshold, budget):
    x, post, forwards = torch.tensor(tokens), 0, 0
    prompt = torch.tensor(prompt)
    while True:
        mask = x == M
        if not mask.any():
            post += 1
            if post > budget:
                return x.tolist(), forwards
        forwards += 1
        x0, p, _ = greedy(x)
        fill = torch.zeros_like(mask)
        if mask.any():
            conf = torch.where(mask, p, NEG)
            fill = conf > threshold
            if not fill.any():
                fill[conf.argmax()] = True
        edit = (p > edit_threshold) & (x != x0) & ~mask & ~prompt
        if not (fill | edit).any():
            return x.tolist(), forwards
        x[fill | edit] = x0[fill | edit]


def ref_eb(tokens: list[int], gamma: float):
    x, forwards = torch.tensor(tokens), 0
    while (x == M).any():
        forwards += 1
        x0, _, probs = greedy(x)
        where = (x == M).nonzero().flatten()
        h = torch.special.entr(probs[where]).sum(-1)
        order = torch.argsort(h)
        reveal = torch.ones_like(order, dtype=torch.bool)
        reveal[1:] = torch.cumsum(h[order][:-1], 0) <= gamma
        chosen = where[order[reveal]]
        x[chosen] = x0[chosen]
    return x.tolist(), forwards


def ref_fast_dllm_v2(tokens: list[int], sub: int, threshold: float):
    x, forwards = torch.tensor(tokens), 0
    for start in range(0, len(tokens), sub):
        while (x[start : start + sub] == M).any():
            forwards += 1
            x0, p, _ = greedy(x)
            mask = torch.zeros_like(x, dtype=torch.bool)
            mask[start : start + sub] = x[start : start + sub] == M
            conf = torch.where(mask, p, NEG)
            unmask = conf > threshold
            unmask[conf.argmax()] = True
            unmask &= mask
            x[unmask] = x0[unmask]
    return x.tolist(), forwards


def ref_dream(tokens: list[int], steps: int, alg: str):
    x = torch.tensor(tokens)
    timesteps = torch.linspace(1, 1e-3, steps + 1)
    for i in range(steps):
        mask = x == M
        probs = torch.softmax(fake_model(x), -1)[mask]
        conf, x0 = probs.max(-1)
        if alg == "topk_margin":
            top2 = probs.sort(-1, descending=True).values
            conf = top2[:, 0] - top2[:, 1]
        elif alg == "entropy":
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)
        n = mask.sum() / 1
        count = int(n * (1 - timesteps[i + 1] / timesteps[i])) if i < steps - 1 else int(n)
        assert count >= 1, "pick a case where Dream's own count is never 0"
        full = torch.full(x.shape, NEG)
        full[mask] = conf
        idx = torch.topk(full, count).indices
        proposal = torch.full_like(x, M)
        proposal[mask] = x0
        x[idx] = proposal[idx]
    return x.tolist(), steps


BLOCK16 = [M] * 16


def test_parity_llada_low_confidence_static():
    for fp64 in (False, True):
        cfg = {"steps_per_block": 8, "gumbel_fp64": fp64}
        assert decode_with("low_confidence_static", BLOCK16, cfg) == ref_llada(BLOCK16, 8)
    assert decode_with("low_confidence_static", BLOCK16, {"steps_per_block": 5}) == ref_llada(
        BLOCK16, 5
    )


def test_parity_sdar_low_confidence_dynamic():
    for steps in (4, 16):
        for threshold in (0.3, 0.6, 0.9):
            cfg = {"steps_per_block": steps, "threshold": threshold}
            got = decode_with("low_confidence_dynamic", BLOCK16, cfg)
            assert got == ref_sdar_dynamic(BLOCK16, steps, threshold, rewrite=False)
            if steps == 16 or threshold != 0.6:
                assert got == ref_sdar_dynamic(BLOCK16, steps, threshold)
    # Deviation: at 4 steps and threshold 0.6 SDAR's top-k rewrites a decoded token.
    cfg = {"steps_per_block": 4, "threshold": 0.6}
    assert decode_with("low_confidence_dynamic", BLOCK16, cfg) != ref_sdar_dynamic(BLOCK16, 4, 0.6)


def test_parity_fast_dllm_threshold_and_factor():
    for threshold in (0.3, 0.5, 0.9):
        got = decode_with("threshold", BLOCK16, {"threshold": threshold})
        assert got == ref_fast_dllm(BLOCK16, threshold=threshold)
    for factor in (0.5, 1.0, 2.0):
        assert decode_with("factor", BLOCK16, {"factor": factor}) == ref_fast_dllm(
            BLOCK16, factor=factor
        )


def test_parity_llada21_joint_threshold():
    tokens = [3, 5, 1] + [M] * 13
    editable = [False] * 3 + [True] * 13
    for threshold, edit, budget in [(0.5, 0.0, 16), (0.7, 0.5, 16), (0.5, 0.3, 2), (0.9, 0.9, 0)]:
        cfg = {"threshold": threshold, "edit_threshold": edit, "max_post_edit_steps": budget}
        got_tokens, got_steps = decode_with("joint_threshold", tokens, cfg, editable=editable)
        ref_tokens, ref_steps = ref_joint(
            tokens, [not e for e in editable], threshold, edit, budget
        )
        assert got_tokens == ref_tokens
        # the reference ends with a forward that changes nothing; ours reports done one
        # step earlier when the budget runs out after an edit
        assert got_steps in (ref_steps, ref_steps - 1)


def test_parity_eb_sampler():
    for gamma in (0.01, 0.5, 2.0):
        assert decode_with("entropy_bounded", BLOCK16, {"eb_gamma": gamma}) == ref_eb(
            BLOCK16, gamma
        )


def test_parity_fast_dllm_v2_hierarchical():
    for threshold in (0.5, 0.9):
        cfg = {"sub_block_size": 4, "threshold": threshold}
        assert decode_with("hierarchical", BLOCK16, cfg) == ref_fast_dllm_v2(BLOCK16, 4, threshold)


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_parity_dream(alg):
    for steps in (2, 4, 6):
        assert decode_with(alg, BLOCK16, {"steps": steps}) == ref_dream(BLOCK16, steps, alg)
