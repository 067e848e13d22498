"""The fused greedy draw (``dllm.runner.kernels.greedy_kernel``, Triton) against the reference
path of ``sample_tokens`` (marker ``gpu``; skipped without CUDA and Triton)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from dllm.algorithms import get_algorithm
from dllm.algorithms.base import SamplingTensors
from dllm.algorithms.sampling import log_confidence, sample_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

V = 151936  # Qwen's vocabulary: slices of unequal fill, a ragged last chunk


def greedy(bs: int, dev, may_sample: bool) -> SamplingTensors:
    z = torch.zeros(bs, device=dev)
    return SamplingTensors(z, z.long(), z + 1, z.long(), may_sample=may_sample,
                           may_filter=may_sample)


def draw(x: torch.Tensor, may_sample: bool):
    bs, b = x.shape[:2]
    pos = torch.arange(bs * b, device=x.device).view(bs, b)
    step = torch.zeros(bs, dtype=torch.int64, device=x.device)
    return sample_tokens(x, greedy(bs, x.device, may_sample), pos, step, exclude_id=7)


def logits_case(dev) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(6, 4, V, generator=g, device=dev) * 3).bfloat16()
    x[0, 0, 7] = 40.0  # a confidence of 1 - tiny
    x[0, 1, 7] = 60.0  # the excluded id is the largest: never proposed
    x[1, 0] = 1.0  # all tied: the lowest id wins, confidence 1/(V-1)
    x[1, 1, 100_000] = x[1, 1, 150_000] = 30.0  # a tie across slices
    x[2, 2, -1] = 30.0  # the last id
    x[3, 3, :] = -math.inf  # one row of -inf but the first id
    x[3, 3, 0] = 0.0
    return x


def test_fused_greedy_matches_the_reference_path():
    dev = torch.device("cuda")
    x = logits_case(dev)
    fused, ref = draw(x, False), draw(x, True)
    assert not isinstance(fused._logprobs, torch.Tensor)  # the fused path ran
    assert torch.equal(fused.x0, ref.x0)
    assert fused.x0[1, 1].item() == 100_000 and fused.x0[2, 2].item() == V - 1
    assert fused.x0[1, 0].item() == 0 and fused.x0[3, 3].item() == 0
    assert (fused.x0 != 7).all()
    lc, rc = log_confidence(fused), log_confidence(ref)
    assert torch.isfinite(lc).all()
    torch.testing.assert_close(lc, rc, rtol=2e-6, atol=1e-7)
    assert lc[0, 0].item() < 0  # 1 - tiny keeps a distinct log-probability
    torch.testing.assert_close(fused.confidence, ref.confidence, rtol=2e-6, atol=1e-7)
    # logprobs on demand: the reference's own
    assert torch.equal(fused.logprobs, ref.logprobs)


def test_fused_greedy_row_is_independent_of_the_batch():
    dev = torch.device("cuda")
    x = logits_case(dev)
    full = draw(x, False)
    for r in range(6):
        alone = draw(x[r:r + 1].clone(), False)
        assert torch.equal(alone.x0[0], full.x0[r])
        assert torch.equal(alone.log_conf[0], full.log_conf[r])
    again = draw(x, False)
    assert torch.equal(again.log_conf, full.log_conf)


@pytest.mark.parametrize("name", ["low_confidence_static", "low_confidence_dynamic",
                                  "threshold", "entropy_bounded"])
def test_greedy_step_with_and_without_the_fused_draw(name):
    """A greedy unmasking step takes the same positions either way (its scores agree to
    float32 rounding; these logits have no near ties)."""
    from dllm.algorithms.base import DenoiseInput

    dev = torch.device("cuda")
    algo = get_algorithm(name)
    g = torch.Generator(device=dev).manual_seed(1)
    bs, b, mask = 4, 8, 5
    logits = (torch.randn(bs, b, 4096, generator=g, device=dev) * 4).bfloat16()
    tokens = torch.full((bs, b), mask, device=dev)
    tokens[:, :2] = 11
    configs = [algo.validate({}, b) for _ in range(bs)]
    outs = []
    for may_sample in (False, True):
        x = DenoiseInput(
            logits=logits, tokens=tokens, editable=torch.ones(bs, b, dtype=torch.bool,
                                                              device=dev),
            mask_id=mask, step=torch.zeros(bs, dtype=torch.int64, device=dev),
            num_initial_masks=torch.full((bs,), b - 2, device=dev),
            positions=torch.arange(bs * b, device=dev).view(bs, b),
            sampling=greedy(bs, dev, may_sample), config=algo.stack_configs(configs, dev),
            state=algo.init_state(bs, dev))
        outs.append(algo.step(x))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(outs[0].num_transferred, outs[1].num_transferred)
