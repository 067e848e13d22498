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


def weights_profile(path: str | Path) -> dict[str, list[float]]:
    """A checkpoint's tensors summarised in float64, per name: ``[rms, mean |x|, mean]``.

    The factory's laws go through ``torch.randn``/``exp``/``log``, whose last bits differ
    between CPUs and math libraries (a build's vector kernels against its scalar ones gave
    thousands of elements apart by up to 1e-2 relative, the profiles by under 1e-6). So a
    vector's ``weights_sha256`` names the bytes of the machine that made it, and the profile
    (:func:`profile_mismatch`) tells on another machine whether the factory still makes the
    same weights: a new seed or law moves a profile by far more than ``PROFILE_RTOL``."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = {}
    for name in sorted(tensors):
        x = tensors[name].double()
        out[name] = [x.pow(2).mean().sqrt().item(), x.abs().mean().item(), x.mean().item()]
    return out


PROFILE_RTOL = 1e-4


def profile_mismatch(got: dict[str, list[float]], want: dict[str, list[float]],
                     rtol: float = PROFILE_RTOL) -> list[str]:
    """The tensor names where two :func:`weights_profile` results differ (missing on one side,
    or a statistic off by more than ``rtol`` times the recorded rms)."""
    bad = sorted(set(got) ^ set(want))
    for name in sorted(set(got) & set(want)):
        scale = max(abs(want[name][0]), 1e-30)
        if any(abs(a - b) > rtol * scale for a, b in zip(got[name], want[name], strict=True)):
            bad.append(name)
    return bad


def supported_architectures() -> list[str]:
    return sorted(set(RELEASES) | set(HYBRID_RELEASES))


def make_tiny_checkpoint(architecture: str, path: str | Path, seed: int = 0, *, shards: int = 1,
                         dtype: str = "float32", **config_overrides: Any) -> Path:
    """Write a tiny random checkpoint of ``architecture`` to ``path`` and return ``path``.
    ``config_overrides`` replace config keys (sizes, ``tie_word_embeddings``, MoE options, ...)
    before the tensors are laid out; ``shards=2`` writes two shards and an index. A config's
    ``torch_dtype`` is ``dtype``, the weights' dtype (the releases say bfloat16)."""
    if architecture in HYBRID_RELEASES:  # the hybrids' own recipe (their own weight laws)
        return make_tiny_hybrid_checkpoint(architecture, path, seed, shards=shards, dtype=dtype,
                                           **config_overrides)
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


# =============================================================================================
# Hybrid Mamba2 + attention checkpoints (issue 20): ``families.HYBRID_RELEASES``
# =============================================================================================
#
# Tensor names as the released checkpoints store them, verified against transformers 4.57's
# modeling files (granitemoehybrid, bamba, mamba2) and NVIDIA's hub ``modeling_nemotron_h.py``.

from dllm.testing.families import HYBRID_LAYOUTS, HYBRID_RELEASES  # noqa: E402


def _mamba2_mixer_tensors(prefix: str, hidden: int, heads: int, head_dim: int, groups: int,
                          state: int, kernel: int, conv_bias: bool, proj_bias: bool
                          ) -> TensorList:
    """``in_proj`` (z | xBC | dt), depthwise ``conv1d`` ``[conv_dim, 1, K]``, per-head
    ``dt_bias``, ``A_log``, ``D``, the gated norm's ``norm.weight`` and ``out_proj``."""
    inter = heads * head_dim
    conv_dim = inter + 2 * groups * state
    out: TensorList = [(f"{prefix}.in_proj.weight", (inter + conv_dim + heads, hidden), "linear")]
    if proj_bias:
        out.append((f"{prefix}.in_proj.bias", (inter + conv_dim + heads,), "bias"))
    out.append((f"{prefix}.conv1d.weight", (conv_dim, 1, kernel), "conv"))
    if conv_bias:
        out.append((f"{prefix}.conv1d.bias", (conv_dim,), "bias"))
    out += [(f"{prefix}.dt_bias", (heads,), "dt_bias"), (f"{prefix}.A_log", (heads,), "A_log"),
            (f"{prefix}.D", (heads,), "D"), (f"{prefix}.norm.weight", (inter,), "norm"),
            (f"{prefix}.out_proj.weight", (hidden, inter), "linear")]
    if proj_bias:
        out.append((f"{prefix}.out_proj.bias", (hidden,), "bias"))
    return out


def _attention_tensors(prefix: str, hidden: int, heads: int, kv: int, d: int,
                       bias: bool = False) -> TensorList:
    out: TensorList = []
    for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
        out.append((f"{prefix}.{name}.weight", (rows, hidden), "linear"))
        if bias:
            out.append((f"{prefix}.{name}.bias", (rows,), "bias"))
    out.append((f"{prefix}.o_proj.weight", (hidden, heads * d), "linear"))
    if bias:
        out.append((f"{prefix}.o_proj.bias", (hidden,), "bias"))
    return out


def _granite_mamba_dims(c: dict[str, Any]) -> tuple[int, int]:
    heads = c["mamba_n_heads"]
    head_dim = c.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = int(c.get("mamba_expand", 2) * c["hidden_size"]) // heads
    return heads, head_dim


def _granite_hybrid_tensors(c: dict[str, Any]) -> TensorList:
    """GraniteMoeHybrid: ``model.layers.{i}.{input_layernorm, post_attention_layernorm}``, a
    ``mamba`` or a ``self_attn`` mixer by ``layer_types``, ``shared_mlp.{input_linear,
    output_linear}`` (gate | up fused) and, when ``num_local_experts > 0``,
    ``block_sparse_moe.{router.layer, input_linear, output_linear}`` with the experts stacked
    ``[E, out, in]``."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, d = c.get("num_key_value_heads") or heads, h // heads
    mh, md = _granite_mamba_dims(c)
    experts, inter, shared = c.get("num_local_experts", 0), c["intermediate_size"], \
        c["shared_intermediate_size"]
    out = _hf_head(c, h)
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (h,), "norm"),
                (f"{p}.post_attention_layernorm.weight", (h,), "norm")]
        if kind == "mamba":
            out += _mamba2_mixer_tensors(f"{p}.mamba", h, mh, md, c["mamba_n_groups"],
                                         c["mamba_d_state"], c["mamba_d_conv"],
                                         c.get("mamba_conv_bias", True),
                                         c.get("mamba_proj_bias", False))
        else:
            out += _attention_tensors(f"{p}.self_attn", h, heads, kv, d,
                                      c.get("attention_bias", False))
        if experts:
            out += [(f"{p}.block_sparse_moe.router.layer.weight", (experts, h), "router"),
                    (f"{p}.block_sparse_moe.input_linear.weight", (experts, 2 * inter, h),
                     "linear"),
                    (f"{p}.block_sparse_moe.output_linear.weight", (experts, h, inter),
                     "linear")]
        out += [(f"{p}.shared_mlp.input_linear.weight", (2 * shared, h), "linear"),
                (f"{p}.shared_mlp.output_linear.weight", (h, shared), "linear")]
    return out


def _bamba_tensors(c: dict[str, Any]) -> TensorList:
    """Bamba: ``model.layers.{i}.{input_layernorm, pre_ff_layernorm}``, ``mamba`` or
    ``self_attn`` (attention at ``attn_layer_indices``), ``feed_forward.{gate,up,down}_proj``;
    ``model.final_layernorm``."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, d = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
    mh, md = _granite_mamba_dims(c)
    vocab = c["vocab_size"]
    out: TensorList = [("model.embed_tokens.weight", (vocab, h), "embed"),
                       ("model.final_layernorm.weight", (h,), "norm")]
    if not c.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, h), "head"))
    attn = set(c.get("attn_layer_indices") or [])
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (h,), "norm"),
                (f"{p}.pre_ff_layernorm.weight", (h,), "norm")]
        if i in attn:
            out += _attention_tensors(f"{p}.self_attn", h, heads, kv, d)
        else:
            out += _mamba2_mixer_tensors(f"{p}.mamba", h, mh, md, c["mamba_n_groups"],
                                         c["mamba_d_state"], c["mamba_d_conv"],
                                         c.get("mamba_conv_bias", True),
                                         c.get("mamba_proj_bias", False))
        out += _hf_mlp(f"{p}.feed_forward", h, c["intermediate_size"])
    return out


def _backbone_head(c: dict[str, Any]) -> TensorList:
    vocab, h = c["vocab_size"], c["hidden_size"]
    out: TensorList = [("backbone.embeddings.weight", (vocab, h), "embed"),
                       ("backbone.norm_f.weight", (h,), "norm")]
    if not c.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, h), "head"))
    return out


def _nemotron_h_tensors(c: dict[str, Any]) -> TensorList:
    """Nemotron-H (hub names): ``backbone.embeddings``, ``backbone.layers.{i}.norm`` and one
    ``mixer`` per layer by ``hybrid_override_pattern``: ``M`` Mamba2, ``*`` attention
    (``q/k/v/o_proj``), ``-`` relu² MLP (``up_proj``, ``down_proj``), ``E`` MoE
    (``gate.weight``, ``gate.e_score_correction_bias``, ``experts.{e}.{up,down}_proj``,
    ``shared_experts.{up,down}_proj``); ``backbone.norm_f``, ``lm_head``."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, d = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
    out = _backbone_head(c)

    def mlp(p: str, inter: int) -> TensorList:
        return [(f"{p}.up_proj.weight", (inter, h), "linear"),
                (f"{p}.down_proj.weight", (h, inter), "linear")]

    for i, kind in enumerate(c["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}"
        out.append((f"{p}.norm.weight", (h,), "norm"))
        m = f"{p}.mixer"
        if kind == "M":
            out += _mamba2_mixer_tensors(m, h, c["mamba_num_heads"], c["mamba_head_dim"],
                                         c["n_groups"], c["ssm_state_size"], c["conv_kernel"],
                                         c.get("use_conv_bias", True),
                                         c.get("mamba_proj_bias", False))
        elif kind == "*":
            out += _attention_tensors(m, h, heads, kv, d, c.get("attention_bias", False))
        elif kind == "-":
            out += mlp(m, c["intermediate_size"])
        elif kind == "E":
            e = c["n_routed_experts"]
            out += [(f"{m}.gate.weight", (e, h), "router"),
                    (f"{m}.gate.e_score_correction_bias", (e,), "expert_bias")]
            for j in range(e):
                out += mlp(f"{m}.experts.{j}", c["moe_intermediate_size"])
            out += mlp(f"{m}.shared_experts", c["moe_shared_expert_intermediate_size"])
        else:
            raise ValueError(f"unknown layer kind {kind!r} in hybrid_override_pattern")
    return out


def _mamba2_tensors(c: dict[str, Any]) -> TensorList:
    """Mamba2ForCausalLM: ``backbone.embeddings``, ``backbone.layers.{i}.{norm, mixer.*}``,
    ``backbone.norm_f``, ``lm_head``."""
    h = c["hidden_size"]
    out = _backbone_head(c)
    for i in range(c["num_hidden_layers"]):
        p = f"backbone.layers.{i}"
        out.append((f"{p}.norm.weight", (h,), "norm"))
        out += _mamba2_mixer_tensors(f"{p}.mixer", h, c["num_heads"], c["head_dim"],
                                     c["n_groups"], c["state_size"], c["conv_kernel"],
                                     c.get("use_conv_bias", True), c.get("use_bias", False))
    return out


HYBRID_TENSORS: dict[str, Callable[[dict[str, Any]], TensorList]] = {
    "GraniteMoeHybridForCausalLM": _granite_hybrid_tensors,
    "GraniteMoeHybridForBlockDiffusion": _granite_hybrid_tensors,
    "BambaForCausalLM": _bamba_tensors,
    "NemotronHForCausalLM": _nemotron_h_tensors,
    "Mamba2ForCausalLM": _mamba2_tensors,
}
assert set(HYBRID_TENSORS) == set(HYBRID_RELEASES)


def _init_hybrid_tensor(kind: str, shape: tuple[int, ...], gen: torch.Generator
                        ) -> torch.Tensor:
    """The SSM parameters in the ranges trained Mamba2 layers use, so the recurrence has
    decays from fast to slow: ``dt_bias`` = softplus⁻¹ of a log-uniform step in [0.01, 0.3],
    ``A_log`` = log of a uniform rate in [1, 16] (A = −exp(A_log)), ``D`` around 1, the conv
    taps of unit-order gain."""
    if kind == "dt_bias":
        lo, hi = math.log(0.01), math.log(0.3)
        dt = torch.exp(lo + (hi - lo) * torch.rand(shape, generator=gen))
        return dt + torch.log(-torch.expm1(-dt))
    if kind == "A_log":
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen))
    if kind == "D":
        return 1.0 + 0.2 * torch.randn(shape, generator=gen)
    if kind == "conv":
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if kind == "tied_embed":  # one law for every row: no row norm outgrows the others
        return HEAD_STD * torch.randn(shape, generator=gen)
    return _init_tensor(kind, shape, gen)


GRANITE_BRANCH_OVER_EMBED = 4.0


def _hybrid_gains(architecture: str, config: dict[str, Any]) -> dict[str, float]:
    """Weight gains by tensor-name suffix. Granite's μP multipliers (``embedding_multiplier``
    12, ``residual_multiplier`` 0.22, ``logits_scaling`` 8 on a tied head) make the usual
    random weights a context-free model: the ×12 embedding swamps the ×0.22 residual branches
    and the tied head's logits, divided by 8, are flat. So the tiny Granite's embedding (its
    head) is ``logits_scaling`` times the factory's head law, and the residual branches' output
    projections carry the gain that brings them to ``GRANITE_BRANCH_OVER_EMBED`` times the
    scaled embedding (a tied head otherwise predicts the current token again: greedy output
    repeats one token)."""
    if not architecture.startswith("GraniteMoeHybridFor"):
        return {}
    head = float(config.get("logits_scaling", 1.0))
    branch = (GRANITE_BRANCH_OVER_EMBED * float(config.get("embedding_multiplier", 1.0))
              * head * HEAD_STD
              / float(config.get("residual_multiplier", 1.0)))
    return {"embed_tokens.weight": head, "lm_head.weight": head, "out_proj.weight": branch,
            "o_proj.weight": branch, "output_linear.weight": branch}


def _gain(name: str, gains: dict[str, float]) -> float:
    return next((g for suffix, g in gains.items() if name.endswith(suffix)), 1.0)


def supported_hybrid_layouts() -> list[str]:
    return sorted(HYBRID_LAYOUTS)


def make_tiny_hybrid_checkpoint(layout: str, path: str | Path, seed: int = 0, *,
                                shards: int = 1, dtype: str = "float32",
                                **config_overrides: Any) -> Path:
    """``make_tiny_checkpoint`` for the hybrid architectures: ``layout`` is a key of
    ``families.HYBRID_LAYOUTS`` (``granite-h-micro``, ``granite-h-tiny``, ``granite-h-bd``,
    ``bamba``, ``nemotron-h``, ``mamba2``) or an architecture of ``HYBRID_RELEASES``. Same files, same
    tokenizer, same deterministic weights in ``seed``."""
    if layout in HYBRID_RELEASES:
        architecture, base = layout, HYBRID_RELEASES[layout].config
    elif layout in HYBRID_LAYOUTS:
        architecture, base = HYBRID_LAYOUTS[layout]
    else:
        raise ValueError(f"no tiny hybrid checkpoint recipe for {layout!r}; known: "
                         f"{', '.join(supported_hybrid_layouts() + sorted(HYBRID_RELEASES))}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    release = HYBRID_RELEASES[architecture]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(release.tokenizer.added)
    ids = {t: tok.token_to_id(t) for t, _ in release.tokenizer.added}
    config = _resolve(base, ids)
    config["torch_dtype"] = dtype
    config.update(config_overrides)
    if "hybrid_override_pattern" in config:
        config["num_hidden_layers"] = len(config["hybrid_override_pattern"])
    if "layer_types" in config:
        config["num_hidden_layers"] = len(config["layer_types"])

    gen = torch.Generator().manual_seed(seed)
    torch_dtype = _DTYPES[dtype]
    gains = _hybrid_gains(architecture, config)
    tied = config.get("tie_word_embeddings", False)
    tensors = {name: (_init_hybrid_tensor("tied_embed" if tied and kind == "embed" else kind,
                                          shape, gen) * _gain(name, gains))
               .to(torch_dtype).contiguous()
               for name, shape, kind in HYBRID_TENSORS[architecture](config)}

    _dump(path / "config.json", config)
    _dump(path / "generation_config.json",
          {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if config.get(k) is not None})
    _save(path, tensors, shards)
    _write_tokenizer(path, tok, release.tokenizer)
    return path
