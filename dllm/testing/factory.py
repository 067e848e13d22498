"""Tiny random checkpoints laid out as the released ones, with tiny sizes.

``make_tiny_checkpoint("SDARForCausalLM", dir)`` writes ``config.json``,
``generation_config.json``, ``tokenizer_config.json`` (the release's chat template included) and
``special_tokens_map.json`` with the keys and values of a named released checkpoint
(:mod:`dllm.testing.families`), ``model.safetensors`` (or two shards and an index) with the
real tensor names, and a small byte-level BPE ``tokenizer.json`` holding the release's added
tokens, which ``transformers.AutoTokenizer`` loads offline and which encodes any text. The
tensor names below are written from the reference checkpoints, independently of
``dllm.models``, so the loader is tested as against a real checkpoint.

Weights are deterministic in ``seed`` and scaled so that the models are not near-identity
(context matters) and their next-token distributions are not flat: the LM-head rows get
log-normal norms, so the max probability over random contexts spreads over (0, 1).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from dllm.testing.families import RELEASES, Tok, TokenizerSpec, chat_template

VOCAB_SIZE = 512  # config vocab (≥ tokenizer size, like the padded vocabularies of real models)
HEAD_STD = 0.2  # LM-head entry scale: logit std ≈ HEAD_STD · sqrt(hidden) before row scaling
HEAD_ROW_LOG_STD = 0.5  # spread of log row norms of the LM head

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


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def build_tokenizer(added: tuple[tuple[str, bool], ...], max_size: int = VOCAB_SIZE - 16
                    ) -> Tokenizer:
    """Byte-level BPE: the 256 byte symbols, merges for ``_WORDS``, then the release's added
    tokens in its order (``(text, special)``)."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    budget = max_size - len(added)
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
    tok.add_tokens([AddedToken(t, special=sp, normalized=False) for t, sp in added])
    return tok


def _write_tokenizer(path: Path, tok: Tokenizer, spec: TokenizerSpec) -> None:
    tok.save(str(path / "tokenizer.json"))
    decoder = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                         "rstrip": False, "single_word": False, "special": sp}
               for t, sp in spec.added}
    _dump(path / "tokenizer_config.json", {**spec.config, "added_tokens_decoder": decoder})
    _dump(path / "special_tokens_map.json", spec.special_map)
    if spec.template_file:
        (path / "chat_template.jinja").write_text(chat_template(spec.template_file),
                                                  encoding="utf-8")


def _dump(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def _resolve(value: Any, ids: dict[str, int]) -> Any:
    """``value`` with every ``Tok`` replaced by its id in the tiny tokenizer."""
    if isinstance(value, Tok):
        return ids[value.text]
    if isinstance(value, dict):
        return {k: _resolve(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, ids) for v in value]
    return value


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
                         c.get("moe_shared_expert_intermediate_size", c["moe_intermediate_size"])
                         * c["num_shared_experts"])]
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


# Tensor layout of each architecture (its configs and tokenizers are in ``families``).
TENSORS: dict[str, Callable[[dict[str, Any]], TensorList]] = {
    "Qwen3ForCausalLM": _qwen3_tensors,
    "Qwen2ForCausalLM": _qwen2_tensors,
    "LlamaForCausalLM": _llama_tensors,
    "SDARForCausalLM": _qwen3_tensors,
    "SDARMoeForCausalLM": _sdar_moe_tensors,
    "LLaDA2MoeModelLM": _llada2_tensors,
    "Fast_dLLM_QwenForCausalLM": _qwen2_tensors,
    "LLaDAModelLM": _llada_tensors,
    "LLaDAMoEModelLM": _llada_moe_tensors,
    "DreamModel": _qwen2_tensors,
}
assert set(TENSORS) == set(RELEASES)

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


def weights_digest(path: str | Path) -> str:
    """sha256 over a checkpoint's tensors (sorted names, dtype, shape, bytes): the reference
    vectors record it, so a test notices when the factory's weights change."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def supported_architectures() -> list[str]:
    return sorted(RELEASES)


def make_tiny_checkpoint(architecture: str, path: str | Path, seed: int = 0, *, shards: int = 1,
                         dtype: str = "float32", **config_overrides: Any) -> Path:
    """Write a tiny random checkpoint of ``architecture`` to ``path`` and return ``path``.
    ``config_overrides`` replace config keys (sizes, ``tie_word_embeddings``, MoE options, ...)
    before the tensors are laid out; ``shards=2`` writes two shards and an index. A config's
    ``torch_dtype`` is ``dtype``, the weights' dtype (the releases say bfloat16)."""
    if architecture not in RELEASES:
        raise ValueError(f"no tiny checkpoint recipe for {architecture!r}; "
                         f"known: {', '.join(supported_architectures())}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    release = RELEASES[architecture]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(release.tokenizer.added)
    ids = {t: tok.token_to_id(t) for t, _ in release.tokenizer.added}
    config = _resolve(release.config, ids)
    if "torch_dtype" in config:  # the weights' dtype (LLaDA's release has no such key)
        config["torch_dtype"] = dtype
    config.update(config_overrides)
    if tok.get_vocab_size() > config["vocab_size"]:
        raise ValueError(f"vocab_size {config['vocab_size']} < tokenizer size "
                         f"{tok.get_vocab_size()}")

    gen = torch.Generator().manual_seed(seed)
    torch_dtype = _DTYPES[dtype]
    tensors = {name: _init_tensor(kind, shape, gen).to(torch_dtype).contiguous()
               for name, shape, kind in TENSORS[architecture](config)}

    _dump(path / "config.json", config)
    generation = (_resolve(release.generation, ids) if release.generation is not None else
                  {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                   if config.get(k) is not None})
    _dump(path / "generation_config.json", generation)
    _save(path, tensors, shards)
    _write_tokenizer(path, tok, release.tokenizer)
    return path
