"""The naive hybrid reference (tests/naive_hybrid.py) against transformers 4.57's full
no-cache forward and greedy ``generate`` (the vectors of scripts/refvectors/hybrid.py), and
the factory's tiny hybrid checkpoints: real tensor names, the release's layer layouts.

Logit bounds are 1e-5 relative to the largest logit (|logit| reaches ~20 here; transformers
runs fp32, the reference float64)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm.testing.factory import make_tiny_hybrid_checkpoint
from tests.refvector_replay import check_factory_weights

sys.path.insert(0, str(Path(__file__).parent))
from naive_hybrid import block_causal_mask, load, naive_logits  # noqa: E402
from test_mamba2_mixer import close, decode_b64  # noqa: E402

DATA = Path(__file__).parent / "data" / "refvectors"
VECTORS = sorted(p.stem.removeprefix("hybrid_") for p in DATA.glob("hybrid_*.json"))


@pytest.fixture(scope="module", params=VECTORS)
def vector(request, tmp_path_factory):
    record = json.loads((DATA / f"hybrid_{request.param}.json").read_text())
    ck = record["checkpoint"]
    path = make_tiny_hybrid_checkpoint(ck["layout"], tmp_path_factory.mktemp(request.param),
                                       seed=ck["seed"], **ck["overrides"])
    check_factory_weights(path, ck, ck["layout"])
    return record, path, load(path)


def test_vectors_cover_every_architecture() -> None:
    assert {"granite_h_micro", "granite_h_micro_rope", "granite_h_tiny", "bamba", "mamba2",
            "nemotron_h"} <= set(VECTORS)


def test_full_forward_logits_equal_the_reference(vector) -> None:
    record, path, loaded = vector
    for entry in record["logits"]:
        want = decode_b64(entry["float32_b64"], entry["shape"])
        got = naive_logits(path, entry["tokens"], loaded=loaded)
        assert close(got, want) <= 1e-5, entry["prompt"]


def test_greedy_ids_equal_generate(vector) -> None:
    """Each generated id is the argmax of the naive full forward at the position before it
    (transformers' decode path, through its cache, against a full recompute)."""
    record, path, loaded = vector
    for prompt, out in zip(record["prompts"], record["outputs"], strict=True):
        logits = naive_logits(path, prompt + out, loaded=loaded)
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out


def test_attention_mask_is_block_causal_and_the_ssm_causal(tmp_path: Path) -> None:
    """With a block-causal mask, a block's logits depend on its own and earlier blocks only;
    inside a block attention sees ahead, so its rows differ from the causal forward, while
    the rows of a mamba-only prefix do not."""
    path = make_tiny_hybrid_checkpoint("granite-h-micro", tmp_path)
    loaded = load(path)
    ids = list(range(10, 26))
    mask = block_causal_mask(16, 4)
    base = naive_logits(path, ids, mask, loaded=loaded)
    changed = ids[:12] + [40, 41, 42, 43]
    other = naive_logits(path, changed, block_causal_mask(16, 4), loaded=loaded)
    assert torch.equal(base[:12], other[:12]) and not torch.equal(base[12:], other[12:])
    causal = naive_logits(path, ids, loaded=loaded)
    assert torch.equal(causal, naive_logits(path, ids, torch.ones(16, 16).tril().bool(),
                                            loaded=loaded))
    assert not torch.allclose(causal[:4], base[:4])  # attention sees ahead within block 0
    assert block_causal_mask(6, 2, offset=2).int().tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]


NAMES = {
    "granite-h-micro": ["model.embed_tokens.weight", "model.norm.weight",
                        "model.layers.0.mamba.in_proj.weight", "model.layers.0.mamba.conv1d.weight",
                        "model.layers.0.mamba.conv1d.bias", "model.layers.0.mamba.dt_bias",
                        "model.layers.0.mamba.A_log", "model.layers.0.mamba.D",
                        "model.layers.0.mamba.norm.weight", "model.layers.0.mamba.out_proj.weight",
                        "model.layers.1.self_attn.q_proj.weight",
                        "model.layers.1.shared_mlp.input_linear.weight",
                        "model.layers.3.post_attention_layernorm.weight"],
    "granite-h-tiny": ["model.layers.0.block_sparse_moe.router.layer.weight",
                       "model.layers.0.block_sparse_moe.input_linear.weight",
                       "model.layers.0.block_sparse_moe.output_linear.weight",
                       "model.layers.2.self_attn.o_proj.weight",
                       "model.layers.2.shared_mlp.output_linear.weight"],
    "bamba": ["model.final_layernorm.weight", "lm_head.weight",
              "model.layers.0.pre_ff_layernorm.weight", "model.layers.0.mamba.A_log",
              "model.layers.1.self_attn.k_proj.weight", "model.layers.1.feed_forward.gate_proj.weight"],
    "nemotron-h": ["backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight",
                   "backbone.layers.0.norm.weight", "backbone.layers.0.mixer.in_proj.weight",
                   "backbone.layers.0.mixer.conv1d.weight", "backbone.layers.0.mixer.D",
                   "backbone.layers.1.mixer.up_proj.weight", "backbone.layers.3.mixer.q_proj.weight",
                   "backbone.layers.6.mixer.gate.weight",
                   "backbone.layers.6.mixer.gate.e_score_correction_bias",
                   "backbone.layers.6.mixer.experts.3.down_proj.weight",
                   "backbone.layers.6.mixer.shared_experts.up_proj.weight"],
    "mamba2": ["backbone.embeddings.weight", "backbone.layers.2.mixer.out_proj.weight",
               "backbone.layers.2.norm.weight", "backbone.norm_f.weight", "lm_head.weight"],
}


@pytest.mark.parametrize("layout", sorted(NAMES))
def test_tiny_checkpoint_names_and_layout(layout: str, tmp_path: Path) -> None:
    path = make_tiny_hybrid_checkpoint(layout, tmp_path)
    config = json.loads((path / "config.json").read_text())
    names = set(load_file(str(path / "model.safetensors")))
    assert set(NAMES[layout]) <= names
    assert "lm_head.weight" not in names if config.get("tie_word_embeddings") else True
    if layout == "nemotron-h":
        pattern = config["hybrid_override_pattern"]
        assert set(pattern) == {"M", "*", "-", "E"} and config["num_hidden_layers"] == len(pattern)
        for i, kind in enumerate(pattern):  # one norm and one mixer per layer, by kind
            mixer = {n.split(".")[4] for n in names if n.startswith(f"backbone.layers.{i}.mixer.")}
            assert mixer == {"M": {"in_proj", "conv1d", "dt_bias", "A_log", "D", "norm",
                                   "out_proj"},
                             "*": {"q_proj", "k_proj", "v_proj", "o_proj"},
                             "-": {"up_proj", "down_proj"},
                             "E": {"gate", "experts", "shared_experts"}}[kind]
    if config["architectures"][0] != "NemotronHForCausalLM":
        heads = config.get("mamba_n_heads", config.get("num_heads"))
        assert config.get("mamba_n_groups", config.get("n_groups")) > 1
        assert heads % config.get("mamba_n_groups", config.get("n_groups")) == 0
