"""``load_model``: every architecture from a factory checkpoint (one file and two shards),
dtype casts, tied heads, and errors that name the offending tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dllm.models.attention import KVCacheSpec
from dllm.models.config import ModelConfig
from dllm.models.loader import WeightLoadError, load_model
from dllm.models.registry import ARCHITECTURES
from dllm.runner.attention.sdpa import SDPABackend
from dllm.runner.forward_batch import AttentionMask, ForwardBatch, ForwardMode
from dllm.testing import make_tiny_checkpoint, supported_architectures
from dllm.testing.harness import forward_full

ALL = sorted(ARCHITECTURES)


def _mask(arch: str) -> AttentionMask:
    return {"causal": AttentionMask.CAUSAL, "full": AttentionMask.FULL,
            "block_causal": AttentionMask.BLOCK_CAUSAL}[ARCHITECTURES[arch].attention]


def test_factory_covers_every_registered_architecture() -> None:
    assert supported_architectures() == ALL


@pytest.mark.parametrize("arch", ALL)
def test_every_architecture_loads_single_and_sharded(tmp_path: Path, arch: str) -> None:
    single = make_tiny_checkpoint(arch, tmp_path / "one", seed=5)
    sharded = make_tiny_checkpoint(arch, tmp_path / "two", seed=5, shards=2)
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (sharded / "model.safetensors").exists()
    m1, spec, config = load_model(single)
    m2, _, _ = load_model(sharded)
    assert spec.name == arch and isinstance(config, ModelConfig)
    assert config.architecture == arch
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert not any(p.requires_grad for p in m1.parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in m1.parameters())
    ids = torch.arange(3, 19)
    logits = forward_full(m1, ids, _mask(arch), 4)
    assert logits.shape == (16, config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, forward_full(m2, ids, _mask(arch), 4))
    kv = m1.kv_cache_spec()
    if not spec.recurrent_state:
        assert isinstance(kv, KVCacheSpec) and kv.num_layers == len(m1.model.layers)
    else:  # KV for the attention layers, state for the Mamba layers
        assert (kv.num_layers, m1.state_spec().num_layers) == _hybrid_layers(config)


def _hybrid_layers(config: ModelConfig) -> tuple[int, int]:
    """(attention layers, Mamba layers) of a hybrid config, by its own layout keys."""
    n = config["num_hidden_layers"]
    if "layer_types" in config:
        return config["layer_types"].count("attention"), config["layer_types"].count("mamba")
    if "hybrid_override_pattern" in config:
        p = config["hybrid_override_pattern"]
        return p.count("*"), p.count("M")
    if "attn_layer_indices" in config:
        return len(config["attn_layer_indices"]), n - len(config["attn_layer_indices"])
    return 0, n


def test_kv_cache_spec_values(tmp_path: Path) -> None:
    model, _, _ = load_model(make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path))
    assert model.kv_cache_spec() == KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32)
    assert model.supports_cuda_graph


def test_moe_models_report_no_cuda_graph(tmp_path: Path) -> None:
    model, _, _ = load_model(make_tiny_checkpoint("SDARMoeForCausalLM", tmp_path))
    assert not model.supports_cuda_graph


@pytest.mark.parametrize("ckpt_dtype", ["bfloat16", "float16"])
def test_half_checkpoint_cast_to_float32(tmp_path: Path, ckpt_dtype: str) -> None:
    path = make_tiny_checkpoint("SDARMoeForCausalLM", tmp_path, dtype=ckpt_dtype)
    raw = load_file(path / "model.safetensors")
    assert raw["model.embed_tokens.weight"].dtype == getattr(torch, ckpt_dtype)
    model, _, _ = load_model(path, dtype=torch.float32)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, raw["model.embed_tokens.weight"].float())
    experts = model.model.layers[0].mlp.experts
    want = raw["model.layers.0.mlp.experts.3.down_proj.weight"].float()
    assert torch.equal(experts.down_proj[3], want)


def test_float32_checkpoint_cast_to_bfloat16(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path)
    model, _, _ = load_model(path, dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    gate = model.model.layers[1].mlp.gate  # router weights stay float32, as in the reference
    assert gate.weight.dtype == torch.float32 and gate.expert_bias.dtype == torch.float32
    logits = forward_full(model, torch.arange(8), AttentionMask.BLOCK_CAUSAL, 4)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_auto_dtype_follows_config(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("SDARForCausalLM", tmp_path, dtype="bfloat16")
    model, _, _ = load_model(path, dtype="auto")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    model, _, _ = load_model(path, dtype="float16")
    assert model.model.norm.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="int8"):
        load_model(path, dtype="int8")


def test_idle_forward_with_no_tokens(tmp_path: Path) -> None:
    """A data-parallel rank with no requests still runs the model on zero tokens."""
    model, _, _ = load_model(make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path))
    empty = torch.zeros(0, dtype=torch.int64)
    fb = ForwardBatch(ForwardMode.IDLE, 0, empty, empty, empty, empty, empty, empty, empty,
                      [], [], [], attn_backend=SDPABackend())
    with torch.no_grad():
        hidden = model(empty, empty, fb)
    assert hidden.shape == (0, 64) and model.compute_logits(hidden).shape == (0, 512)


def test_load_to_meta_then_device_materialises_everything(tmp_path: Path) -> None:
    model, _, _ = load_model(make_tiny_checkpoint("SDARForCausalLM", tmp_path), device="cpu")
    tensors = [*model.parameters(), *model.buffers()]
    assert all(not t.is_meta for t in tensors)
    inv_freq = model.model.layers[0].self_attn.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (16,)


def test_tied_head_uses_embedding(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("Qwen2ForCausalLM", tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model, _, _ = load_model(path)
    assert model.lm_head is None
    h = torch.randn(3, 64)
    assert torch.equal(model.compute_logits(h), h @ model.model.embed_tokens.weight.T)


def test_tied_checkpoint_with_a_stored_head_is_accepted(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, tie_word_embeddings=True)
    w = load_file(path / "model.safetensors")
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    save_file(w, path / "model.safetensors")
    model, _, _ = load_model(path)
    assert model.lm_head is None


def test_untied_head_is_its_own_tensor(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, tie_word_embeddings=False)
    w = load_file(path / "model.safetensors")
    model, _, _ = load_model(path)
    assert torch.equal(model.lm_head.weight, w["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_experts_are_stacked_in_order(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path)
    w = load_file(path / "model.safetensors")
    model, _, _ = load_model(path)
    experts = model.model.layers[2].mlp.experts
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            want = w[f"model.layers.2.mlp.experts.{e}.{proj}.weight"]
            assert torch.equal(getattr(experts, proj)[e], want)
    assert torch.equal(model.model.layers[2].mlp.gate.expert_bias,
                       w["model.layers.2.mlp.gate.expert_bias"])


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _rewrite(path: Path, edit) -> None:  # noqa: ANN001 - a callable on the tensor dict
    w = load_file(path / "model.safetensors")
    edit(w)
    save_file(w, path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("SDARForCausalLM", tmp_path)
    _rewrite(path, lambda w: w.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(path)


def test_missing_expert_is_named(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("SDARMoeForCausalLM", tmp_path)
    _rewrite(path, lambda w: w.pop("model.layers.1.mlp.experts.6.up_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\.up_proj\[6\]"):
        load_model(path)


def test_wrong_shape_is_named_with_shapes(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("Qwen2ForCausalLM", tmp_path)
    _rewrite(path, lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(7)}))
    with pytest.raises(WeightLoadError,
                       match=r"model\.layers\.0\.self_attn\.q_proj\.bias.*\(7,\).*\(64,\)"):
        load_model(path)


def test_wrong_expert_shape_is_named(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path)
    _rewrite(path, lambda w: w.update(
        {"model.layers.1.mlp.experts.2.down_proj.weight": torch.zeros(64, 31)}))
    with pytest.raises(WeightLoadError, match=r"experts\.2\.down_proj\.weight.*\(64, 31\)"):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("LLaDAModelLM", tmp_path)
    _rewrite(path, lambda w: w.update({"model.transformer.blocks.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match=r"model\.transformer\.blocks\.0\.extra\.weight"):
        load_model(path)


def test_expert_index_out_of_range_is_named(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("SDARMoeForCausalLM", tmp_path)
    _rewrite(path, lambda w: w.update(
        {"model.layers.0.mlp.experts.8.gate_proj.weight": torch.zeros(32, 64)}))
    with pytest.raises(WeightLoadError, match=r"experts\.8\.gate_proj\.weight"):
        load_model(path)


def test_missing_shard_file(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_model(path)


def test_pickle_checkpoints_are_refused(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(path)


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*SDARForCausalLM"):
        load_model(path)
