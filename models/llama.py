"""Llama (``LlamaForCausalLM``); ``attention_bias`` covers q/k/v/o, ``mlp_bias`` the MLP.
``rope_scaling`` of type ``llama3`` and ``linear`` is supported."""

from __future__ import annotations

from dllm.models.config import ModelConfig
from dllm.models.decoder import DecoderLM, SelfAttention, hf_attention_spec, hf_lm_sizes
from dllm.models.layers import SwiGLUMLP, check_silu


class LlamaForCausalLM(DecoderLM):
    def __init__(self, config: ModelConfig):
        check_silu(config)
        bias = config.get_bool("attention_bias", False)
        mlp_bias = config.get_bool("mlp_bias", False)
        spec = hf_attention_spec(config, qkv_bias=bias, out_bias=bias, qk_norm=False)
        inter = config.get_int("intermediate_size")
        super().__init__(
            config, spec,
            **hf_lm_sizes(config),
            make_attention=lambda i: SelfAttention(spec, i),
            make_mlp=lambda i: SwiGLUMLP(spec.hidden_size, inter, bias=mlp_bias),
        )
