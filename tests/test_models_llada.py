"""LLaDA (OLMo-style names) against a naive reference written here from the checkpoint tensors,
the placement of the two kinds of ``ff_out``, and the LLaDA-MoE block options the Qwen3-MoE
comparison in ``test_models_hf`` cannot cover (``expert_bias``, shared expert)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dllm.models.loader import load_model
from dllm.models.moe import SoftmaxMoE
from dllm.runner.forward_batch import AttentionMask, ForwardMode
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import CachedSequence, forward_full

TOL = 1e-4


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """LLaDA's RotaryEmbedding: x ``[T, H, D]`` at positions 0..T-1, halves rotated."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.arange(t).float()[:, None] * inv[None]
    pos = torch.cat([freqs, freqs], -1)[:, None]  # [T, 1, D]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * pos.cos() + torch.cat([-x2, x1], -1) * pos.sin()


def llada_reference(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """The LLaDA block (``LLaDALlamaBlock``) with full attention, written from the weights."""
    c = json.loads((path / "config.json").read_text())
    w = load_file(path / "model.safetensors")
    h, nh, nkv, eps = c["d_model"], c["n_heads"], c["n_kv_heads"], c["rms_norm_eps"]
    d, n = h // nh, len(ids)
    t = "model.transformer"
    x = w[f"{t}.wte.weight"][ids]
    for i in range(c["n_layers"]):
        b = f"{t}.blocks.{i}"
        y = _rms(x, w[f"{b}.attn_norm.weight"], eps)
        q = _rope((y @ w[f"{b}.q_proj.weight"].T).view(n, nh, d), c["rope_theta"])
        k = _rope((y @ w[f"{b}.k_proj.weight"].T).view(n, nkv, d), c["rope_theta"])
        v = (y @ w[f"{b}.v_proj.weight"].T).view(n, nkv, d)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = (torch.einsum("qhd,khd->hqk", q, k) / d**0.5).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(n, h) @ w[f"{b}.attn_out.weight"].T
        y = _rms(x, w[f"{b}.ff_norm.weight"], eps)
        gate, up = y @ w[f"{b}.ff_proj.weight"].T, y @ w[f"{b}.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[f"{b}.ff_out.weight"].T
    return _rms(x, w[f"{t}.ln_f.weight"], eps) @ w[f"{t}.ff_out.weight"].T


@pytest.fixture(scope="module")
def llada(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("LLaDAModelLM", tmp_path_factory.mktemp("llada"), seed=31)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 480, (n,), generator=torch.Generator().manual_seed(seed))


def test_llada_matches_naive_reference(llada: Path) -> None:
    model, _, _ = load_model(llada)
    ids = _ids(26, seed=1)
    got = forward_full(model, ids, AttentionMask.FULL)
    assert (got - llada_reference(llada, ids)).abs().max().item() < TOL


def test_llada_exact_recompute_over_cache(llada: Path) -> None:
    """Full attention through the paged cache (the engine's ``cache_mode="exact"`` shape: the
    whole canvas written at once) equals the uncached forward."""
    model, _, _ = load_model(llada)
    ids = _ids(20, seed=2)
    seq = CachedSequence(model, 24)
    got = seq.extend(ids, AttentionMask.FULL, mode=ForwardMode.EXTEND)
    assert (got - llada_reference(llada, ids)).abs().max().item() < TOL


def test_llada_ff_out_placement(llada: Path) -> None:
    """The head ``model.transformer.ff_out`` goes to the LM head, each block's ``ff_out`` to that
    block's down projection; ``ff_proj`` is the gate and ``up_proj`` the linear branch."""
    model, _, _ = load_model(llada)
    w = load_file(llada / "model.safetensors")
    t = "model.transformer"
    assert torch.equal(model.lm_head.weight, w[f"{t}.ff_out.weight"])
    assert torch.equal(model.model.embed_tokens.weight, w[f"{t}.wte.weight"])
    for i, layer in enumerate(model.model.layers):
        assert torch.equal(layer.mlp.down_proj.weight, w[f"{t}.blocks.{i}.ff_out.weight"])
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)  # packed at load: gate rows first
        assert torch.equal(gate, w[f"{t}.blocks.{i}.ff_proj.weight"])
        assert torch.equal(up, w[f"{t}.blocks.{i}.up_proj.weight"])
        assert torch.equal(layer.self_attn.o_proj.weight, w[f"{t}.blocks.{i}.attn_out.weight"])


def test_llada_gate_and_up_are_not_interchangeable(llada: Path, tmp_path: Path) -> None:
    """Swapping ``ff_proj`` and ``up_proj`` in the checkpoint changes the logits, so the
    reference comparison above pins which one is the gate."""
    w = load_file(llada / "model.safetensors")
    for i in range(2):
        b = f"model.transformer.blocks.{i}"
        w[f"{b}.ff_proj.weight"], w[f"{b}.up_proj.weight"] = (w[f"{b}.up_proj.weight"],
                                                              w[f"{b}.ff_proj.weight"])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llada / name).read_bytes())
    save_file(w, tmp_path / "model.safetensors")
    swapped, _, _ = load_model(tmp_path)
    ids = _ids(12, seed=3)
    diff = forward_full(swapped, ids, AttentionMask.FULL) - llada_reference(llada, ids)
    assert diff.abs().max().item() > 1e-2


# ---------------------------------------------------------------------------------------------
# LLaDA-MoE block options
# ---------------------------------------------------------------------------------------------


def llada_moe_block_reference(x: torch.Tensor, w: dict[str, torch.Tensor], layer: int,
                              c: dict) -> torch.Tensor:
    """``LLaDAMoESparseMoeBlock`` + the layer's ``shared_expert``: softmax, + expert_bias,
    top-k of the biased probabilities used as weights (no renormalisation)."""
    p = f"model.layers.{layer}"
    probs = (x @ w[f"{p}.mlp.gate.weight"].T).softmax(-1) + w[f"{p}.mlp.expert_bias"]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top = probs[t].topk(c["num_experts_per_tok"])
        for e, wt in zip(top.indices.tolist(), top.values, strict=True):
            pe = f"{p}.mlp.experts.{e}"
            y = F.silu(x[t] @ w[f"{pe}.gate_proj.weight"].T) * (x[t] @ w[f"{pe}.up_proj.weight"].T)
            out[t] += wt * (y @ w[f"{pe}.down_proj.weight"].T)
    ps = f"{p}.shared_expert"
    shared = F.silu(x @ w[f"{ps}.gate_proj.weight"].T) * (x @ w[f"{ps}.up_proj.weight"].T)
    return out + shared @ w[f"{ps}.down_proj.weight"].T


def test_llada_moe_expert_bias_and_shared_expert(tmp_path: Path) -> None:
    make_tiny_checkpoint("LLaDAMoEModelLM", tmp_path, seed=33, moe_router_enable_expert_bias=True,
                         shared_expert_intermediate_size=48, moe_layer_freq=[0, 1])
    model, _, _ = load_model(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    w = load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.shared_expert.gate_proj.weight" in w
    assert "model.layers.1.mlp.expert_bias" in w
    moe = model.model.layers[1].mlp
    assert isinstance(moe, SoftmaxMoE)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = moe(x)
    assert (got - llada_moe_block_reference(x, w, 1, c)).abs().max().item() < TOL
    # The whole model still runs with a dense first layer.
    logits = forward_full(model, _ids(10, seed=5), AttentionMask.FULL)
    assert logits.shape == (10, c["vocab_size"]) and torch.isfinite(logits).all()
