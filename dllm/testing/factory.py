"""Tiny random checkpoints with the real config keys and tensor names of each architecture.

``make_tiny_checkpoint("SDARForCausalLM", dir)`` writes ``config.json``, ``model.safetensors``
(or two shards and an index), ``generation_config.json`` and a small byte-level BPE tokenizer
(``tokenizer.json``, ``tokenizer_config.json`` with a ChatML ``chat_template``,
``special_tokens_map.json``) that ``transformers.AutoTokenizer`` loads offline and that encodes
any text. The tensor names below are written from the reference checkpoints, independently of
``dllm.models``, so the loader is tested as against a real checkpoint.

Weights are deterministic in ``seed`` and scaled so that the models are not near-identity
(context matters) and their next-token distributions are not flat: the LM-head rows get
log-normal norms, so the max probability over random contexts spreads over (0, 1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

VOCAB_SIZE = 512  # config vocab (≥ tokenizer size, like the padded vocabularies of real models)
HEAD_STD = 0.2  # LM-head entry scale: logit std ≈ HEAD_STD · sqrt(hidden) before row scaling
HEAD_ROW_LOG_STD = 0.5  # spread of log row norms of the LM head

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Word pieces merged by the tokenizer (each with its leading space, GPT-2 style "Ġ").
_WORDS = (
    "the and of to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part "
    "hello world yes answer question think step because three four five six seven eight nine "
    "ten sum total user assistant"
).split()
_BARE_WORDS = ("user", "assistant", "system")


@dataclass(frozen=True)
class SpecialTokens:
    eos: str
    bos: str | None = None
    pad: str | None = None
    mask: str | None = None

    def all(self) -> list[str]:
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        for t in (self.eos, self.bos, self.pad, self.mask):
            if t is not None and t not in tokens:
                tokens.append(t)
        return tokens


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def build_tokenizer(special: SpecialTokens, max_size: int = VOCAB_SIZE - 16) -> Tokenizer:
    """Byte-level BPE: the 256 byte symbols, merges for ``_WORDS``, then the special tokens."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    budget = max_size - len(special.all())
    # Words after a space first; bare chat roles last, so their merges never outrank a
    # "Ġ"-chain and split a spaced word.
    reserve = sum(len(w) - 1 for w in _BARE_WORDS)
    for pieces in [*("Ġ" + w for w in _WORDS), *_BARE_WORDS]:
        if pieces in _BARE_WORDS:
            reserve = 0
        if len(vocab) + len(pieces) - 1 > budget - reserve:
            continue
        current = pieces[0]
        for ch in pieces[1:]:
            merged = current + ch
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((current, ch))
            current = merged
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.all()])
    return tok


def _write_tokenizer(path: Path, tok: Tokenizer, special: SpecialTokens) -> None:
    tok.save(str(path / "tokenizer.json"))
    names = {"bos_token": special.bos, "eos_token": special.eos, "pad_token": special.pad,
             "mask_token": special.mask}
    names = {k: v for k, v in names.items() if v is not None}
    extra = ["<|im_start|>", "<|im_end|>"]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "unk_token": None,
        "additional_special_tokens": extra,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    with open(path / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2)
    with open(path / "special_tokens_map.json", "w", encoding="utf-8") as f:
        json.dump({**names, "additional_special_tokens": extra}, f, indent=2)


# ---------------------------------------------------------------------------------------------
# Tensor names per family: (name, shape, init kind)
# ---------------------------------------------------------------------------------------------

TensorList = list[tuple[str, tuple[int, ...], str]]


def _hf_mlp(prefix: str, hidden: int, inter: int) -> TensorList:
    return [(f"{prefix}.gate_proj.weight", (inter, hidden), "linear"),
            (f"{prefix}.up_proj.weight", (inter, hidden), "linear"),
            (f"{prefix}.down_proj.weight", (hidden, inter), "linear")]


def _hf_experts(prefix: str, num: int, hidden: int, inter: int) -> TensorList:
    out: TensorList = []
    for e in range(num):
        out += _hf_mlp(f"{prefix}.experts.{e}", hidden, inter)
    return out


def _hf_head(c: dict[str, Any], hidden: int, embed_key: str = "model.embed_tokens") -> TensorList:
    vocab = c["vocab_size"]
    out: TensorList = [(f"{embed_key}.weight", (vocab, hidden), "embed")]
    if not c.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, hidden), "head"))
    out.append(("model.norm.weight", (hidden,), "norm"))
    return out


def _hf_decoder(c: dict[str, Any], *, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                mlp: Callable[[str, int], TensorList]) -> TensorList:
    """Llama/Qwen/Dream/SDAR names; ``mlp(prefix, layer)`` lists the layer's MLP tensors."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    d = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads") or heads
    out = _hf_head(c, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (h,), "norm"),
                (f"{p}.post_attention_layernorm.weight", (h,), "norm")]
        for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            out.append((f"{p}.self_attn.{name}.weight", (rows, h), "linear"))
            if qkv_bias:
                out.append((f"{p}.self_attn.{name}.bias", (rows,), "bias"))
        out.append((f"{p}.self_attn.o_proj.weight", (h, heads * d), "linear"))
        if o_bias:
            out.append((f"{p}.self_attn.o_proj.bias", (h,), "bias"))
        if qk_norm:
            out += [(f"{p}.self_attn.q_norm.weight", (d,), "norm"),
                    (f"{p}.self_attn.k_norm.weight", (d,), "norm")]
        out += mlp(f"{p}.mlp", i)
    return out


def _dense_tensors(c: dict[str, Any], *, qkv_bias: bool, o_bias: bool,
                   qk_norm: bool) -> TensorList:
    return _hf_decoder(c, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
                       mlp=lambda p, i: _hf_mlp(p, c["hidden_size"], c["intermediate_size"]))


def _qwen3_tensors(c: dict[str, Any]) -> TensorList:
    bias = c.get("attention_bias", False)
    return _dense_tensors(c, qkv_bias=bias, o_bias=bias, qk_norm=True)


def _qwen2_tensors(c: dict[str, Any]) -> TensorList:
    return _dense_tensors(c, qkv_bias=True, o_bias=False, qk_norm=False)


def _llama_tensors(c: dict[str, Any]) -> TensorList:
    bias = c.get("attention_bias", False)
    return _dense_tensors(c, qkv_bias=bias, o_bias=bias, qk_norm=False)


def _sdar_moe_tensors(c: dict[str, Any]) -> TensorList:
    h = c["hidden_size"]

    def mlp(p: str, i: int) -> TensorList:
        sparse = (i not in c.get("mlp_only_layers", [])
                  and (i + 1) % c.get("decoder_sparse_step", 1) == 0)
        if not sparse:
            return _hf_mlp(p, h, c["intermediate_size"])
        return [(f"{p}.gate.weight", (c["num_experts"], h), "router"),
                *_hf_experts(p, c["num_experts"], h, c["moe_intermediate_size"])]

    return _hf_decoder(c, qkv_bias=False, o_bias=False, qk_norm=True, mlp=mlp)


def _llada_moe_tensors(c: dict[str, Any]) -> TensorList:
    h = c["hidden_size"]
    freq = c.get("moe_layer_freq") or [1] * c["num_hidden_layers"]

    def mlp(p: str, i: int) -> TensorList:
        if not freq[i]:
            return _hf_mlp(p, h, c["dense_intermediate_size"])
        out: TensorList = [(f"{p}.gate.weight", (c["num_experts"], h), "router"),
                           *_hf_experts(p, c["num_experts"], h, c["expert_intermediate_size"])]
        if c.get("moe_router_enable_expert_bias"):
            out.append((f"{p}.expert_bias", (c["num_experts"],), "expert_bias"))
        if c.get("shared_expert_intermediate_size"):
            layer = p.rsplit(".", 1)[0]
            out += _hf_mlp(f"{layer}.shared_expert", h, c["shared_expert_intermediate_size"])
        return out

    bias = c.get("attention_bias", False)
    return _hf_decoder(c, qkv_bias=bias, o_bias=bias, qk_norm=bool(c.get("qk_layernorm")),
                       mlp=mlp)


def _llada2_tensors(c: dict[str, Any]) -> TensorList:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    d = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads") or heads
    e = c["num_experts"]
    out = _hf_head(c, h, embed_key="model.word_embeddings")
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (h,), "norm"),
                (f"{p}.post_attention_layernorm.weight", (h,), "norm"),
                (f"{p}.attention.query_key_value.weight", ((heads + 2 * kv) * d, h), "linear"),
                (f"{p}.attention.dense.weight", (h, heads * d), "linear")]
        if c.get("use_qkv_bias") or c.get("use_bias"):
            out.append((f"{p}.attention.query_key_value.bias", ((heads + 2 * kv) * d,), "bias"))
        if c.get("use_qk_norm", True):
            out += [(f"{p}.attention.query_layernorm.weight", (d,), "norm"),
                    (f"{p}.attention.key_layernorm.weight", (d,), "norm")]
        if i < c.get("first_k_dense_replace", 0):
            out += _hf_mlp(f"{p}.mlp", h, c["intermediate_size"])
            continue
        out += [(f"{p}.mlp.gate.weight", (e, h), "router"),
                (f"{p}.mlp.gate.expert_bias", (e,), "expert_bias"),
                *_hf_experts(f"{p}.mlp", e, h, c["moe_intermediate_size"]),
                *_hf_mlp(f"{p}.mlp.shared_experts", h,
                         c["moe_shared_expert_intermediate_size"] * c["num_shared_experts"])]
    return out


def _llada_tensors(c: dict[str, Any]) -> TensorList:
    h, heads = c["d_model"], c["n_heads"]
    d, kv, inter = h // heads, c.get("n_kv_heads") or heads, c["mlp_hidden_size"]
    vocab = c.get("embedding_size") or c["vocab_size"]
    t = "model.transformer"
    out: TensorList = [(f"{t}.wte.weight", (vocab, h), "embed"), (f"{t}.ln_f.weight", (h,), "norm")]
    if not c.get("weight_tying", False):
        out.append((f"{t}.ff_out.weight", (vocab, h), "head"))
    for i in range(c["n_layers"]):
        b = f"{t}.blocks.{i}"
        out += [(f"{b}.attn_norm.weight", (h,), "norm"), (f"{b}.ff_norm.weight", (h,), "norm"),
                (f"{b}.q_proj.weight", (heads * d, h), "linear"),
                (f"{b}.k_proj.weight", (kv * d, h), "linear"),
                (f"{b}.v_proj.weight", (kv * d, h), "linear"),
                (f"{b}.attn_out.weight", (h, heads * d), "linear"),
                (f"{b}.ff_proj.weight", (inter, h), "linear"),
                (f"{b}.up_proj.weight", (inter, h), "linear"),
                (f"{b}.ff_out.weight", (h, inter), "linear")]
    return out


# ---------------------------------------------------------------------------------------------
# Configs (real key names, tiny sizes)
# ---------------------------------------------------------------------------------------------

_QWEN_COMMON: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
}
_QWEN3: dict[str, Any] = {**_QWEN_COMMON, "head_dim": 32, "rope_theta": 1000000.0,
                          "attention_bias": False}
_QWEN2: dict[str, Any] = {**_QWEN_COMMON, "rope_theta": 1000000.0}
_MOE: dict[str, Any] = {"num_experts": 8, "num_experts_per_tok": 2}


@dataclass(frozen=True)
class _Family:
    config: dict[str, Any]
    tensors: Callable[[dict[str, Any]], TensorList]
    special: SpecialTokens
    mask_in_config: bool = False  # the real config.json carries mask_token_id


_QWEN_SPECIAL = SpecialTokens(eos="<|im_end|>", bos="<|endoftext|>", pad="<|endoftext|>")

FAMILIES: dict[str, _Family] = {
    "Qwen3ForCausalLM": _Family(
        {"model_type": "qwen3", **_QWEN3, "tie_word_embeddings": True},
        _qwen3_tensors, _QWEN_SPECIAL),
    "Qwen2ForCausalLM": _Family(
        {"model_type": "qwen2", **_QWEN2, "tie_word_embeddings": False},
        _qwen2_tensors, _QWEN_SPECIAL),
    "LlamaForCausalLM": _Family(
        {"model_type": "llama", **{k: v for k, v in _QWEN_COMMON.items()
                                   if k not in ("use_sliding_window", "sliding_window",
                                                "max_window_layers")},
         "head_dim": 16, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "attention_bias": False,
         "mlp_bias": False, "pretraining_tp": 1, "tie_word_embeddings": False},
        _llama_tensors,
        SpecialTokens(eos="<|end_of_text|>", bos="<|begin_of_text|>", pad="<|end_of_text|>")),
    "SDARForCausalLM": _Family(
        {"model_type": "sdar", **_QWEN3, "tie_word_embeddings": True},
        _qwen3_tensors, SpecialTokens(eos="<|im_end|>", bos="<|endoftext|>",
                                      pad="<|endoftext|>", mask="<|MASK|>")),
    "SDARMoeForCausalLM": _Family(
        {"model_type": "sdar_moe", **_QWEN3, **_MOE, "moe_intermediate_size": 32,
         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "output_router_logits": False, "router_aux_loss_coef": 0.001,
         "tie_word_embeddings": False},
        _sdar_moe_tensors, SpecialTokens(eos="<|im_end|>", bos="<|endoftext|>",
                                         pad="<|endoftext|>", mask="<|MASK|>")),
    "LLaDA2MoeModelLM": _Family(
        {"model_type": "llada2_moe", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-6, "rope_theta": 600000, "rope_scaling": None,
         "partial_rotary_factor": 0.5, "rotary_dim": 8, "first_k_dense_replace": 1, **_MOE,
         "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
         "num_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
         "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
         "norm_topk_prob": True, "router_dtype": "fp32", "use_qk_norm": True,
         "use_qkv_bias": False, "use_bias": False, "norm_head": False, "use_rmsnorm": True,
         "embedding_dropout": 0.0, "attention_dropout": 0.0, "output_dropout": 0.0,
         "output_router_logits": False, "initializer_range": 0.02, "use_cache": True,
         "tie_word_embeddings": False},
        _llada2_tensors, SpecialTokens(eos="<|endoftext|>", bos="<|startoftext|>",
                                       pad="<|endoftext|>", mask="<|mask|>")),
    "Fast_dLLM_QwenForCausalLM": _Family(
        {"model_type": "Fast_dLLM_Qwen", **_QWEN2, "bd_size": 32, "tie_word_embeddings": False},
        _qwen2_tensors, SpecialTokens(eos="<|im_end|>", bos="<|endoftext|>",
                                      pad="<|endoftext|>", mask="|<MASK>|")),
    "LLaDAModelLM": _Family(
        {"model_type": "llada", "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2,
         "mlp_hidden_size": 128, "mlp_ratio": 2, "vocab_size": VOCAB_SIZE,
         "embedding_size": VOCAB_SIZE, "max_sequence_length": 2048, "rope": True,
         "rope_theta": 500000.0, "rope_full_precision": True, "layer_norm_type": "rms_norm",
         "layer_norm_with_affine": True, "rms_norm_eps": 1e-5, "activation_type": "silu",
         "block_type": "llama", "block_group_size": 1, "include_bias": False,
         "include_qkv_bias": False, "bias_for_layer_norm": False,
         "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
         "weight_tying": False, "alibi": False, "alibi_bias_max": 8.0, "scale_logits": False,
         "input_emb_norm": False, "clip_qkv": None, "multi_query_attention": None,
         "attention_dropout": 0.0, "embedding_dropout": 0.0, "residual_dropout": 0.0,
         "flash_attention": False, "init_device": "meta", "init_fn": "mitchell",
         "init_std": 0.02, "init_cutoff_factor": None, "precision": "amp_bf16",
         "use_cache": False},
        _llada_tensors, SpecialTokens(eos="<|endoftext|>", bos="<|startoftext|>",
                                      pad="<|endoftext|>", mask="<|mdm_mask|>"),
        mask_in_config=True),
    "LLaDAMoEModelLM": _Family(
        {"model_type": "llada", "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "dense_intermediate_size": 128,
         "expert_intermediate_size": 32, "shared_expert_intermediate_size": None, **_MOE,
         "moe_layer_freq": [1, 1], "moe_router_enable_expert_bias": False,
         "moe_router_score_function": "softmax", "norm_topk_prob": False,
         "qk_layernorm": True, "attention_bias": False, "clip_qkv": None,
         "partial_rotary_factor": 1, "rope_theta": 50000, "rope_scaling": None,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "hidden_act": "silu",
         "router_aux_loss_coef": 0.01, "routed_scaling_factor": 1, "router_num_group": None,
         "router_topk_group": None, "output_router_logits": False, "initializer_range": 0.02,
         "attention_dropout": 0.0, "use_cache": False, "tie_word_embeddings": False},
        _llada_moe_tensors, SpecialTokens(eos="<|endoftext|>", bos="<|startoftext|>",
                                          pad="<|endoftext|>", mask="<|mask|>")),
    "DreamModel": _Family(
        {"model_type": "Dream", **_QWEN2, "tie_word_embeddings": False},
        _qwen2_tensors, SpecialTokens(eos="<|endoftext|>", bos="<|endoftext|>",
                                      pad="<|endoftext|>", mask="<|mask|>"),
        mask_in_config=True),
}

# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _init_tensor(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if kind in ("embed", "head"):  # the same law: a tied embedding is the head
        rows = torch.exp(HEAD_ROW_LOG_STD * torch.randn(shape[0], 1, generator=gen))
        return x * HEAD_STD * rows
    if kind == "norm":
        return 1.0 + 0.2 * (torch.rand(shape, generator=gen) - 0.5)
    if kind == "bias":
        return 0.1 * x
    if kind == "expert_bias":
        return 0.05 * x
    if kind in ("linear", "router"):
        return x / math.sqrt(shape[-1])
    raise ValueError(f"unknown init kind {kind!r}")


def _save(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    per = -(-len(names) // shards)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(path / "model.safetensors.index.json", "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def supported_architectures() -> list[str]:
    return sorted(FAMILIES)


def make_tiny_checkpoint(architecture: str, path: str | Path, seed: int = 0, *, shards: int = 1,
                         dtype: str = "float32", **config_overrides: Any) -> Path:
    """Write a tiny random checkpoint of ``architecture`` to ``path`` and return ``path``.
    ``config_overrides`` replace config keys (sizes, ``tie_word_embeddings``, MoE options, ...)
    before the tensors are laid out; ``shards=2`` writes two shards and an index."""
    if architecture not in FAMILIES:
        raise ValueError(f"no tiny checkpoint recipe for {architecture!r}; "
                         f"known: {', '.join(supported_architectures())}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    family = FAMILIES[architecture]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(family.special)
    ids = {t: tok.token_to_id(t) for t in family.special.all()}
    sp = family.special
    config: dict[str, Any] = {"architectures": [architecture], **family.config,
                              "vocab_size": VOCAB_SIZE}
    config.update({"bos_token_id": ids[sp.bos] if sp.bos else None,
                   "eos_token_id": ids[sp.eos],
                   "pad_token_id": ids[sp.pad] if sp.pad else None})
    if family.mask_in_config and sp.mask:
        config["mask_token_id"] = ids[sp.mask]
    config["torch_dtype"] = dtype
    config.update(config_overrides)
    if tok.get_vocab_size() > config["vocab_size"]:
        raise ValueError(f"vocab_size {config['vocab_size']} < tokenizer size "
                         f"{tok.get_vocab_size()}")

    gen = torch.Generator().manual_seed(seed)
    torch_dtype = _DTYPES[dtype]
    tensors = {name: _init_tensor(kind, shape, gen).to(torch_dtype).contiguous()
               for name, shape, kind in family.tensors(config)}

    with open(path / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if config.get(k) is not None}
    with open(path / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)
    _save(path, tensors, shards)
    _write_tokenizer(path, tok, sp)
    return path
