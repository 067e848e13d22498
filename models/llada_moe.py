"""LLaDA-MoE (``LLaDAMoEModelLM``, ``model_type`` "llada" in the released configs): an
OLMoE-style network with HF names, full attention.

Per layer: ``self_attn.{q,k,v,o}_proj`` (biases when ``attention_bias``), per-head
``self_attn.q_norm``/``k_norm`` when ``qk_layernorm``; ``moe_layer_freq[i]`` picks a dense
``mlp.{gate,up,down}_proj`` (``dense_intermediate_size``) or a MoE block: ``mlp.gate``,
``mlp.experts.{e}.*`` (``expert_intermediate_size``), optional ``mlp.expert_bias`` and an optional
layer-level ``shared_expert.*`` (``shared_expert_intermediate_size``). As in the reference the
router is a float32 softmax whose top-k weights are not renormalised (its ``norm_topk_prob`` is
forced off and ``moe_router_score_function`` is not read); ``expert_bias`` is added to the
probabilities before the top-k."""

from __future__ import annotations

from torch import nn

from dllm.models.config import ModelConfig
from dllm.models.decoder import AttentionSpec, DecoderLM, SelfAttention
from dllm.models.layers import RopeSpec, SwiGLUMLP, check_silu
from dllm.models.moe import SoftmaxMoE
from dllm.models.weights import STACK_EXPERTS, WeightRule


class LLaDAMoEModelLM(DecoderLM):
    checkpoint_rules = (
        STACK_EXPERTS,
        WeightRule(r"model\.layers\.(?P<l>\d+)\.shared_expert\.(?P<rest>.+)",
                   r"model.layers.\g<l>.mlp.shared_expert.\g<rest>"),
    )

    def __init__(self, config: ModelConfig):
        check_silu(config)
        if config.get("clip_qkv") is not None:
            raise NotImplementedError("clip_qkv is not supported")
        hidden = config.get_int("hidden_size")
        heads = config.get_int("num_attention_heads")
        head_dim = hidden // heads
        bias = config.get_bool("attention_bias", False)
        spec = AttentionSpec(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=config.get_int("num_key_value_heads", heads),
            head_dim=head_dim,
            rope=RopeSpec.from_config(config, head_dim),
            qkv_bias=bias,
            out_bias=bias,
            qk_norm=config.get_bool("qk_layernorm", False),
            norm_eps=config.get_float("rms_norm_eps", 1e-5),
        )
        num_layers = config.get_int("num_hidden_layers")
        freq = config.get_list("moe_layer_freq", [1] * num_layers)
        shared = config.get_int("shared_expert_intermediate_size", 0)

        def make_mlp(i: int) -> nn.Module:
            if not freq[i]:
                return SwiGLUMLP(hidden, config.get_int("dense_intermediate_size"))
            return SoftmaxMoE(
                hidden,
                num_experts=config.get_int("num_experts"),
                top_k=config.get_int("num_experts_per_tok"),
                intermediate_size=config.get_int("expert_intermediate_size"),
                renormalize=False,
                expert_bias=config.get_bool("moe_router_enable_expert_bias", False),
                shared_intermediate_size=shared if shared > 0 else None,
            )

        super().__init__(
            config, spec,
            num_layers=num_layers,
            vocab_size=config.get_int("vocab_size"),
            tie_word_embeddings=config.get_bool("tie_word_embeddings", False),
            make_attention=lambda i: SelfAttention(spec, i),
            make_mlp=make_mlp,
        )
