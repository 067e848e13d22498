"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama layout with q/k/v biases (no o_proj bias)."""

from __future__ import annotations

from dllm.models.config import ModelConfig
from dllm.models.decoder import DecoderLM, SelfAttention, hf_attention_spec, hf_lm_sizes
from dllm.models.layers import SwiGLUMLP, check_silu
from dllm.models.qwen3 import reject_sliding_window


class Qwen2ForCausalLM(DecoderLM):
    def __init__(self, config: ModelConfig):
        check_silu(config)
        reject_sliding_window(config)
        spec = hf_attention_spec(config, qkv_bias=True, out_bias=False, qk_norm=False)
        inter = config.get_int("intermediate_size")
        super().__init__(
            config, spec,
            **hf_lm_sizes(config),
            make_attention=lambda i: SelfAttention(spec, i),
            make_mlp=lambda i: SwiGLUMLP(spec.hidden_size, inter),
        )
