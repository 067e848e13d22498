"""Our models against transformers' implementation of the same layout, loaded from the same
factory checkpoint: Qwen3/Qwen2/Llama (causal), SDAR (= Qwen3) and Fast-dLLM v2 (= Qwen2)
block-causal over a paged cache, SDAR-MoE (= Qwen3-MoE), LLaDA-MoE (= Qwen3-MoE without top-k
renormalisation) and Dream (= Qwen2) with full attention. transformers runs the whole sequence
with an explicit 4-D additive mask (eager attention)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from dllm.models.loader import load_model
from dllm.runner.attention.mask import visibility
from dllm.runner.forward_batch import AttentionMask, ForwardMode
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import CachedSequence, forward_full

TOL = 1e-4


def _ids(n: int, seed: int = 0, vocab: int = 480) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_mask(kind: AttentionMask, n: int, block: int = 1) -> torch.Tensor:
    """``[1, 1, n, n]`` additive float mask (0 visible, dtype-min hidden)."""
    idx = torch.arange(n)
    allowed = visibility(kind, idx, idx, block)
    mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


@torch.no_grad()
def _hf_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids[None], attention_mask=mask, position_ids=torch.arange(len(ids))[None],
                use_cache=False)
    return out.logits[0]


def _hf(cls: type, path: Path) -> torch.nn.Module:
    return cls.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"])
@pytest.mark.parametrize("tied", [False, True])
def test_causal_lm_matches_transformers(tmp_path: Path, arch: str, tied: bool) -> None:
    make_tiny_checkpoint(arch, tmp_path, seed=3, tie_word_embeddings=tied)
    ours, _, _ = load_model(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    ids = _ids(21)
    got = forward_full(ours, ids, AttentionMask.CAUSAL)
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
    assert (ours.lm_head is None) == tied
    assert (got - want).abs().max().item() < TOL


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    make_tiny_checkpoint("LlamaForCausalLM", tmp_path, seed=1, rope_scaling=scaling)
    ours, _, _ = load_model(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    ids = _ids(80, seed=2)
    got = forward_full(ours, ids, AttentionMask.CAUSAL)
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
    assert (got - want).abs().max().item() < TOL


def test_causal_decode_over_cache_matches_full(tmp_path: Path) -> None:
    make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, seed=4)
    model, _, _ = load_model(tmp_path)
    ids = _ids(12, seed=5)
    full = forward_full(model, ids, AttentionMask.CAUSAL)
    seq = CachedSequence(model, 16)
    prefill = seq.extend(ids[:9], AttentionMask.CAUSAL)
    steps = [seq.extend(ids[i : i + 1], AttentionMask.CAUSAL, mode=ForwardMode.DECODE)
             for i in range(9, 12)]
    assert (prefill - full[:9]).abs().max().item() < TOL
    assert (torch.cat(steps) - full[9:]).abs().max().item() < TOL


def _block_diffusion_against_hf(path: Path, hf_model: torch.nn.Module, block: int,
                                prefix_blocks: int) -> None:
    """Prefill ``prefix_blocks`` blocks block-causally, then denoise one block twice (the
    first step's KV must be overwritten) and compare with transformers on the whole sequence."""
    model, _, _ = load_model(path)
    n = (prefix_blocks + 1) * block
    ids = _ids(n, seed=7)
    noisy = ids.clone()
    noisy[-block:] = _ids(block, seed=8)  # a first, different content of the last block
    mask = _hf_mask(AttentionMask.BLOCK_CAUSAL, n, block)
    want_noisy = _hf_logits(hf_model, noisy, mask)
    want = _hf_logits(hf_model, ids, mask)

    seq = CachedSequence(model, n + block)
    prefix = seq.extend(ids[:-block], AttentionMask.BLOCK_CAUSAL, block)
    step1 = seq.extend(noisy[-block:], AttentionMask.BLOCK_CAUSAL, block,
                       mode=ForwardMode.DLLM_EXTEND, advance=False)
    step2 = seq.extend(ids[-block:], AttentionMask.BLOCK_CAUSAL, block,
                       mode=ForwardMode.DLLM_EXTEND)
    assert (prefix - want[:-block]).abs().max().item() < TOL
    assert (step1 - want_noisy[-block:]).abs().max().item() < TOL
    assert (step2 - want[-block:]).abs().max().item() < TOL
    # The uncached forward agrees too.
    full = forward_full(model, ids, AttentionMask.BLOCK_CAUSAL, block)
    assert (full - want).abs().max().item() < TOL
    # Block-causal differs from causal: the test would catch a causal backend.
    causal = _hf_logits(hf_model, ids, _hf_mask(AttentionMask.CAUSAL, n))
    assert (causal[-block:] - want[-block:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("tied", [True, False])
def test_sdar_block_matches_qwen3(tmp_path: Path, tied: bool) -> None:
    make_tiny_checkpoint("SDARForCausalLM", tmp_path, seed=11, tie_word_embeddings=tied)
    _block_diffusion_against_hf(tmp_path, _hf(Qwen3ForCausalLM, tmp_path), block=4,
                                prefix_blocks=3)


def test_fast_dllm_block_matches_qwen2(tmp_path: Path) -> None:
    make_tiny_checkpoint("Fast_dLLM_QwenForCausalLM", tmp_path, seed=12, bd_size=8)
    _block_diffusion_against_hf(tmp_path, _hf(Qwen2ForCausalLM, tmp_path), block=8,
                                prefix_blocks=2)


@pytest.mark.parametrize("mlp_only_layers", [[], [0]])
def test_sdar_moe_block_matches_qwen3_moe(tmp_path: Path, mlp_only_layers: list[int]) -> None:
    make_tiny_checkpoint("SDARMoeForCausalLM", tmp_path, seed=13,
                         mlp_only_layers=mlp_only_layers)
    _block_diffusion_against_hf(tmp_path, _hf(Qwen3MoeForCausalLM, tmp_path), block=4,
                                prefix_blocks=2)


def test_sdar_moe_without_renormalisation(tmp_path: Path) -> None:
    make_tiny_checkpoint("SDARMoeForCausalLM", tmp_path, seed=14, norm_topk_prob=False,
                         num_experts_per_tok=3)
    _block_diffusion_against_hf(tmp_path, _hf(Qwen3MoeForCausalLM, tmp_path), block=4,
                                prefix_blocks=1)


def test_dream_full_attention_matches_qwen2(tmp_path: Path) -> None:
    make_tiny_checkpoint("DreamModel", tmp_path, seed=15)
    ours, _, _ = load_model(tmp_path)
    ref = _hf(Qwen2ForCausalLM, tmp_path)
    ids = _ids(19, seed=16)
    want = _hf_logits(ref, ids, _hf_mask(AttentionMask.FULL, 19))
    got = forward_full(ours, ids, AttentionMask.FULL)
    assert (got - want).abs().max().item() < TOL
    causal = _hf_logits(ref, ids, _hf_mask(AttentionMask.CAUSAL, 19))
    assert (causal - want).abs().max().item() > 1e-2


def _qwen3_moe_from_llada_moe(path: Path) -> torch.nn.Module:
    c = json.loads((path / "config.json").read_text())
    heads = c["num_attention_heads"]
    freq = c["moe_layer_freq"]
    config = Qwen3MoeConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["dense_intermediate_size"],
        moe_intermediate_size=c["expert_intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["hidden_size"] // heads,
        rope_theta=c["rope_theta"], rms_norm_eps=c["rms_norm_eps"],
        max_position_embeddings=c["max_position_embeddings"], num_experts=c["num_experts"],
        num_experts_per_tok=c["num_experts_per_tok"], norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[i for i, f in enumerate(freq) if not f],
        tie_word_embeddings=False, attn_implementation="eager")
    model = Qwen3MoeForCausalLM(config).eval()
    model.load_state_dict(load_file(path / "model.safetensors"), strict=True)
    return model


@pytest.mark.parametrize("freq", [[1, 1], [0, 1]])
def test_llada_moe_matches_qwen3_moe_without_renormalisation(tmp_path: Path,
                                                            freq: list[int]) -> None:
    make_tiny_checkpoint("LLaDAMoEModelLM", tmp_path, seed=17, moe_layer_freq=freq,
                         num_experts_per_tok=3)
    ours, _, _ = load_model(tmp_path)
    ref = _qwen3_moe_from_llada_moe(tmp_path)
    ids = _ids(23, seed=18)
    want = _hf_logits(ref, ids, _hf_mask(AttentionMask.FULL, 23))
    got = forward_full(ours, ids, AttentionMask.FULL)
    assert (got - want).abs().max().item() < TOL
