"""The MoE routers (``dllm.runner.kernels.moe_route``): the Triton routers choose the torch
routers' experts (``sigmoid_grouped_topk``, ``softmax_topk``) with their weights to float32
rounding, ties aside, and say which inputs they take.

GPU tests (marker ``gpu``). With ``TRITON_INTERPRET=1`` they also run on the CPU under Triton's
interpreter, on small shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dllm.models.moe import sigmoid_grouped_topk, softmax_topk
from tests.triton_marks import INTERPRET, MARKS

pytestmark = MARKS

if INTERPRET:
    DEV = "cpu"
    # (T, E, K, n_group, topk_group): LLaDA2.0-mini's router at one token, the tiny test
    # checkpoint's (8 experts, 4 groups of 2), and no groups with K not a power of two.
    SIGMOID = [(1, 256, 8, 8, 4), (6, 8, 2, 4, 2), (5, 64, 6, 1, 1)]
    SOFTMAX = [(4, 60, 4), (3, 8, 2)]  # (T, E, K): E not a power of two
else:
    DEV = "cuda"
    SIGMOID = [(1, 256, 8, 8, 4), (32, 256, 8, 8, 4), (4096, 256, 8, 8, 4), (1000, 8, 2, 4, 2),
               (333, 64, 6, 1, 1), (77, 128, 8, 8, 3)]
    SOFTMAX = [(1024, 128, 8), (77, 60, 4), (4096, 64, 8)]
WEIGHT_TOL = 1e-6


@pytest.fixture(scope="module")
def mr():
    from dllm.runner.kernels import moe_route

    return moe_route


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV) * scale


def _check_routing(ids: torch.Tensor, weights: torch.Tensor, ref_ids: torch.Tensor,
                   ref_weights: torch.Tensor, choice: torch.Tensor) -> None:
    """The same experts as sets per token and the same weights within ``WEIGHT_TOL``; a token
    whose sets differ passes only at a tie (the two sets' values for the choice agree to
    1e-6; torch's ``topk`` breaks ties in no documented order)."""
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == ref_ids.shape and weights.shape == ref_weights.shape
    ids_s, order = ids.sort(dim=1)
    ref_s, ref_order = ref_ids.sort(dim=1)
    same = (ids_s == ref_s).all(dim=1)
    for t in (~same).nonzero().flatten().tolist():
        mine = choice[t, ids[t]].sort().values
        theirs = choice[t, ref_ids[t]].sort().values
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6), (t, ids[t], ref_ids[t])
    assert (~same).sum().item() <= max(1, ids.shape[0] // 100)
    w = weights.gather(1, order)[same]
    ref_w = ref_weights.gather(1, ref_order)[same]
    assert (w - ref_w).abs().max().item() <= WEIGHT_TOL


@pytest.mark.parametrize("t,e,k,groups,keep", SIGMOID)
@pytest.mark.parametrize("bias,renormalize,scaling", [(True, True, 2.5), (False, False, 1.0)])
def test_sigmoid_router_matches_torch(mr, t, e, k, groups, keep, bias, renormalize, scaling):
    logits = _randn(t, e, seed=t + e, scale=2.0)
    b = _randn(e, seed=1, scale=0.1) if bias else None
    assert mr.supports_sigmoid(logits, k, groups, keep, b)
    weights, ids = mr.route_sigmoid(logits, k, groups, keep, b, renormalize, scaling)
    ref_w, ref_ids = sigmoid_grouped_topk(logits, k, groups, keep, b, renormalize, scaling)
    choice = torch.sigmoid(logits) + (b if bias else 0)
    _check_routing(ids, weights, ref_ids, ref_w, choice)
    assert ids.lt(e).all() and ids.ge(0).all()


@pytest.mark.parametrize("t,e,k", SOFTMAX)
@pytest.mark.parametrize("bias,renormalize", [(True, False), (False, True)])
def test_softmax_router_matches_torch(mr, t, e, k, bias, renormalize):
    logits = _randn(t, e, seed=t * e, scale=2.0)
    b = _randn(e, seed=2, scale=0.01) if bias else None
    assert mr.supports_softmax(logits, k, b)
    weights, ids = mr.route_softmax(logits, k, renormalize, b)
    ref_w, ref_ids = softmax_topk(logits, k, renormalize, b)
    choice = F.softmax(logits, dim=-1) + (b if bias else 0)
    _check_routing(ids, weights, ref_ids, ref_w, choice)


def test_supports(mr):
    logits = torch.zeros(4, 48, device=DEV)
    assert not mr.supports_sigmoid(logits, 4, 4, 2, None)  # 48 experts: not a power of two
    assert mr.supports_sigmoid(logits[:, :32], 4, 4, 2, None)
    assert not mr.supports_sigmoid(logits[:, :32], 9, 4, 1, None)  # more than a group holds
    assert mr.supports_softmax(logits, 4, None)
    assert not mr.supports_softmax(logits.t(), 4, None)  # rows not contiguous
    assert not mr.supports_softmax(logits, 49, None)  # more than E a token
