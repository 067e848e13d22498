"""The tiny-checkpoint factory: real config keys, real tensor names, a usable tokenizer,
determinism, speed, and output distributions that are neither flat nor context-free."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm.models.loader import load_model
from dllm.models.registry import ARCHITECTURES
from dllm.runner.forward_batch import AttentionMask
from dllm.testing import make_tiny_checkpoint
from dllm.testing.__main__ import main as cli_main
from dllm.testing.families import HYBRID_RELEASES
from dllm.testing.harness import forward_full
from dllm.tokenizer import load_tokenizer

ALL = sorted(ARCHITECTURES)
DIFFUSION = [a for a in ALL if ARCHITECTURES[a].is_diffusion]

# Keys every real config of the family carries, and a few tensor names of the real checkpoints.
REAL_KEYS = {
    "Qwen3ForCausalLM": ["head_dim", "num_key_value_heads", "rope_theta", "rms_norm_eps",
                         "tie_word_embeddings", "max_position_embeddings", "torch_dtype"],
    "SDARForCausalLM": ["head_dim", "num_key_value_heads", "rope_theta", "rms_norm_eps"],
    "SDARMoeForCausalLM": ["num_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"],
    "LLaDA2MoeModelLM": ["first_k_dense_replace", "n_group", "topk_group", "score_function",
                         "routed_scaling_factor", "num_shared_experts", "partial_rotary_factor",
                         "moe_router_enable_expert_bias"],
    "LLaDAModelLM": ["d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size",
                     "weight_tying", "embedding_size", "mask_token_id", "block_type"],
    "LLaDAMoEModelLM": ["expert_intermediate_size", "dense_intermediate_size", "moe_layer_freq",
                        "qk_layernorm", "num_experts"],
    "DreamModel": ["mask_token_id", "num_key_value_heads", "rope_theta"],
    "Fast_dLLM_QwenForCausalLM": ["bd_size", "num_key_value_heads", "rope_theta"],
}
REAL_NAMES = {
    "SDARForCausalLM": ["model.layers.0.self_attn.q_norm.weight", "model.embed_tokens.weight"],
    "SDARMoeForCausalLM": ["model.layers.1.mlp.experts.7.down_proj.weight",
                           "model.layers.0.mlp.gate.weight", "lm_head.weight"],
    "LLaDA2MoeModelLM": ["model.word_embeddings.weight",
                         "model.layers.0.attention.query_key_value.weight",
                         "model.layers.0.attention.dense.weight",
                         "model.layers.0.mlp.gate_proj.weight",
                         "model.layers.1.mlp.gate.expert_bias",
                         "model.layers.2.mlp.shared_experts.up_proj.weight",
                         "model.layers.1.attention.query_layernorm.weight"],
    "LLaDAModelLM": ["model.transformer.wte.weight", "model.transformer.ff_out.weight",
                     "model.transformer.blocks.1.ff_out.weight",
                     "model.transformer.blocks.0.attn_out.weight",
                     "model.transformer.ln_f.weight"],
    "DreamModel": ["model.layers.0.self_attn.q_proj.bias", "lm_head.weight"],
}
MASK_STRINGS = {a: ARCHITECTURES[a].mask_token_strings[0] for a in DIFFUSION}
# Real configs carrying mask_token_id (LLaDA2's and Fast-dLLM v2's do not).
CONFIG_MASK = {"LLaDAModelLM", "DreamModel", "SDARForCausalLM", "SDARMoeForCausalLM",
               "GraniteMoeHybridForBlockDiffusion"}  # dllm's own: its config carries it
# Tokenizers whose tokenizer_config names the mask token (LLaDA's and Fast-dLLM v2's do not:
# the engine finds it through config.json or the known mask strings).
TOKENIZER_MASK = {"DreamModel", "SDARForCausalLM", "SDARMoeForCausalLM", "LLaDA2MoeModelLM",
                  "LLaDAMoEModelLM"}
# The first chat-template tokens of each family's generation prompt.
GENERATION_PROMPT = {a: "<|im_start|>assistant\n" for a in ALL}
GENERATION_PROMPT.update({"LLaDAModelLM": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                          "LLaDA2MoeModelLM": "<role>ASSISTANT</role>",
                          "LLaDAMoEModelLM": "<role>ASSISTANT</role>"})


@pytest.mark.parametrize("arch", ALL)
def test_checkpoint_files_and_config(tmp_path: Path, arch: str) -> None:
    start = time.perf_counter()
    path = make_tiny_checkpoint(arch, tmp_path, seed=1)
    assert time.perf_counter() - start < 1.0
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        assert (path / name).exists(), name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert "model_type" in config and config.get("torch_dtype", "float32") == "float32"
    for key in REAL_KEYS.get(arch, []):
        assert key in config, key
    assert ("mask_token_id" in config) == (arch in CONFIG_MASK)
    names = set(load_file(path / "model.safetensors"))
    for name in REAL_NAMES.get(arch, []):
        assert name in names, name


def test_model_types_of_released_configs(tmp_path: Path) -> None:
    want = {"SDARForCausalLM": "sdar", "SDARMoeForCausalLM": "sdar_moe",
            "LLaDA2MoeModelLM": "llada2_moe", "LLaDAModelLM": "llada", "LLaDAMoEModelLM": "llada",
            "DreamModel": "Dream", "Fast_dLLM_QwenForCausalLM": "Fast_dLLM_Qwen",
            "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
    for arch, model_type in want.items():
        path = make_tiny_checkpoint(arch, tmp_path / arch)
        assert json.loads((path / "config.json").read_text())["model_type"] == model_type


@pytest.mark.parametrize("arch", ALL)
def test_tokenizer_loads_offline_and_fits_vocab(tmp_path: Path, arch: str) -> None:
    path = make_tiny_checkpoint(arch, tmp_path)
    config = json.loads((path / "config.json").read_text())
    tok = load_tokenizer(str(path))
    assert len(tok) <= config["vocab_size"]
    if "eos_token_id" in config:
        assert tok.eos_token_id == config["eos_token_id"]
    if arch in MASK_STRINGS:
        mask = tok.convert_tokens_to_ids(MASK_STRINGS[arch])
        assert 0 <= mask < config["vocab_size"]
        assert tok.mask_token == (MASK_STRINGS[arch] if arch in TOKENIZER_MASK else None)
        if arch in CONFIG_MASK:
            assert config["mask_token_id"] == mask
    text = "Hello world! The answer to question 7 is 42, isn't it? Ünïcode & tabs\tok."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # the word pieces merge
    if arch not in HYBRID_RELEASES:  # the hybrids' release tokenizer files (and their chat
        # templates) were not found: their tiny tokenizers carry no template
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
        assert chat.endswith(GENERATION_PROMPT[arch])
    special = tok(tok.eos_token + "user" + tok.eos_token, add_special_tokens=False)["input_ids"]
    assert special == tok.convert_tokens_to_ids([tok.eos_token, "user", tok.eos_token])


def test_deterministic_in_seed(tmp_path: Path) -> None:
    a = make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path / "a", seed=7)
    b = make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path / "b", seed=7)
    c = make_tiny_checkpoint("LLaDA2MoeModelLM", tmp_path / "c", seed=8)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_shards_and_index(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("SDARMoeForCausalLM", tmp_path, shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    stored = set()
    for f in files:
        stored |= set(load_file(path / f))
    assert stored == set(index["weight_map"])


def test_config_overrides(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("SDARForCausalLM", tmp_path, num_hidden_layers=3,
                                tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["tie_word_embeddings"] is False
    names = set(load_file(path / "model.safetensors"))
    assert "model.layers.2.mlp.down_proj.weight" in names and "lm_head.weight" in names


def test_bfloat16_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("DreamModel", tmp_path, dtype="bfloat16")
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(path / "model.safetensors").values())


def test_cli_writes_a_checkpoint(tmp_path: Path) -> None:
    assert cli_main(["LLaDAModelLM", str(tmp_path / "cli"), "--seed", "3", "n_layers=3"]) == 0
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["n_layers"] == 3
    out = subprocess.run([sys.executable, "-m", "dllm.testing", "DreamModel",
                          str(tmp_path / "sub"), "--shards", "2"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "sub")
    assert (tmp_path / "sub" / "model.safetensors.index.json").exists()


def _max_probs(path: Path, arch: str, contexts: int = 30) -> torch.Tensor:
    model, spec, _ = load_model(path)
    mask = AttentionMask.CAUSAL if spec.attention == "causal" else AttentionMask.FULL
    gen = torch.Generator().manual_seed(0)
    probs = [forward_full(model, torch.randint(0, 480, (12,), generator=gen), mask)
             .softmax(-1).max(-1).values for _ in range(contexts)]
    return torch.cat(probs)


@pytest.mark.parametrize("arch", ["SDARForCausalLM", "LLaDA2MoeModelLM", "LLaDAModelLM",
                                  "DreamModel", "SDARMoeForCausalLM", "LLaDAMoEModelLM"])
def test_distributions_are_not_flat(tmp_path: Path, arch: str) -> None:
    """Max probabilities over random contexts spread over (0, 1): confident and unsure
    positions both occur, so threshold-based unmasking has something to decide."""
    p = _max_probs(make_tiny_checkpoint(arch, tmp_path, seed=2), arch)
    assert (p < 0.3).float().mean() > 0.05
    assert (p > 0.7).float().mean() > 0.1
    assert p.std() > 0.2


def test_context_changes_the_prediction(tmp_path: Path) -> None:
    """The same token at the same position gets different distributions in different contexts
    (the network is far from the identity, so attention bugs show in the logits)."""
    model, _, _ = load_model(make_tiny_checkpoint("SDARForCausalLM", tmp_path, seed=3))
    gen = torch.Generator().manual_seed(1)
    last = []
    for _ in range(8):
        ids = torch.randint(0, 480, (8,), generator=gen)
        ids[-1] = 100
        last.append(forward_full(model, ids, AttentionMask.FULL)[-1].softmax(-1))
    tv = [0.5 * (last[0] - q).abs().sum().item() for q in last[1:]]
    assert min(tv) > 0.1


def test_a_changed_factory_fails_the_weights_check(tmp_path: Path) -> None:
    """The reference vectors' weights check (``tests/refvector_replay.check_factory_weights``):
    the recorded bytes pass; other bytes pass only with the recorded profile, which another
    seed, one zeroed row or one rescaled tensor do not have."""
    from safetensors.torch import save_file

    from dllm.testing.factory import profile_mismatch, weights_digest, weights_profile
    from tests.refvector_replay import DATA, check_factory_weights

    vector = json.loads(next(DATA.glob("dream_*.json")).read_text())
    c = vector["checkpoint"]
    path = make_tiny_checkpoint(c["architecture"], tmp_path / "same", seed=c["seed"],
                                **c["overrides"])
    check_factory_weights(path, c, "same")  # the recorded bytes, or the recorded profile
    assert not profile_mismatch(weights_profile(path), weights_profile(path))
    other = make_tiny_checkpoint(c["architecture"], tmp_path / "seed", seed=c["seed"] + 1,
                                 **c["overrides"])
    with pytest.raises(AssertionError, match="factory's weights changed"):
        check_factory_weights(other, c, "another seed")
    tensors = load_file(str(path / "model.safetensors"))
    for label, edit in (("a zeroed row", lambda t: t["model.embed_tokens.weight"][7].zero_()),
                        ("a rescaled norm", lambda t: t["model.norm.weight"].mul_(1.01))):
        changed = {k: v.clone() for k, v in tensors.items()}
        edit(changed)
        where = tmp_path / label.replace(" ", "_")
        where.mkdir()
        save_file(changed, str(where / "model.safetensors"))
        assert weights_digest(where) != c["weights_sha256"]
        with pytest.raises(AssertionError, match="factory's weights changed"):
            check_factory_weights(where, c, label)
