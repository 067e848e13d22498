"""LLaDA2.0 / 2.1 (``LLaDA2MoeModelLM``), the Ling/Bailing-MoE-v2 network trained for block
diffusion.

Checkpoint names (``model.`` prefix): ``word_embeddings``; per layer ``input_layernorm``,
``attention.query_key_value`` (fused ``[Q | K | V]`` by heads), ``attention.query_layernorm`` /
``key_layernorm`` (per-head RMSNorm before RoPE), ``attention.dense``,
``post_attention_layernorm``; the first ``first_k_dense_replace`` layers have a dense
``mlp.{gate,up,down}_proj``, the rest ``mlp.gate.weight`` + ``mlp.gate.expert_bias``,
``mlp.experts.{e}.*`` and ``mlp.shared_experts.*``; ``norm``; ``lm_head``. RoPE is partial
(``partial_rotary_factor`` 0.5). Routing: float32 sigmoid scores, ``expert_bias`` added for the
choice only, group-limited top-k (``n_group``/``topk_group``), weights normalised then
× ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm.models.config import ModelConfig
from dllm.models.decoder import AttentionSpec, DecoderLM, SelfAttention, hf_lm_sizes
from dllm.models.layers import RopeSpec, SwiGLUMLP, check_silu
from dllm.models.moe import StackedExperts
from dllm.models.ops import UsesOps
from dllm.models.parallel import all_reduce
from dllm.models.weights import STACK_EXPERTS, WeightRule

_ATTN = r"model\.layers\.(?P<l>\d+)\.attention\."
_SELF_ATTN = r"model.layers.\g<l>.self_attn."


class LLaDA2Gate(nn.Module):
    """Router weight ``[E, H]`` and ``expert_bias`` ``[E]``, both kept in float32."""

    fp32_params = ("weight", "expert_bias")

    def __init__(self, hidden_size: int, num_experts: int, expert_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size).normal_(std=0.02))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> float32 [T, E]
        return F.linear(x.float(), self.weight.float())


class LLaDA2MoE(UsesOps, nn.Module):
    def __init__(self, config: ModelConfig, hidden_size: int):
        super().__init__()
        num_experts = config.get_int("num_experts")
        self.top_k = config.get_int("num_experts_per_tok")
        self.score_function = config.get_str("score_function", "sigmoid")
        if self.score_function not in ("sigmoid", "softmax"):
            raise NotImplementedError(f"score_function {self.score_function!r}")
        self.n_group = config.get_int("n_group", 1)
        self.topk_group = config.get_int("topk_group", self.n_group)
        self.renormalize = config.get_bool("norm_topk_prob", True)
        self.scaling = config.get_float("routed_scaling_factor", 1.0)
        has_bias = config.get_bool("moe_router_enable_expert_bias",
                                   self.score_function == "sigmoid")
        self.gate = LLaDA2Gate(hidden_size, num_experts, has_bias)
        self.experts = StackedExperts(num_experts, hidden_size,
                                      config.get_int("moe_intermediate_size"))
        num_shared = config.get_int("num_shared_experts", 0)
        shared = config.get_int("moe_shared_expert_intermediate_size",
                                config.get_int("moe_intermediate_size")) * num_shared
        self.shared_experts = SwiGLUMLP(hidden_size, shared) if num_shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 weights and int64 expert ids, ``[T, K]``."""
        logits = self.gate(x)
        if self.score_function == "softmax":
            weights, ids = self.ops.moe_route_softmax(logits, self.top_k, self.renormalize)
            return weights * self.scaling, ids
        return self.ops.moe_route_sigmoid(logits, self.top_k, self.n_group, self.topk_group,
                                          self.gate.expert_bias, self.renormalize, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.route(x)
        out = all_reduce(self.experts(x, ids, weights), self.experts.tp)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def llada2_attention_spec(config: ModelConfig) -> AttentionSpec:
    hidden = config.get_int("hidden_size")
    heads = config.get_int("num_attention_heads")
    head_dim = config.get_int("head_dim", hidden // heads)
    use_bias = config.get_bool("use_bias", False)
    return AttentionSpec(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=config.get_int("num_key_value_heads", heads),
        head_dim=head_dim,
        rope=RopeSpec.from_config(config, head_dim),
        qkv_bias=use_bias or config.get_bool("use_qkv_bias", False),
        out_bias=use_bias,
        qk_norm=config.get_bool("use_qk_norm", True),
        norm_eps=config.get_float("rms_norm_eps", 1e-6),
    )


class LLaDA2MoeModelLM(DecoderLM):
    checkpoint_rules = (
        WeightRule(r"model\.word_embeddings\.weight", r"model.embed_tokens.weight"),
        # The fused ``[Q | K | V]`` projection is already ``qkv_proj``'s row layout.
        WeightRule(_ATTN + r"query_key_value\.(?P<w>weight|bias)", _SELF_ATTN + r"qkv_proj.\g<w>"),
        WeightRule(_ATTN + r"dense\.(?P<w>weight|bias)", _SELF_ATTN + r"o_proj.\g<w>"),
        WeightRule(_ATTN + r"query_layernorm\.weight", _SELF_ATTN + r"q_norm.weight"),
        WeightRule(_ATTN + r"key_layernorm\.weight", _SELF_ATTN + r"k_norm.weight"),
        STACK_EXPERTS,
    )

    def __init__(self, config: ModelConfig):
        check_silu(config)
        if config.get_bool("norm_head", False):
            raise NotImplementedError("norm_head=true is not supported")
        spec = llada2_attention_spec(config)
        dense_layers = config.get_int("first_k_dense_replace", 0)
        has_experts = config.get_int("num_experts", 0) > 0
        mlp_bias = config.get_bool("use_bias", False)

        def make_mlp(i: int) -> nn.Module:
            if has_experts and i >= dense_layers:
                return LLaDA2MoE(config, spec.hidden_size)
            return SwiGLUMLP(spec.hidden_size, config.get_int("intermediate_size"), bias=mlp_bias)

        super().__init__(
            config, spec,
            **hf_lm_sizes(config),
            make_attention=lambda i: SelfAttention(spec, i),
            make_mlp=make_mlp,
        )
