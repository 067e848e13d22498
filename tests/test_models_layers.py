"""Shared layers, routers, ``ModelConfig`` and the architecture registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rope
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from dllm.models.config import ModelConfig
from dllm.models.layers import RMSNorm, RopeSpec, RotaryEmbedding, SwiGLUMLP
from dllm.models.moe import SoftmaxMoE, grouped_topk_ids, sigmoid_grouped_topk, softmax_topk
from dllm.models.registry import ARCHITECTURES, get_architecture
from dllm.models.weights import STACK_EXPERTS, WeightRule, WeightTarget, resolve_weight

# ---------------------------------------------------------------------------------------------
# ModelConfig
# ---------------------------------------------------------------------------------------------


def test_model_config_access(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["SDARForCausalLM"], "hidden_size": 64, "rope_theta": 10000,
         "rope_scaling": None, "tie_word_embeddings": True, "mlp_only_layers": [1]}))
    c = ModelConfig.from_file(tmp_path)
    assert c.architecture == "SDARForCausalLM" and c.hidden_size == 64
    assert c.get_int("hidden_size") == 64 and c.get_float("rope_theta") == 10000.0
    assert c.get_int("head_dim", 16) == 16  # absent → default
    assert c.get_dict("rope_scaling", {}) == {}  # null → default
    assert c.get_bool("tie_word_embeddings") is True and c.get_list("mlp_only_layers") == [1]
    assert c.first_int("embedding_size", "hidden_size") == 64
    with pytest.raises(AttributeError, match="num_layers"):
        _ = c.num_layers
    with pytest.raises(KeyError, match="num_layers"):
        c.get_int("num_layers")
    with pytest.raises(TypeError, match="hidden_size"):
        c.get_bool("hidden_size")
    with pytest.raises(AttributeError):
        c.hidden_size = 3  # type: ignore[misc]
    assert c.to_dict()["hidden_size"] == 64 and "hidden_size" in c


# ---------------------------------------------------------------------------------------------
# RoPE / norms / MLP
# ---------------------------------------------------------------------------------------------


def _config(**kw: object) -> ModelConfig:
    return ModelConfig({"architectures": ["X"], **kw})


def test_rope_matches_transformers() -> None:
    spec = RopeSpec.from_config(_config(rope_theta=1e6), head_dim=32)
    rope = RotaryEmbedding(spec)
    pos = torch.tensor([0, 1, 5, 17, 300])
    q, k = torch.randn(5, 4 * 32), torch.randn(5, 2 * 32)
    got_q, got_k = rope(pos, q, k)
    ref = LlamaRotaryEmbedding(config=_hf_rope_config(32, 1e6))
    cos, sin = ref(q, pos[None])
    want_q, want_k = hf_apply_rope(q.view(1, 5, 4, 32).transpose(1, 2),
                                   k.view(1, 5, 2, 32).transpose(1, 2), cos, sin)
    assert torch.allclose(got_q, want_q.transpose(1, 2).reshape(5, -1), atol=1e-6)
    assert torch.allclose(got_k, want_k.transpose(1, 2).reshape(5, -1), atol=1e-6)


def _hf_rope_config(head_dim: int, theta: float) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       rope_theta=theta)


def test_partial_rope_leaves_tail_channels() -> None:
    spec = RopeSpec.from_config(_config(partial_rotary_factor=0.5, rope_theta=600000), 16)
    assert spec.rotary_dim == 8
    rope = RotaryEmbedding(spec)
    q, k = torch.randn(3, 2 * 16), torch.randn(3, 16)
    got_q, _ = rope(torch.tensor([2, 7, 9]), q, k)
    got_q, q = got_q.view(3, 2, 16), q.view(3, 2, 16)
    assert torch.equal(got_q[..., 8:], q[..., 8:])
    full = RotaryEmbedding(RopeSpec(8, 8, 600000.0))
    rotated, _ = full(torch.tensor([2, 7, 9]), q[..., :8].reshape(3, -1), q[..., :8].reshape(3, -1))
    assert torch.allclose(got_q[..., :8].reshape(3, -1), rotated)
    assert RopeSpec.from_config(_config(rotary_dim=4), 16).rotary_dim == 4


def test_rope_position_zero_is_identity_and_norm_preserving() -> None:
    rope = RotaryEmbedding(RopeSpec(16, 16, 10000.0))
    q = torch.randn(4, 32)
    out, _ = rope(torch.tensor([0, 3, 100, 4000]), q, q[:, :16])
    assert torch.allclose(out[0], q[0])
    assert torch.allclose(out.view(4, 2, 16).norm(dim=-1), q.view(4, 2, 16).norm(dim=-1), atol=1e-5)


def test_unsupported_rope_scaling_raises() -> None:
    spec = RopeSpec.from_config(_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), 16)
    with pytest.raises(NotImplementedError, match="yarn"):
        RotaryEmbedding(spec)
    assert RopeSpec.from_config(_config(rope_scaling={"type": "default"}), 16).scaling is None


def test_rms_norm_and_mlp() -> None:
    norm = RMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8)
    assert torch.allclose(norm(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())
    assert norm.bfloat16()(x.bfloat16()).dtype == torch.bfloat16
    mlp = SwiGLUMLP(8, 16)
    gate, up = mlp.gate_up_proj.weight.split(16)  # the packed rows: gate, then up
    F = torch.nn.functional
    want = mlp.down_proj(F.silu(F.linear(x, gate)) * F.linear(x, up))
    assert torch.allclose(mlp(x), want, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# Routers and MoE
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_moe_matches_qwen3_moe_block(renormalize: bool) -> None:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6,
                         num_experts_per_tok=2, norm_topk_prob=renormalize)
    ref = Qwen3MoeSparseMoeBlock(cfg)
    ours = SoftmaxMoE(16, 6, 2, 8, renormalize)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        for e, expert in enumerate(ref.experts):
            ours.experts.gate_proj[e] = expert.gate_proj.weight
            ours.experts.up_proj[e] = expert.up_proj.weight
            ours.experts.down_proj[e] = expert.down_proj.weight
        x = torch.randn(30, 16)
        want, _ = ref(x[None])
        assert torch.allclose(ours(x), want[0], atol=1e-6)


def test_softmax_topk_with_bias_uses_biased_weights() -> None:
    logits = torch.randn(10, 5)
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
    weights, ids = softmax_topk(logits, 2, renormalize=False, bias=bias)
    assert (ids == 2).any(-1).all()
    probs = logits.softmax(-1) + bias
    assert torch.allclose(weights, probs.gather(1, ids))


def test_grouped_topk_without_groups_is_plain_topk() -> None:
    scores = torch.rand(20, 8)
    assert torch.equal(grouped_topk_ids(scores, 3, 1, 1), scores.topk(3).indices)
    assert torch.equal(grouped_topk_ids(scores, 3, 4, 4).sort(-1).values,
                       scores.topk(3).indices.sort(-1).values)


def test_sigmoid_grouped_topk_scaling_and_single_expert() -> None:
    logits = torch.randn(6, 8)
    w, ids = sigmoid_grouped_topk(logits, 1, 4, 2, None, True, 2.5)
    assert torch.allclose(w, torch.sigmoid(logits).gather(1, ids) * 2.5)  # top-1: no renorm
    w2, _ = sigmoid_grouped_topk(logits, 2, 4, 2, None, True, 2.5)
    assert torch.allclose(w2.sum(-1), torch.full((6,), 2.5))


# ---------------------------------------------------------------------------------------------
# Weight rules
# ---------------------------------------------------------------------------------------------


def test_weight_rules() -> None:
    rules = (WeightRule(r"skip\..*", None), STACK_EXPERTS)
    assert resolve_weight(rules, "skip.me") is None
    assert resolve_weight(rules, "model.norm.weight") == WeightTarget("model.norm.weight")
    assert resolve_weight(rules, "model.layers.3.mlp.experts.12.down_proj.weight") == \
        WeightTarget("model.layers.3.mlp.experts.down_proj", 12)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_registry_values() -> None:
    want = {  # name: (kind, attention, mask id, block, shift, sub-block)
        "SDARForCausalLM": ("block_diffusion", "block_causal", 151669, 4, 0, None),
        "SDARMoeForCausalLM": ("block_diffusion", "block_causal", 151669, 4, 0, None),
        "LLaDA2MoeModelLM": ("block_diffusion", "block_causal", 156895, 32, 0, None),
        "Fast_dLLM_QwenForCausalLM": ("block_diffusion", "block_causal", 151665, 32, 1, 8),
        "LLaDAModelLM": ("full_diffusion", "full", 126336, None, 0, None),
        "LLaDAMoEModelLM": ("full_diffusion", "full", 156895, None, 0, None),
        "DreamModel": ("full_diffusion", "full", 151666, None, 1, None),
        "Qwen3ForCausalLM": ("causal_lm", "causal", None, None, 1, None),
        "Qwen2ForCausalLM": ("causal_lm", "causal", None, None, 1, None),
        "LlamaForCausalLM": ("causal_lm", "causal", None, None, 1, None),
        "GraniteMoeHybridForCausalLM": ("causal_lm", "causal", None, None, 1, None),
        "BambaForCausalLM": ("causal_lm", "causal", None, None, 1, None),
        "NemotronHForCausalLM": ("causal_lm", "causal", None, None, 1, None),
        "Mamba2ForCausalLM": ("causal_lm", "causal", None, None, 1, None),
        "GraniteMoeHybridForBlockDiffusion": ("block_diffusion", "block_causal", None, 8, 0,
                                              None),
    }
    assert set(ARCHITECTURES) == set(want)
    assert {n for n, s in ARCHITECTURES.items() if s.recurrent_state} == {
        "GraniteMoeHybridForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM",
        "Mamba2ForCausalLM", "GraniteMoeHybridForBlockDiffusion"}
    # A Granite-H network served by block diffusion: the Granite module itself.
    network = {"GraniteMoeHybridForBlockDiffusion": "GraniteMoeHybridForCausalLM"}
    for name, (kind, attn, mask, block, shift, sub) in want.items():
        s = get_architecture(name)
        assert (s.kind, s.attention, s.default_mask_id, s.default_block_size, s.logits_shift,
                s.default_sub_block_size) == (kind, attn, mask, block, shift, sub), name
        assert s.model_cls.__name__ == network.get(name, name)
        assert s.is_diffusion == (kind != "causal_lm")
        assert bool(s.mask_token_strings) == s.is_diffusion
    assert get_architecture("Fast_dLLM_QwenForCausalLM").block_size_keys[0] == "bd_size"
    assert get_architecture("LLaDAModelLM").mask_token_strings == ("<|mdm_mask|>",)


def test_registry_rejects_unknown_with_the_list() -> None:
    with pytest.raises(ValueError, match=r"'Foo'.*DreamModel.*SDARMoeForCausalLM"):
        get_architecture("Foo")
