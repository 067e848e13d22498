"""The pre-norm decoder every supported architecture is built from.

``DecoderLM`` owns ``model.embed_tokens``, ``model.layers.{i}`` (``input_layernorm``,
``self_attn``, ``post_attention_layernorm``, ``mlp``), ``model.norm`` and ``lm_head`` (absent when
the head is tied to the embedding). Architecture files choose the attention and MLP modules and
list the weight rules that rename their checkpoint tensors onto these names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dllm.models.attention import Attention, Batch, KVCacheSpec
from dllm.models.config import ModelConfig
from dllm.models.layers import (
    LMHead,
    PackedLinear,
    RMSNorm,
    RopeSpec,
    RotaryEmbedding,
    RowLinear,
    VocabEmbedding,
)
from dllm.models.moe import StackedExperts
from dllm.models.ops import UsesOps
from dllm.models.parallel import (
    ShardedLogits,
    all_reduce,
    building_under,
    data_parallel,
    tensor_parallel,
)
from dllm.models.weights import SKIP_ROTARY, SKIP_TIED_HEAD, WeightRule


@dataclass(frozen=True)
class AttentionSpec:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec | None  # None: no positional encoding (NoPE)
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    norm_eps: float = 1e-6
    scaling: float | None = None  # the softmax scale; None: head_dim ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def local_attention_spec(spec: AttentionSpec) -> AttentionSpec:
    """``spec`` with this tensor-parallel rank's heads (``TensorParallel.kv_heads``)."""
    tp = tensor_parallel()
    kv_local, _ = tp.kv_heads(spec.num_kv_heads)
    return dataclasses.replace(spec, num_heads=tp.split(spec.num_heads, "num_attention_heads"),
                               num_kv_heads=kv_local)


def hf_lm_sizes(config: ModelConfig) -> dict[str, int | bool]:
    """``DecoderLM`` size arguments under the HF key names."""
    return dict(num_layers=config.get_int("num_hidden_layers"),
                vocab_size=config.get_int("vocab_size"),
                tie_word_embeddings=config.get_bool("tie_word_embeddings", False))


def hf_attention_spec(config: ModelConfig, *, qkv_bias: bool, out_bias: bool,
                      qk_norm: bool) -> AttentionSpec:
    """Attention hyperparameters under the HF Llama/Qwen key names."""
    hidden = config.get_int("hidden_size")
    heads = config.get_int("num_attention_heads")
    head_dim = config.get_int("head_dim", hidden // heads)
    return AttentionSpec(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=config.get_int("num_key_value_heads", heads),
        head_dim=head_dim,
        rope=RopeSpec.from_config(config, head_dim),
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        qk_norm=qk_norm,
        norm_eps=config.get_float("rms_norm_eps", 1e-6),
    )


class SelfAttention(UsesOps, nn.Module):
    """The checkpoint's ``q_proj``/``k_proj``/``v_proj`` packed into one ``qkv_proj`` GEMM at
    load, ``o_proj``, per-head ``q_norm``/``k_norm`` (Qwen3) and RoPE (none when
    ``spec.rope`` is None: ``rotary_emb`` is None)."""

    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                      "v_proj": ("qkv_proj", 2)}

    def __init__(self, spec: AttentionSpec, layer_id: int):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        tp = tensor_parallel()
        local = local_attention_spec(spec)  # this rank's heads
        _, kv_first = tp.kv_heads(spec.num_kv_heads)
        kv_part = (spec.kv_size, local.kv_size, kv_first * d)
        self.spec, self.tp = local, tp
        self.qkv_proj = PackedLinear(
            h, [local.q_size, local.kv_size, local.kv_size], bias=spec.qkv_bias,
            parts=[(spec.q_size, local.q_size, tp.rank * local.q_size), kv_part, kv_part])
        self.o_proj = RowLinear(spec.q_size, h, bias=spec.out_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.norm_eps)
            self.k_norm = RMSNorm(d, spec.norm_eps)
        self.rotary_emb = None if spec.rope is None else RotaryEmbedding(spec.rope)
        self.attn = Attention(layer_id, local.num_heads, local.num_kv_heads, d, spec.scaling)

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.spec.qk_norm:
            return None, None
        return self.q_norm.weight, self.k_norm.weight

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor,
               forward_batch: Batch) -> torch.Tensor:
        """From the q/k/v projection to the attention output (before ``o_proj``): q/k norms
        and RoPE (``LayerOps.qkv_rope``; k and v come back None when the ops wrote them to
        the KV cache), then attention."""
        q, k, v = self.ops.qkv_rope(self, qkv, positions, forward_batch)
        return self.attn(q, k, v, forward_batch)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                forward_batch: Batch) -> torch.Tensor:
        qkv = self.ops.linear(x, self.qkv_proj)
        out = self.ops.linear(self.attend(qkv, positions, forward_batch), self.o_proj)
        return all_reduce(out, self.tp)


class DecoderLayer(nn.Module):
    """Pre-norm layer carrying the residual stream separately (as vLLM and SGLang do), so the
    residual add and the next RMSNorm are one step (``RMSNorm.add_forward``). ``x`` is the
    previous layer's MLP output and ``residual`` the stream before it (None at the first
    layer, whose ``x`` is the embedding); the stream after this layer is ``residual + x`` of
    the pair it returns."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.dp = data_parallel()  # data-parallel attention: the MLP runs over every rank's rows

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(positions, h, forward_batch)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.dp.run_mlp(self.mlp, h), residual

    def idle(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """This layer's MLP collectives without its rows: zeros of the count this rank
        announced for the forward (0 in an ``IDLE`` forward; a failed forward's rows)."""
        rows = self.dp.counts[self.dp.rank]
        self.dp.run_mlp(self.mlp, torch.zeros(rows, hidden_size, dtype=dtype, device=device))


class DecoderModel(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, layers: list[DecoderLayer], eps: float):
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: Batch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, forward_batch)
        return self.norm.add_forward(x, residual)[0]


class DecoderLM(UsesOps, nn.Module):
    """Base of every model: the model contract (``forward``, ``compute_logits``,
    ``kv_cache_spec``) and the checkpoint weight rules."""

    # Checkpoint name rules of the architecture (see ``dllm.models.weights``).
    checkpoint_rules: tuple[WeightRule, ...] = ()

    def __init__(self, config: ModelConfig, attn_spec: AttentionSpec, num_layers: int,
                 vocab_size: int, tie_word_embeddings: bool,
                 make_attention: Callable[[int], nn.Module],
                 make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.config = config
        self.attn_spec = attn_spec
        self.tie_word_embeddings = tie_word_embeddings
        h, eps = attn_spec.hidden_size, attn_spec.norm_eps
        dp = data_parallel()  # under data-parallel attention the MLPs split over all ranks
        layers = []
        for i in range(num_layers):
            attn = make_attention(i)
            with building_under(dp.mlp if dp.size > 1 else tensor_parallel()):
                mlp = make_mlp(i)
            layers.append(DecoderLayer(attn, mlp, h, eps))
        self.model = DecoderModel(vocab_size, h, layers, eps)
        self.lm_head = None if tie_word_embeddings else LMHead(vocab_size, h)

    @property
    def weight_rules(self) -> tuple[WeightRule, ...]:
        tied = (SKIP_TIED_HEAD,) if self.tie_word_embeddings else ()
        return (SKIP_ROTARY, *tied, *self.checkpoint_rules)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: Batch) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` → final-norm hidden states ``[T, hidden]``."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | ShardedLogits:
        """``[N, hidden]`` → ``[N, vocab]`` in the model dtype; under tensor parallelism this
        rank's vocabulary columns as ``ShardedLogits`` (never gathered: the post-steps reduce
        each shard and exchange per-row statistics, ``dllm.algorithms.vocab_parallel``)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = self.ops.linear(hidden, head)
        if head.weight.shape[0] == head.vocab_size:
            return logits
        logits[:, head.end - head.start :] = float("-inf")  # padding rows: never chosen
        return ShardedLogits(logits, head.start, head.vocab_size, head.tp)

    @property
    def supports_cuda_graph(self) -> bool:
        """False when the forward reads device values on the host (the MoE expert loop, where
        the layer ops do not take the grouped path), which CUDA-graph capture forbids; such
        models run eagerly."""
        return not any(isinstance(m, StackedExperts) and not m.ops.grouped_moe
                       for m in self.modules())

    def kv_cache_spec(self) -> KVCacheSpec:
        s = local_attention_spec(self.attn_spec)
        return KVCacheSpec(len(self.model.layers), s.num_kv_heads, s.head_dim)
