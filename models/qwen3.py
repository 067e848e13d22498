"""Qwen3 (``Qwen3ForCausalLM``): Llama layout with per-head q/k RMSNorm before RoPE.

Checkpoint names are the HF ones (``model.layers.{i}.self_attn.q_norm.weight`` …), so the
weight rules are the identity."""

from __future__ import annotations

from dllm.models.config import ModelConfig
from dllm.models.decoder import DecoderLM, SelfAttention, hf_attention_spec, hf_lm_sizes
from dllm.models.layers import SwiGLUMLP, check_silu


def reject_sliding_window(config: ModelConfig) -> None:
    if config.get_bool("use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not supported")


class Qwen3ForCausalLM(DecoderLM):
    def __init__(self, config: ModelConfig):
        check_silu(config)
        reject_sliding_window(config)
        bias = config.get_bool("attention_bias", False)
        spec = hf_attention_spec(config, qkv_bias=bias, out_bias=bias, qk_norm=True)
        inter = config.get_int("intermediate_size")
        super().__init__(
            config, spec,
            **hf_lm_sizes(config),
            make_attention=lambda i: SelfAttention(spec, i),
            make_mlp=lambda i: SwiGLUMLP(spec.hidden_size, inter),
        )
