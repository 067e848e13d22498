"""LLaDA2-MoE against a naive reference written here from the checkpoint tensors (HF
``modeling_llada2_moe`` semantics: fused QKV split by heads, per-head q/k RMSNorm, partial RoPE,
sigmoid router with ``expert_bias`` for the choice only, group-limited top-k, normalised
weights × ``routed_scaling_factor``, a per-expert loop and one shared expert)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dllm.models.llada2 import LLaDA2MoE
from dllm.models.loader import load_model
from dllm.runner.attention.mask import visibility
from dllm.runner.forward_batch import AttentionMask, ForwardMode
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import CachedSequence, forward_full

TOL = 1e-4


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    """x ``[T, H, D]``: rotate the first ``rot`` channels, pairs (i, i + rot/2)."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2).float() / rot)
    ang = pos.float()[:, None] * inv[None]  # [T, rot/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b, rest = x[..., : rot // 2], x[..., rot // 2 : rot], x[..., rot:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def _swiglu(x: torch.Tensor, w: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    return F.silu(x @ w[f"{p}.gate_proj.weight"].T) * (x @ w[f"{p}.up_proj.weight"].T) @ w[
        f"{p}.down_proj.weight"].T


def reference_route(logits: torch.Tensor, bias: torch.Tensor, c: dict) -> tuple[torch.Tensor,
                                                                                 torch.Tensor]:
    """Naive per-token routing: returns (expert ids [T, K], weights [T, K])."""
    k, groups, keep = c["num_experts_per_tok"], c["n_group"], c["topk_group"]
    ids, weights = [], []
    for row in range(logits.shape[0]):
        scores = torch.sigmoid(logits[row])
        choice = scores + bias
        per = scores.numel() // groups
        group_score = [sorted(choice[g * per:(g + 1) * per].tolist())[-2:] for g in range(groups)]
        best_groups = sorted(range(groups), key=lambda g: -sum(group_score[g]))[:keep]
        allowed = [e for g in best_groups for e in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda e: -choice[e].item())[:k]
        w = scores[chosen]
        w = w / w.sum() * c["routed_scaling_factor"]
        ids.append(chosen)
        weights.append(w)
    return torch.tensor(ids), torch.stack(weights)


def reference_logits(path: Path, ids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    c = json.loads((path / "config.json").read_text())
    w = load_file(path / "model.safetensors")
    nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps, rot = c["rms_norm_eps"], int(c["head_dim"] * c["partial_rotary_factor"])
    pos = torch.arange(len(ids))
    x = w["model.word_embeddings.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        y = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
        qkv = (y @ w[f"{p}.attention.query_key_value.weight"].T).view(len(ids), nh + 2 * nkv, d)
        q, k, v = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
        theta = c["rope_theta"]
        q = _rope(_rms(q, w[f"{p}.attention.query_layernorm.weight"], eps), pos, rot, theta)
        k = _rope(_rms(k, w[f"{p}.attention.key_layernorm.weight"], eps), pos, rot, theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(ids), nh * d)
        x = x + attn @ w[f"{p}.attention.dense.weight"].T
        y = _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        if i < c["first_k_dense_replace"]:
            x = x + _swiglu(y, w, f"{p}.mlp")
            continue
        logits = y @ w[f"{p}.mlp.gate.weight"].T
        chosen, weights = reference_route(logits, w[f"{p}.mlp.gate.expert_bias"], c)
        moe = torch.zeros_like(y)
        for t in range(len(ids)):
            for e, wt in zip(chosen[t].tolist(), weights[t], strict=True):
                moe[t] += wt * _swiglu(y[t : t + 1], w, f"{p}.mlp.experts.{e}")[0]
        x = x + moe + _swiglu(y, w, f"{p}.mlp.shared_experts")
    x = _rms(x, w["model.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path_factory.mktemp("llada2"), seed=21)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 480, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", [AttentionMask.BLOCK_CAUSAL, AttentionMask.FULL])
def test_llada2_logits_match_naive_reference(ckpt: Path, kind: AttentionMask) -> None:
    model, _, _ = load_model(ckpt)
    ids = _ids(24, seed=1)
    idx = torch.arange(24)
    want = reference_logits(ckpt, ids, visibility(kind, idx, idx, 8))
    got = forward_full(model, ids, kind, 8)
    assert (got - want).abs().max().item() < TOL


def test_llada2_denoise_step_over_cached_prefix(ckpt: Path) -> None:
    model, _, _ = load_model(ckpt)
    block = 8
    ids = _ids(3 * block, seed=2)
    idx = torch.arange(3 * block)
    want = reference_logits(ckpt, ids, visibility(AttentionMask.BLOCK_CAUSAL, idx, idx, block))
    seq = CachedSequence(model, 3 * block)
    prefix = seq.extend(ids[: 2 * block], AttentionMask.BLOCK_CAUSAL, block)
    step = seq.extend(ids[2 * block :], AttentionMask.BLOCK_CAUSAL, block,
                      mode=ForwardMode.DLLM_EXTEND)
    assert (prefix - want[: 2 * block]).abs().max().item() < TOL
    assert (step - want[2 * block :]).abs().max().item() < TOL


def test_llada2_router_selects_reference_experts(ckpt: Path) -> None:
    model, _, _ = load_model(ckpt)
    c = json.loads((ckpt / "config.json").read_text())
    moe = model.model.layers[1].mlp
    assert isinstance(moe, LLaDA2MoE)
    x = torch.randn(300, c["hidden_size"], generator=torch.Generator().manual_seed(3))
    weights, ids = moe.route(x)
    ref_ids, ref_weights = reference_route(x @ moe.gate.weight.T, moe.gate.expert_bias, c)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    assert torch.allclose(weights.gather(1, order), ref_weights.gather(1, ref_order), atol=1e-6)
    # The group limit and the bias both change some choices, so both are exercised.
    scores = torch.sigmoid(x @ moe.gate.weight.T)
    plain = torch.topk(scores + moe.gate.expert_bias, 2).indices.sort(-1).values
    unbiased = torch.topk(scores, 2).indices.sort(-1).values
    assert (plain != ids.sort(-1).values).any(-1).sum() > 10
    assert (unbiased != plain).any(-1).sum() > 0


def test_llada2_expert_bias_only_chooses(ckpt: Path) -> None:
    """A large bias forces an expert into every choice, but its weight stays its own score."""
    model, _, _ = load_model(ckpt)
    moe = model.model.layers[1].mlp
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(4))
    moe.gate.expert_bias.zero_()
    moe.gate.expert_bias[5] = 10.0
    weights, ids = moe.route(x)
    assert (ids == 5).any(-1).all()
    scores = torch.sigmoid(x @ moe.gate.weight.T)
    chosen = scores.gather(1, ids)
    want = chosen / chosen.sum(-1, keepdim=True) * 2.5
    assert torch.allclose(weights, want, atol=1e-6)


def test_llada2_group_limit_restricts_choice(ckpt: Path) -> None:
    """Every chosen expert lies in one of the ``topk_group`` allowed groups (2 of 4)."""
    model, _, _ = load_model(ckpt)
    moe = model.model.layers[2].mlp
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(5))
    _, ids = moe.route(x)
    groups = ids // 2  # 8 experts in 4 groups of 2
    assert all(len(set(row)) <= 2 for row in groups.tolist())


@pytest.mark.parametrize("kind", [AttentionMask.BLOCK_CAUSAL, AttentionMask.FULL])
def test_llada2_grouped_experts_match_naive_reference(ckpt: Path, kind: AttentionMask) -> None:
    """The static-shape expert path (``StackedExperts.forward_grouped``: pairs sorted by
    expert, ``grouped_mm`` over their row ranges, no host read), installed through the layer
    ops, gives the reference logits; the model then reports that CUDA graphs can capture it."""
    from dllm.models.ops import TORCH_OPS, LayerOps, install_ops

    model, _, _ = load_model(ckpt)
    assert not model.supports_cuda_graph  # the per-expert loop reads ids on the host
    install_ops(model, LayerOps(grouped_moe=True))
    assert model.supports_cuda_graph
    ids = _ids(24, seed=6)
    idx = torch.arange(24)
    want = reference_logits(ckpt, ids, visibility(kind, idx, idx, 8))
    got = forward_full(model, ids, kind, 8)
    assert (got - want).abs().max().item() < TOL
    install_ops(model, TORCH_OPS)
    assert not model.supports_cuda_graph


@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_grouped_experts_equal_the_loop(ckpt: Path, tokens: int) -> None:
    """Direct: random routes where some experts get no token, the same ids twice in a row
    allowed; float32 (to the loop's rounding) and bfloat16 (within its rounding)."""
    model, _, _ = load_model(ckpt)
    experts = model.model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    k = 3
    ids = torch.randint(0, experts.num_experts // 2, (tokens, k), generator=g)  # half unused
    weights = torch.rand(tokens, k, generator=g)
    want = experts.forward_loop(x, ids, weights)
    assert torch.allclose(experts.forward_grouped(x, ids, weights), want, atol=1e-5)
    experts.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    got = experts.forward_grouped(xb, ids, weights)
    ref = experts.forward_loop(xb, ids, weights)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
