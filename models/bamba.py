"""IBM Bamba (``BambaForCausalLM``): Mamba2 layers with attention at ``attn_layer_indices``,
a SwiGLU ``feed_forward`` in every layer.

As transformers 4.57's ``modeling_bamba.py``: per layer ``x += mixer(rmsnorm(x))`` then
``x += feed_forward(rmsnorm(x))``; attention with RoPE on the first half of each head
(``BambaConfig`` fixes ``partial_rotary_factor`` 0.5 and θ = 10000 and ignores
``attn_rotary_emb``), scale ``head_dim ** -0.5``.

Checkpoint names: ``model.embed_tokens``, ``model.layers.{i}.{input_layernorm,
pre_ff_layernorm}``, ``…mamba.*`` or ``…self_attn.{q,k,v,o}_proj``,
``…feed_forward.{gate,up,down}_proj``, ``model.final_layernorm``, ``lm_head``."""

from __future__ import annotations

import torch
from torch import nn

from dllm.models.attention import StateBatch
from dllm.models.config import ModelConfig
from dllm.models.decoder import AttentionSpec, SelfAttention
from dllm.models.hybrid import HybridLM, Mamba2Layer, layer_indices
from dllm.models.layers import RMSNorm, RopeSpec, SwiGLUMLP, VocabEmbedding, check_silu
from dllm.models.mamba2 import Mamba2Dims


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, is_mamba: bool, index: int, attn: AttentionSpec,
                 dims: Mamba2Dims):
        super().__init__()
        h, eps = config.get_int("hidden_size"), config.get_float("rms_norm_eps", 1e-6)
        self.is_mamba = is_mamba
        self.input_layernorm = RMSNorm(h, eps)
        if is_mamba:
            self.mamba = Mamba2Layer(dims, index)
        else:
            self.self_attn = SelfAttention(attn, index)
        self.pre_ff_layernorm = RMSNorm(h, eps)
        self.feed_forward = SwiGLUMLP(h, config.get_int("intermediate_size"))

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                batch: StateBatch) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.mamba.run(h, batch) if self.is_mamba
                 else self.self_attn(positions, h, batch))
        return x + self.feed_forward(self.pre_ff_layernorm(x))


def bamba_attention_spec(config: ModelConfig) -> AttentionSpec:
    hidden = config.get_int("hidden_size")
    heads = config.get_int("num_attention_heads")
    head_dim = config.get_int("head_dim", hidden // heads)
    return AttentionSpec(hidden, heads, config.get_int("num_key_value_heads", heads), head_dim,
                         RopeSpec(head_dim, head_dim // 2, 10000.0),
                         norm_eps=config.get_float("rms_norm_eps", 1e-6))


class BambaModel(nn.Module):
    def __init__(self, config: ModelConfig, dims: Mamba2Dims):
        super().__init__()
        h, eps = config.get_int("hidden_size"), config.get_float("rms_norm_eps", 1e-6)
        attn_at = set(config.get("attn_layer_indices") or [])
        kinds = [i not in attn_at for i in range(config.get_int("num_hidden_layers"))]
        attn = bamba_attention_spec(config)
        self.embed_tokens = VocabEmbedding(config.get_int("vocab_size"), h)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(config, m, i, attn, dims)
            for m, i in zip(kinds, layer_indices(kinds), strict=True))
        self.final_layernorm = RMSNorm(h, eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: StateBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, batch)
        return self.final_layernorm(x)


class BambaForCausalLM(HybridLM):
    def __init__(self, config: ModelConfig):
        check_silu(config)
        super().__init__(config)
        self.model = BambaModel(config, self.mamba_dims)
        self.make_head(config.get_int("vocab_size"), config.get_int("hidden_size"))
