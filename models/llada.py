"""LLaDA-8B / LLaDA-1.5 (``LLaDAModelLM``): an OLMo-style Llama network, full attention.

Config keys are OLMo's (``d_model``, ``n_heads``, ``n_kv_heads``, ``n_layers``,
``mlp_hidden_size``, ``embedding_size``, ``weight_tying``, ``include_bias``, ...). Checkpoint
names live under ``model.transformer.``: ``wte``, ``blocks.{i}.{attn_norm, q_proj, k_proj,
v_proj, attn_out, ff_norm, ff_proj, up_proj, ff_out}``, ``ln_f`` and the LM head ``ff_out``. In
the reference block ``ff_proj`` is the gate (SiLU applied), ``up_proj`` the linear branch and
the block's ``ff_out`` the down projection; the head's ``model.transformer.ff_out`` shares only
the suffix. RoPE is applied in float32 (``rope_full_precision``)."""

from __future__ import annotations

from dllm.models.config import ModelConfig
from dllm.models.decoder import AttentionSpec, DecoderLM, SelfAttention
from dllm.models.layers import RopeSpec, SwiGLUMLP
from dllm.models.weights import WeightRule

_BLOCK = r"model\.transformer\.blocks\.(?P<l>\d+)\."
_LAYER = r"model.layers.\g<l>."

LLADA_RULES = (
    WeightRule(r"model\.transformer\.wte\.weight", r"model.embed_tokens.weight"),
    WeightRule(r"model\.transformer\.ln_f\.weight", r"model.norm.weight"),
    WeightRule(r"model\.transformer\.ff_out\.weight", r"lm_head.weight"),
    WeightRule(_BLOCK + r"attn_norm\.weight", _LAYER + r"input_layernorm.weight"),
    WeightRule(_BLOCK + r"ff_norm\.weight", _LAYER + r"post_attention_layernorm.weight"),
    WeightRule(_BLOCK + r"(?P<p>q_proj|k_proj|v_proj)\.(?P<w>weight|bias)",
               _LAYER + r"self_attn.\g<p>.\g<w>"),
    WeightRule(_BLOCK + r"attn_out\.(?P<w>weight|bias)", _LAYER + r"self_attn.o_proj.\g<w>"),
    WeightRule(_BLOCK + r"ff_proj\.(?P<w>weight|bias)", _LAYER + r"mlp.gate_proj.\g<w>"),
    WeightRule(_BLOCK + r"up_proj\.(?P<w>weight|bias)", _LAYER + r"mlp.up_proj.\g<w>"),
    WeightRule(_BLOCK + r"ff_out\.(?P<w>weight|bias)", _LAYER + r"mlp.down_proj.\g<w>"),
)

# Reference options this implementation does not have, with the value it assumes. The values
# are the reference's enum values (``configuration_llada.py``): ``layer_norm_type`` "rms" is
# its ``RMSLayerNorm`` (float32 statistics, eps ``rms_norm_eps``), what the released
# checkpoints use.
_REQUIRED = {
    "block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu",
    "rope": True, "alibi": False, "attention_layer_norm": False, "scale_logits": False,
    "input_emb_norm": False, "clip_qkv": None, "bias_for_layer_norm": False,
}


def _check_supported(config: ModelConfig) -> None:
    for key, value in _REQUIRED.items():
        got = config.get(key)
        if got is not None and got != value:
            raise NotImplementedError(f"{config.source}: LLaDA option {key}={got!r} is not "
                                      f"supported (this implementation has {key}={value!r})")


class LLaDAModelLM(DecoderLM):
    def __init__(self, config: ModelConfig):
        _check_supported(config)
        hidden = config.get_int("d_model")
        heads = config.get_int("n_heads")
        kv_heads = config.get_int("n_kv_heads", 1 if config.get("multi_query_attention") else heads)
        head_dim = hidden // heads
        all_bias = config.get_bool("include_bias", False)
        spec = AttentionSpec(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope=RopeSpec.from_config(config, head_dim, full_precision=True),
            qkv_bias=all_bias or config.get_bool("include_qkv_bias", False),
            out_bias=all_bias,
            norm_eps=config.get_float("rms_norm_eps", 1e-5),
        )
        inter = config.get_int("mlp_hidden_size",
                               config.get_int("mlp_ratio", 4) * hidden)
        vocab = config.first_int("embedding_size", "vocab_size")
        super().__init__(
            config, spec,
            num_layers=config.get_int("n_layers"),
            vocab_size=vocab,
            tie_word_embeddings=config.get_bool("weight_tying", False),
            make_attention=lambda i: SelfAttention(spec, i),
            make_mlp=lambda i: SwiGLUMLP(hidden, inter, bias=all_bias),
        )

    @property
    def weight_rules(self) -> tuple[WeightRule, ...]:
        tied = ((WeightRule(r"model\.transformer\.ff_out\.weight", None),)
                if self.tie_word_embeddings else ())
        return (*tied, *LLADA_RULES)
