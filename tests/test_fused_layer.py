"""q/k/v and gate/up packed at load (the loader copies each checkpoint projection into its rows),
and the runner's ``FusedDecoderLayer`` (the residual steps carried into the projections) with the
reference ops: both compute what the checkpoint's separate projections and the plain layer do."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dllm.models.layers import PackedLinear
from dllm.models.loader import WeightLoadError, load_model
from dllm.models.ops import install_ops
from dllm.runner.forward_batch import AttentionMask
from dllm.runner.fused_layer import (
    FusedDecoderLayer,
    PreNormed,
    ResidualFusion,
    fuse_decoder_layers,
)
from dllm.testing import make_tiny_checkpoint
from dllm.testing.harness import forward_full

ARCHS = ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "SDARMoeForCausalLM", "LLaDAModelLM",
         "LLaDA2MoeModelLM", "LLaDAMoEModelLM"]


def test_packed_rows_are_the_checkpoint_tensors(tmp_path) -> None:
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, seed=3)
    model, _, _ = load_model(path)
    ckpt = load_file(str(path / "model.safetensors"))
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    attn = model.model.layers[1].self_attn
    p = "model.layers.1.self_attn."
    for i, sub in enumerate(("q_proj", "k_proj", "v_proj")):
        assert torch.equal(attn.qkv_proj.weight[attn.qkv_proj.shard_rows(i)],
                           ckpt[p + sub + ".weight"])
    mlp = model.model.layers[1].mlp
    assert torch.equal(mlp.gate_up_proj.weight[mlp.gate_up_proj.shard_rows(1)],
                       ckpt["model.layers.1.mlp.up_proj.weight"])


def test_a_missing_shard_is_named(tmp_path) -> None:
    from safetensors.torch import save_file

    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, seed=3)
    ckpt = load_file(str(path / "model.safetensors"))
    del ckpt["model.layers.0.self_attn.k_proj.weight"]
    save_file(ckpt, str(path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(path)


def test_packed_linear_rows() -> None:
    lin = PackedLinear(4, [6, 2, 2])
    assert lin.weight.shape == (10, 4)
    assert [lin.shard_rows(i) for i in range(3)] == [slice(0, 6), slice(6, 8), slice(8, 10)]


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_layers_equal_the_plain_ones(tmp_path, arch) -> None:
    """With the reference ops, the fused layers take exactly the plain layers' steps."""
    path = make_tiny_checkpoint(arch, tmp_path, seed=3)
    model, _, _ = load_model(path)
    ids = list(range(5, 40))
    want = forward_full(model, ids, AttentionMask.CAUSAL)
    install_ops(model, ResidualFusion())
    n = len(model.model.layers)
    assert fuse_decoder_layers(model) == n
    assert all(isinstance(layer, FusedDecoderLayer) for layer in model.model.layers)
    assert fuse_decoder_layers(model) == 0  # already fused
    got = forward_full(model, ids, AttentionMask.CAUSAL)
    assert torch.equal(got, want)


class _HalfNormingOps(ResidualFusion):
    """Reference ops whose ``linear_residual`` hands on a ``PreNormed`` the way a fused
    kernel does (the stream, and NaN where a reference consumer must not look)."""

    def linear_residual(self, x, layer, residual, next_weight, eps):
        s = residual + self.linear(x, layer)
        nan = torch.full_like(s, float("nan"))
        return PreNormed(s, nan, torch.full((4, s.shape[0]), float("nan")), next_weight), None


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LLaDA2MoeModelLM"])
def test_a_prenormed_pair_is_normalised_from_its_stream(tmp_path, arch) -> None:
    """Every consumer of a ``PreNormed`` in the reference ops reads its stream: layers that
    hand each other half-normalised pairs, as the fused kernels do, equal the plain layers."""
    path = make_tiny_checkpoint(arch, tmp_path, seed=3)
    model, _, _ = load_model(path)
    ids = list(range(5, 40))
    want = forward_full(model, ids, AttentionMask.CAUSAL)
    install_ops(model, _HalfNormingOps())
    fuse_decoder_layers(model)
    assert torch.equal(forward_full(model, ids, AttentionMask.CAUSAL), want)
