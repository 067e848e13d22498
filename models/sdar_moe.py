"""SDAR-MoE / TraDo-MoE (``SDARMoeForCausalLM``): the Qwen3-MoE network.

Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
is nonzero; sparse layers route with a float32 softmax over ``num_experts``, take the top
``num_experts_per_tok`` and renormalise when ``norm_topk_prob``. Checkpoint experts
``mlp.experts.{e}.{gate,up,down}_proj.weight`` are stacked into ``mlp.experts.{proj}``."""

from __future__ import annotations

from torch import nn

from dllm.models.config import ModelConfig
from dllm.models.decoder import DecoderLM, SelfAttention, hf_attention_spec, hf_lm_sizes
from dllm.models.layers import SwiGLUMLP, check_silu
from dllm.models.moe import SoftmaxMoE
from dllm.models.qwen3 import reject_sliding_window
from dllm.models.weights import STACK_EXPERTS


def qwen3_moe_is_sparse(config: ModelConfig, layer: int) -> bool:
    step = config.get_int("decoder_sparse_step", 1)
    return (layer not in config.get_list("mlp_only_layers", [])
            and config.get_int("num_experts", 0) > 0 and (layer + 1) % step == 0)


class SDARMoeForCausalLM(DecoderLM):
    checkpoint_rules = (STACK_EXPERTS,)

    def __init__(self, config: ModelConfig):
        check_silu(config)
        reject_sliding_window(config)
        bias = config.get_bool("attention_bias", False)
        spec = hf_attention_spec(config, qkv_bias=bias, out_bias=bias, qk_norm=True)

        def make_mlp(i: int) -> nn.Module:
            if not qwen3_moe_is_sparse(config, i):
                return SwiGLUMLP(spec.hidden_size, config.get_int("intermediate_size"))
            return SoftmaxMoE(
                spec.hidden_size,
                num_experts=config.get_int("num_experts"),
                top_k=config.get_int("num_experts_per_tok"),
                intermediate_size=config.get_int("moe_intermediate_size"),
                renormalize=config.get_bool("norm_topk_prob", False),
            )

        super().__init__(
            config, spec,
            **hf_lm_sizes(config),
            make_attention=lambda i: SelfAttention(spec, i),
            make_mlp=make_mlp,
        )
