"""The released facts each tiny checkpoint copies: ``config.json``, ``generation_config.json``,
``tokenizer_config.json`` and the special tokens of a named released checkpoint, with only the
sizes shrunk (hidden, layers, heads, intermediate, experts, vocabulary) and the special-token
ids remapped into the tiny vocabulary.

The values are facts from each checkpoint's public files, kept verbatim under
``tests/data/configs/`` (with their provenance in ``SOURCES.md``); ``tests/test_factory.py``
checks every family here against them key for key. A special-token id is written as
``Tok("<string>")`` and becomes that token's id in the tiny tokenizer. The chat templates are
the released ones, verbatim, in ``chat_templates/``.

Checkpoints whose files could not be found (LLaDA-MoE, SDAR-30B-A3B) keep the keys their model
code reads, as noted at each; the autoregressive families keep the keys of transformers'
own configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class Tok:
    """A special token inside a config, written by the factory as its tiny-vocabulary id."""

    text: str


@dataclass(frozen=True)
class TokenizerSpec:
    """``added``: the release's added tokens in id order, with their ``special`` flag;
    ``config``: ``tokenizer_config.json`` without ``added_tokens_decoder`` (the factory writes
    that from ``added``); ``special_map``: ``special_tokens_map.json``; ``template_file``: the
    release's ``chat_template.jinja`` next to the tokenizer config (Fast-dLLM v2 ships its
    template only there)."""

    added: tuple[tuple[str, bool], ...]
    config: dict[str, Any]
    special_map: dict[str, Any]
    template_file: str | None = None


@cache
def chat_template(name: str) -> str:
    return resources.files("dllm.testing").joinpath("chat_templates", name).read_text("utf-8")


def _sp(text: str) -> dict[str, Any]:
    """An ``AddedToken`` as ``special_tokens_map.json`` writes it."""
    return {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False}


# Qwen2.5's added tokens (ids 151643-151664 in the release), shared by Dream, Fast-dLLM v2 and
# SDAR; the tool and FIM tokens are not special there.
_QWEN_ADDED: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
_QWEN_EXTRA = ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
               "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
               "<|video_pad|>"]


# ---- JetAstra/SDAR-4B-Chat (SDAR-8B-Chat differs only in sizes) -------------------------------
SDAR_CONFIG: dict[str, Any] = {
    "architectures": ["SDARForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig",
                 "AutoModel": "modeling_sdar.SDARModel",
                 "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "attn_implementation": "flex_attention",
    "bos_token_id": Tok("<|endoftext|>"), "debug": False, "eos_token_id": Tok("<|endoftext|>"),
    "block_size": 4, "mask_token_id": Tok("<|MASK|>"), "ep_size": 1, "fuse_cross_entropy": True,
    "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 32768, "max_window_layers": 2,
    "micro_forward": False, "model_type": "sdar", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "skip_checkpoint": False,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.52.4", "use_cache": False, "use_deepep": False,
    "use_sliding_window": False, "vocab_size": 512,
}
SDAR_GENERATION: dict[str, Any] = {
    "bos_token_id": Tok("<|endoftext|>"), "do_sample": True,
    "eos_token_id": [Tok("<|im_end|>"), Tok("<|endoftext|>")],
    "pad_token_id": Tok("<|endoftext|>"), "temperature": 0.6, "top_k": 20, "top_p": 0.95,
    "transformers_version": "4.51.0",
}
SDAR_TOKENIZER = TokenizerSpec(
    added=(*_QWEN_ADDED, ("<tool_response>", False), ("</tool_response>", False),
           ("<think>", False), ("</think>", False), ("<|MASK|>", False)),
    config={
        "add_bos_token": False, "add_prefix_space": False,
        "additional_special_tokens": [*_QWEN_EXTRA, "<|MASK|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_qwen2.Qwen2Tokenizer", None]},
        "bos_token": None, "chat_template": chat_template("sdar.jinja"),
        "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
        "mask_token": "<|MASK|>", "errors": "replace", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    },
    # The release's map names the mask "<MASK>", a string its vocabulary does not have (its
    # tokenizer_config and added tokens say "<|MASK|>" at the same id): the map is written
    # with the vocabulary's string, so the tiny tokenizer loads.
    special_map={"additional_special_tokens": [*_QWEN_EXTRA, "<|MASK|>"],
                 "eos_token": _sp("<|endoftext|>"), "pad_token": _sp("<|endoftext|>")},
    template_file="sdar.jinja",
)

# ---- SDAR-30B-A3B-Chat: its files were not found; SDAR's keys plus the Qwen3-MoE keys its
# model code reads (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
# decoder_sparse_step, mlp_only_layers, output_router_logits, router_aux_loss_coef).
SDAR_MOE_CONFIG: dict[str, Any] = {
    **{k: v for k, v in SDAR_CONFIG.items() if k not in ("architectures", "auto_map")},
    "architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe", "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}

# ---- GSAI-ML/LLaDA-8B-Instruct ------------------------------------------------------------
LLADA_CONFIG: dict[str, Any] = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0, "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                 "AutoModel": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 64,
    "embedding_dropout": 0.0, "embedding_size": 512, "eos_token_id": Tok("<|endoftext|>"),
    "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
    "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
    "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
    "mask_token_id": Tok("<|mdm_mask|>"), "max_sequence_length": 4096, "mlp_hidden_size": 128,
    "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": 4,
    "n_kv_heads": 4, "n_layers": 2, "pad_token_id": Tok("<|endoftext|>"),
    "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True,
    "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
    "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 512,
    "weight_tying": False,
}
LLADA_GENERATION: dict[str, Any] = {
    "_from_model_config": True, "bos_token_id": Tok("<|startoftext|>"),
    "eos_token_id": Tok("<|endoftext|>"), "transformers_version": "4.38.2",
}
_LLADA_EXTRA = ["<role>", "</role>", "<|arithmetic_start|>", "<|arithmetic_end|>",
                "<|number_start|>", "<|number_end|>"]
LLADA_TOKENIZER = TokenizerSpec(
    # ids 126080-126083, 126336, 126340-126348 in the release (the reserved tokens between
    # them are left out)
    added=tuple((t, True) for t in (
        "<|startoftext|>", "<|endoftext|>", "[CLS]", "[gMASK]", "<|mdm_mask|>", *_LLADA_EXTRA,
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    config={
        "add_bos_token": False, "add_eos_token": False,
        "additional_special_tokens": _LLADA_EXTRA, "bos_token": "<|startoftext|>",
        "chat_template": chat_template("llada.jinja"), "clean_up_tokenization_spaces": False,
        "cls_token": "[CLS]", "eos_token": "<|endoftext|>", "fast_tokenizer": True,
        "gmask_token": "[gMASK]", "merges_file": None,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 1000000000000000019884624838656, "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast", "trust_remote_code": True,
        "vocab_file": None,
    },
    special_map={"additional_special_tokens": _LLADA_EXTRA, "bos_token": _sp("<|startoftext|>"),
                 "cls_token": _sp("[CLS]"), "eos_token": _sp("<|endoftext|>"),
                 "pad_token": _sp("<|endoftext|>")},
)

# ---- inclusionAI/LLaDA-MoE-7B-A1B-Instruct: its files were not found; the keys its model code
# reads, with LLaDA2's tokenizer (the same vocabulary family).
LLADA_MOE_CONFIG: dict[str, Any] = {
    "architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "dense_intermediate_size": 128, "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": None, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_layer_freq": [1, 1], "moe_router_enable_expert_bias": False,
    "moe_router_score_function": "softmax", "norm_topk_prob": False, "qk_layernorm": True,
    "attention_bias": False, "clip_qkv": None, "partial_rotary_factor": 1, "rope_theta": 50000,
    "rope_scaling": None, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
    "hidden_act": "silu", "router_aux_loss_coef": 0.01, "routed_scaling_factor": 1,
    "router_num_group": None, "router_topk_group": None, "output_router_logits": False,
    "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": False,
    "tie_word_embeddings": False, "vocab_size": 512, "bos_token_id": Tok("<|startoftext|>"),
    "eos_token_id": Tok("<|endoftext|>"), "pad_token_id": Tok("<|endoftext|>"),
    "torch_dtype": "bfloat16",
}

# ---- inclusionAI/LLaDA2.0-mini-preview ----------------------------------------------------
LLADA2_CONFIG: dict[str, Any] = {
    "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128,
    "first_k_dense_replace": 1, "hidden_act": "silu", "max_position_embeddings": 8192,
    "model_type": "llada2_moe", "moe_intermediate_size": 32, "norm_topk_prob": True,
    "num_experts_per_tok": 2, "norm_head": False, "num_attention_heads": 4, "num_experts": 8,
    "num_key_value_heads": 2, "rope_theta": 600000, "rope_scaling": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.52.3",
    "use_bias": False, "use_rmsnorm": True, "rms_norm_eps": 1e-06, "head_dim": 16,
    "num_shared_experts": 1, "use_cache": False, "use_qkv_bias": False,
    "embedding_dropout": 0.0, "norm_softmax": False, "output_dropout": 0.0, "vocab_size": 512,
    "rotary_dim": 8, "using_split_qkv_in_self_attention": False, "router_dtype": "fp32",
    "moe_router_enable_expert_bias": True, "routed_scaling_factor": 2.5, "n_group": 4,
    "topk_group": 2, "score_function": "sigmoid", "initializer_range": 0.02,
    "max_window_layers": 28, "output_router_logits": False,
    "pad_token_id": Tok("<|endoftext|>"), "partial_rotary_factor": 0.5,
    "use_sliding_window": False,
}
LLADA2_GENERATION: dict[str, Any] = {
    "_from_model_config": True, "eos_token_id": Tok("<|endoftext|>"),
    "pad_token_id": Tok("<|endoftext|>"), "transformers_version": "4.46.3", "use_cache": False,
}
LLADA2_TOKENIZER = TokenizerSpec(
    # ids 156891-156900 in the release's tokenizer.json
    added=tuple((t, True) for t in ("<|startoftext|>", "<|endoftext|>", "[CLS]", "[gMASK]",
                                    "<|mask|>", "<tool_call>", "</tool_call>",
                                    "<tool_response>", "</tool_response>", "<|role_end|>")),
    config={
        "add_bos_token": False, "add_eos_token": False, "bos_token": "<|startoftext|>",
        "chat_template": chat_template("llada2.jinja"), "clean_up_tokenization_spaces": False,
        "cls_token": "[CLS]", "eos_token": "<|endoftext|>", "mask_token": "<|mask|>",
        "fast_tokenizer": True, "gmask_token": "[gMASK]", "merges_file": None,
        "model_max_length": 8192, "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast", "trust_remote_code": True,
        "vocab_file": None,
    },
    special_map={"bos_token": _sp("<|startoftext|>"), "cls_token": _sp("[CLS]"),
                 "eos_token": _sp("<|endoftext|>"), "mask_token": _sp("<|mask|>"),
                 "pad_token": _sp("<|endoftext|>")},
)

# ---- Dream-org/Dream-v0-Instruct-7B --------------------------------------------------------
DREAM_CONFIG: dict[str, Any] = {
    "_name_or_path": "Dream-org/Dream-v0-Instruct-7B", "architectures": ["DreamModel"],
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig",
                 "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": Tok("<|endoftext|>"), "eos_token_id": Tok("<|endoftext|>"),
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "mask_token_id": Tok("<|mask|>"),
    "max_position_embeddings": 131072, "max_window_layers": 2, "model_type": "Dream",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "pad_token_id": Tok("<|endoftext|>"), "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": True,
    "use_mrope": False, "use_sliding_window": False, "vocab_size": 512,
}
DREAM_GENERATION: dict[str, Any] = {
    "_from_model_config": True, "alg": "origin", "alg_temp": None,
    "bos_token_id": Tok("<|endoftext|>"), "eos_token_id": Tok("<|endoftext|>"), "eps": 0.001,
    "mask_token_id": None, "output_history": False, "pad_token_id": Tok("<|endoftext|>"),
    "steps": 512, "temperature": 0.0, "top_k": None, "top_p": None,
    "transformers_version": "4.46.2",
}
DREAM_TOKENIZER = TokenizerSpec(
    added=(*_QWEN_ADDED, ("<|beginoftext|>", True), ("<|mask|>", True)),
    config={
        "add_bos_token": False, "add_prefix_space": False,
        "additional_special_tokens": ["<|beginoftext|>", "<|mask|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "bos_token": "<|beginoftext|>", "chat_template": chat_template("qwen2.5.jinja"),
        "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
        "errors": "replace", "mask_token": "<|mask|>", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "DreamTokenizer", "unk_token": None,
    },
    special_map={"additional_special_tokens": ["<|beginoftext|>", "<|mask|>"],
                 "bos_token": _sp("<|beginoftext|>"), "eos_token": _sp("<|endoftext|>"),
                 "mask_token": _sp("<|mask|>"), "pad_token": _sp("<|endoftext|>")},
)

# ---- Efficient-Large-Model/Fast_dLLM_v2_7B -------------------------------------------------
FAST_DLLM_V2_CONFIG: dict[str, Any] = {
    "architectures": ["Fast_dLLM_QwenForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                 "AutoModel": "modeling.Fast_dLLM_QwenModel",
                 "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
    "bd_size": 32, "bos_token_id": Tok("<|endoftext|>"), "conplemenrary_mask": True,
    "eos_token_id": Tok("<|im_end|>"), "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128,
    "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 32768,
    "max_window_layers": 2, "model_type": "Fast_dLLM_Qwen", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": Tok("<|im_end|>"),
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.53.1", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 512,
}
FAST_DLLM_V2_GENERATION: dict[str, Any] = {
    "bos_token_id": Tok("<|endoftext|>"), "do_sample": True,
    "eos_token_id": [Tok("<|im_end|>"), Tok("<|endoftext|>")],
    "pad_token_id": Tok("<|endoftext|>"), "repetition_penalty": 1.05, "temperature": 0.7,
    "top_k": 20, "top_p": 0.8, "transformers_version": "4.53.1",
}
FAST_DLLM_V2_TOKENIZER = TokenizerSpec(
    added=(*_QWEN_ADDED, ("|<MASK>|", True)),
    config={
        "add_bos_token": False, "add_prefix_space": False,
        "additional_special_tokens": ["|<MASK>|"], "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "extra_special_tokens": {}, "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "padding_side": "right", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    },
    special_map={"additional_special_tokens": [_sp("|<MASK>|")], "eos_token": _sp("<|im_end|>"),
                 "pad_token": _sp("<|endoftext|>")},
    template_file="qwen2.5.jinja",
)

# ---- autoregressive families: transformers' config keys (Qwen3, Qwen2.5, Llama-3 shapes) ---
_QWEN_COMMON: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
    "vocab_size": 512, "torch_dtype": "bfloat16",
}
QWEN3_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_QWEN_COMMON,
    "head_dim": 32, "rope_theta": 1000000.0, "attention_bias": False,
    "tie_word_embeddings": True, "bos_token_id": Tok("<|endoftext|>"),
    "eos_token_id": Tok("<|im_end|>"),
}
QWEN2_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_QWEN_COMMON,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": Tok("<|endoftext|>"),
    "eos_token_id": Tok("<|im_end|>"),
}
LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    **{k: v for k, v in _QWEN_COMMON.items()
       if k not in ("use_sliding_window", "sliding_window", "max_window_layers")},
    "head_dim": 16, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "attention_bias": False,
    "mlp_bias": False, "pretraining_tp": 1, "tie_word_embeddings": False,
    "bos_token_id": Tok("<|begin_of_text|>"), "eos_token_id": Tok("<|end_of_text|>"),
}


def _chatml_tokenizer(added: tuple[str, ...], eos: str, bos: str | None,
                      pad: str | None) -> TokenizerSpec:
    return TokenizerSpec(
        added=tuple((t, True) for t in added),
        config={"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
                "pad_token": pad, "unk_token": None,
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "chat_template": chat_template("qwen2.5.jinja"), "model_max_length": 4096,
                "clean_up_tokenization_spaces": False},
        special_map={"additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                     "eos_token": _sp(eos), **({"bos_token": _sp(bos)} if bos else {}),
                     **({"pad_token": _sp(pad)} if pad else {})},
    )


QWEN_TOKENIZER = _chatml_tokenizer(("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                                   "<|im_end|>", "<|endoftext|>", "<|endoftext|>")
LLAMA_TOKENIZER = _chatml_tokenizer(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|end_of_text|>", "<|begin_of_text|>"),
    "<|end_of_text|>", "<|begin_of_text|>", "<|end_of_text|>")


@dataclass(frozen=True)
class Release:
    """One architecture's released facts: ``name`` the checkpoint copied (``None`` where its
    files were not found), and the tests/data/configs folder holding them."""

    name: str | None
    config: dict[str, Any]
    tokenizer: TokenizerSpec
    generation: dict[str, Any] | None = None
    data_dir: str | None = None
    size_keys: frozenset[str] = field(default_factory=frozenset)


RELEASES: dict[str, Release] = {
    "SDARForCausalLM": Release("JetAstra/SDAR-4B-Chat", SDAR_CONFIG, SDAR_TOKENIZER,
                               SDAR_GENERATION, "JetAstra__SDAR-4B-Chat"),
    "SDARMoeForCausalLM": Release(None, SDAR_MOE_CONFIG, SDAR_TOKENIZER, SDAR_GENERATION),
    "LLaDAModelLM": Release("GSAI-ML/LLaDA-8B-Instruct", LLADA_CONFIG, LLADA_TOKENIZER,
                            LLADA_GENERATION, "GSAI-ML__LLaDA-8B-Instruct"),
    "LLaDAMoEModelLM": Release(None, LLADA_MOE_CONFIG, LLADA2_TOKENIZER, LLADA2_GENERATION),
    "LLaDA2MoeModelLM": Release("inclusionAI/LLaDA2.0-mini-preview", LLADA2_CONFIG,
                                LLADA2_TOKENIZER, LLADA2_GENERATION,
                                "inclusionAI__LLaDA2.0-mini-preview"),
    "DreamModel": Release("Dream-org/Dream-v0-Instruct-7B", DREAM_CONFIG, DREAM_TOKENIZER,
                          DREAM_GENERATION, "Dream-org__Dream-v0-Instruct-7B"),
    "Fast_dLLM_QwenForCausalLM": Release(
        "Efficient-Large-Model/Fast_dLLM_v2_7B", FAST_DLLM_V2_CONFIG, FAST_DLLM_V2_TOKENIZER,
        FAST_DLLM_V2_GENERATION, "Efficient-Large-Model__Fast_dLLM_v2_7B"),
    "Qwen3ForCausalLM": Release(None, QWEN3_CONFIG, QWEN_TOKENIZER),
    "Qwen2ForCausalLM": Release(None, QWEN2_CONFIG, QWEN_TOKENIZER),
    "LlamaForCausalLM": Release(None, LLAMA_CONFIG, LLAMA_TOKENIZER),
}


# =============================================================================================
# Hybrid Mamba2 + attention architectures (issue 20), served autoregressively. Kept apart
# from ``RELEASES`` (their weights follow their own laws): the factory builds them with
# ``make_tiny_hybrid_checkpoint``, which ``make_tiny_checkpoint`` calls for them.
#
# The released ``config.json`` files of these checkpoints were not found in any public copy
# the search tools hold (hub downloads are not reachable here), so none is kept under
# tests/data/configs. The keys below are the ones each architecture's model code and config
# class read (transformers 4.57 ``GraniteMoeHybridConfig``, ``BambaConfig``, ``Mamba2Config``;
# NVIDIA's hub ``configuration_nemotron_h.py`` for Nemotron-H), with the released values where
# public secondary sources quote them (noted at each), and tiny sizes. Sizes deliberately
# exercise the math: ``n_groups`` 2 (> 1, heads a multiple of groups), conv kernel 4, a chunk
# of 8 tokens (prompts cross several chunks), mamba and attention layers mixed, top-2 MoE.
# =============================================================================================

# ---- ibm-granite/granite-4.0-h-micro (dense: only shared_mlp) ------------------------------
# Released values quoted by public copies: embedding_multiplier 12, residual_multiplier 0.22,
# attention_multiplier 1/head_dim (0.015625 at head_dim 64; here head_dim 16), NoPE attention,
# tied embeddings, rms_norm_eps 1e-5, mamba_d_conv 4, mamba_expand 2, mamba_n_groups 1
# (2 here), mamba_chunk_size 256 (8 here), num_local_experts 0.
GRANITE_H_MICRO_CONFIG: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "attention_bias": False, "attention_dropout": 0.0, "attention_multiplier": 0.0625,
    "bos_token_id": Tok("<|end_of_text|>"), "eos_token_id": Tok("<|end_of_text|>"),
    "pad_token_id": Tok("<|pad|>"), "embedding_multiplier": 12.0, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.1, "intermediate_size": 32,
    "layer_types": ["mamba", "attention", "mamba", "mamba"], "logits_scaling": 8.0,
    "mamba_chunk_size": 8, "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 16,
    "mamba_d_state": 16, "mamba_expand": 2, "mamba_n_groups": 2, "mamba_n_heads": 8,
    "mamba_proj_bias": False, "max_position_embeddings": 131072,
    "normalization_function": "rmsnorm", "num_attention_heads": 4, "num_experts_per_tok": 0,
    "num_hidden_layers": 4, "num_key_value_heads": 2, "num_local_experts": 0,
    "output_router_logits": False, "position_embedding_type": "nope",
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000, "router_aux_loss_coef": 0.01, "shared_intermediate_size": 96,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 512,
}
# ---- ibm-granite/granite-4.0-h-tiny (MoE: block_sparse_moe + shared_mlp in every layer) ----
# Quoted released values: 64 experts, top-6 (4 and 2 here), intermediate_size 512 per expert,
# shared_intermediate_size 1024, logits_scaling 6.
GRANITE_H_TINY_CONFIG: dict[str, Any] = {
    **GRANITE_H_MICRO_CONFIG, "num_local_experts": 4, "num_experts_per_tok": 2,
    "intermediate_size": 32, "shared_intermediate_size": 64, "logits_scaling": 6.0,
    "layer_types": ["mamba", "mamba", "attention", "mamba"],
}
_GRANITE_ADDED = (("<|pad|>", True), ("<|end_of_text|>", True), ("<|start_of_role|>", True),
                  ("<|end_of_role|>", True), ("<|tool_call|>", True))
GRANITE_H_TOKENIZER = TokenizerSpec(
    # The role and end tokens of the Granite chat format; the release's tokenizer files (ids,
    # the rest of its added tokens, its chat template) were not found.
    added=_GRANITE_ADDED,
    config={"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|end_of_text|>",
            "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>", "unk_token": None,
            "model_max_length": 1000000000000000019884624838656,
            "clean_up_tokenization_spaces": False},
    special_map={"bos_token": _sp("<|end_of_text|>"), "eos_token": _sp("<|end_of_text|>"),
                 "pad_token": _sp("<|pad|>")},
)

# ---- ibm-ai-platform/Bamba-9B ----------------------------------------------------------------
# Quoted released values: 32 layers with attention at [9, 18, 27], hidden 4096, 32 heads and
# 8 KV heads, mamba_d_state 128, attn_rotary_emb 64 (half of head_dim 128: transformers 4.57
# fixes partial_rotary_factor = 0.5 and rope_theta = 10000 in BambaConfig and ignores this
# key), mamba_n_heads 128, mamba_d_head 64, untied embeddings.
BAMBA_CONFIG: dict[str, Any] = {
    "architectures": ["BambaForCausalLM"], "model_type": "bamba", "attention_dropout": 0.0,
    "attn_layer_indices": [1, 3], "attn_rotary_emb": 8,
    "bos_token_id": Tok("<|begin_of_text|>"), "eos_token_id": Tok("<|end_of_text|>"),
    "pad_token_id": Tok("<|end_of_text|>"), "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128, "mamba_chunk_size": 8,
    "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 16, "mamba_d_state": 16,
    "mamba_expand": 2, "mamba_n_groups": 2, "mamba_n_heads": 8, "mamba_proj_bias": False,
    "max_position_embeddings": 262144, "num_attention_heads": 4, "num_hidden_layers": 5,
    "num_key_value_heads": 2, "num_logits_to_keep": 1, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_mamba_kernels": True, "vocab_size": 512,
}
BAMBA_TOKENIZER = TokenizerSpec(
    added=(("<|begin_of_text|>", True), ("<|end_of_text|>", True)),
    config={"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>", "pad_token": "<|end_of_text|>",
            "unk_token": None, "model_max_length": 131072,
            "clean_up_tokenization_spaces": False},
    special_map={"bos_token": _sp("<|begin_of_text|>"), "eos_token": _sp("<|end_of_text|>"),
                 "pad_token": _sp("<|end_of_text|>")},
)

# ---- nvidia/Nemotron-H-8B-Base-8K (not in transformers 4.x: the hub's own model code) -------
# Quoted released values: hybrid_override_pattern of 52 layers
# "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", hidden 4096, 32 heads, 8 KV heads,
# head_dim 128, mamba_num_heads 128, mamba_head_dim 64, n_groups 8, ssm_state_size 128,
# conv_kernel 4, expand 2, chunk_size 128, relu2 MLP, vocab 131072, 8192 positions. The MoE keys
# (``E`` layers) are those of NVIDIA's later Nemotron-H MoE configs (n_routed_experts,
# num_experts_per_tok, moe_intermediate_size, moe_shared_expert_intermediate_size, n_group,
# topk_group, norm_topk_prob, routed_scaling_factor 2.5), added so the tiny pattern has an E.
NEMOTRON_H_CONFIG: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "auto_map": {"AutoConfig": "configuration_nemotron_h.NemotronHConfig",
                 "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": Tok("<s>"),
    "eos_token_id": Tok("</s>"), "pad_token_id": Tok("<pad>"), "chunk_size": 8,
    "conv_kernel": 4, "expand": 2, "head_dim": 16, "hidden_dropout": 0.0, "hidden_size": 64,
    "hybrid_override_pattern": "M-M*-ME", "initializer_range": 0.02,
    "intermediate_size": 128, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 16,
    "mamba_hidden_act": "silu", "mamba_num_heads": 8, "mamba_proj_bias": False,
    "max_position_embeddings": 8192, "mlp_bias": False, "mlp_hidden_act": "relu2",
    "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 64, "n_group": 1,
    "n_groups": 2, "n_routed_experts": 4, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_experts_per_tok": 2, "num_hidden_layers": 7, "num_key_value_heads": 2,
    "num_logits_to_keep": 1, "rescale_prenorm_residual": True, "residual_in_fp32": False,
    "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.5, "sliding_window": None,
    "ssm_state_size": 16, "tie_word_embeddings": False, "time_step_floor": 0.0001,
    "time_step_max": 0.1, "time_step_min": 0.001, "topk_group": 1, "torch_dtype": "bfloat16",
    "use_bias": False, "use_cache": True, "use_conv_bias": True, "use_mamba_kernels": True,
    "vocab_size": 512,
}
NEMOTRON_H_TOKENIZER = TokenizerSpec(
    added=(("<unk>", True), ("<s>", True), ("</s>", True), ("<pad>", True)),
    config={"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
            "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
            "model_max_length": 8192, "clean_up_tokenization_spaces": False},
    special_map={"bos_token": _sp("<s>"), "eos_token": _sp("</s>"), "pad_token": _sp("<pad>"),
                 "unk_token": _sp("<unk>")},
)

# ---- mistralai/Mamba-Codestral-7B-v0.1 (Mamba2ForCausalLM) -----------------------------------
# Quoted released values: 64 layers, hidden 4096, num_heads 128, head_dim 64, n_groups 8,
# state_size 128, conv_kernel 4, expand 2, chunk_size 256, vocab 32768, untied embeddings,
# residual_in_fp32. transformers 4.57's Mamba2 gated norm is full width (mamba_ssm's own
# Mamba2 normalizes per group when ngroups > 1: a known difference, kept as transformers has it).
MAMBA2_CONFIG: dict[str, Any] = {
    "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "bos_token_id": Tok("<s>"),
    "eos_token_id": Tok("</s>"), "pad_token_id": Tok("<pad>"), "chunk_size": 8,
    "conv_kernel": 4, "expand": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.1, "layer_norm_epsilon": 1e-05, "n_groups": 2,
    "norm_before_gate": False, "num_heads": 8, "num_hidden_layers": 3,
    "rescale_prenorm_residual": False, "residual_in_fp32": True, "rms_norm": True,
    "state_size": 16, "tie_word_embeddings": False, "time_step_floor": 0.0001,
    "time_step_limit": [0.0, float("inf")], "time_step_max": 0.1, "time_step_min": 0.001,
    "time_step_rank": 4, "torch_dtype": "bfloat16", "use_bias": False, "use_cache": True,
    "use_conv_bias": True, "vocab_size": 512,
}

# ---- a Granite-H network trained for block diffusion (``GraniteMoeHybridForBlockDiffusion``) --
# No such model is released: the layout of dllm's own ``builtin-hybrid`` (scripts/
# train_builtin.py --hybrid), Granite-H micro's keys plus the block-diffusion fields
# ``mask_token_id`` (a ``<|MASK|>`` token added to the tokenizer) and ``block_size`` (4 here:
# prompts and outputs cross several blocks).
GRANITE_H_BD_CONFIG: dict[str, Any] = {
    **GRANITE_H_MICRO_CONFIG, "architectures": ["GraniteMoeHybridForBlockDiffusion"],
    "mask_token_id": Tok("<|MASK|>"), "block_size": 4,
}
GRANITE_H_BD_TOKENIZER = TokenizerSpec(
    added=(*_GRANITE_ADDED, ("<|MASK|>", True)), config=GRANITE_H_TOKENIZER.config,
    special_map=GRANITE_H_TOKENIZER.special_map)

HYBRID_RELEASES: dict[str, Release] = {
    "GraniteMoeHybridForCausalLM": Release(None, GRANITE_H_MICRO_CONFIG, GRANITE_H_TOKENIZER),
    "GraniteMoeHybridForBlockDiffusion": Release(None, GRANITE_H_BD_CONFIG,
                                                 GRANITE_H_BD_TOKENIZER),
    "BambaForCausalLM": Release(None, BAMBA_CONFIG, BAMBA_TOKENIZER),
    "NemotronHForCausalLM": Release(None, NEMOTRON_H_CONFIG, NEMOTRON_H_TOKENIZER),
    "Mamba2ForCausalLM": Release(None, MAMBA2_CONFIG, NEMOTRON_H_TOKENIZER),
}
# Named layouts of one architecture: ``make_tiny_hybrid_checkpoint(layout, dir)``.
HYBRID_LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "granite-h-micro": ("GraniteMoeHybridForCausalLM", GRANITE_H_MICRO_CONFIG),
    "granite-h-tiny": ("GraniteMoeHybridForCausalLM", GRANITE_H_TINY_CONFIG),
    "granite-h-bd": ("GraniteMoeHybridForBlockDiffusion", GRANITE_H_BD_CONFIG),
    "bamba": ("BambaForCausalLM", BAMBA_CONFIG),
    "nemotron-h": ("NemotronHForCausalLM", NEMOTRON_H_CONFIG),
    "mamba2": ("Mamba2ForCausalLM", MAMBA2_CONFIG),
}
