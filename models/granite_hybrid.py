"""IBM Granite 4.0-H (``GraniteMoeHybridForCausalLM``): Mamba2 and attention layers mixed by
``layer_types``, μP multipliers, and in every layer a SwiGLU ``shared_mlp`` plus, in the MoE
layouts (h-tiny, h-small), a ``block_sparse_moe``.

As transformers 4.57's ``modeling_granitemoehybrid.py`` computes it, per layer:
``x += residual_multiplier · mixer(rmsnorm(x))`` (``mamba`` or ``self_attn``) and
``x += residual_multiplier · (moe + shared_mlp)(rmsnorm(x))``; the input is
``embed · embedding_multiplier`` and the logits ``head(rmsnorm(x)) / logits_scaling``.
Attention has no positional encoding (NoPE) unless ``position_embedding_type == "rope"``,
and its softmax scale is ``attention_multiplier``. The MoE router takes the top-k of the
router logits and a softmax over those k.

Checkpoint names: ``model.embed_tokens``, ``model.layers.{i}.{input_layernorm,
post_attention_layernorm}``, ``…mamba.{in_proj,conv1d,dt_bias,A_log,D,norm,out_proj}`` or
``…self_attn.{q,k,v,o}_proj``, ``…shared_mlp.{input_linear,output_linear}`` (gate | up in one
tensor: ``SwiGLUMLP``'s packed ``gate_up_proj`` as it is), ``…block_sparse_moe.{router.layer,
input_linear,output_linear}`` (experts stacked ``[E, out, in]``), ``model.norm``; the head is
tied to the embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm.models.attention import StateBatch
from dllm.models.config import ModelConfig
from dllm.models.decoder import AttentionSpec, SelfAttention
from dllm.models.hybrid import HybridLM, Mamba2Layer, layer_indices
from dllm.models.layers import RMSNorm, RopeSpec, SwiGLUMLP, VocabEmbedding, check_silu
from dllm.models.mamba2 import Mamba2Dims
from dllm.models.parallel import all_reduce, tensor_parallel
from dllm.models.weights import WeightRule

_LAYER = r"model\.layers\.(?P<l>\d+)\."


class StackedWeight(nn.Module):
    """One expert-stacked weight ``[E, out, in]`` under the checkpoint's module name. Under
    tensor and expert parallelism it holds this rank's experts ``[first, first + E_local)``
    and, of each, the rows (``axis`` 1) or columns (``axis`` 2) ``pieces`` name: per piece of
    that axis in the checkpoint, ``(its size, the size here, the first index here)``."""

    def __init__(self, experts: tuple[int, int, int], out_features: int, in_features: int,
                 axis: int = 1, pieces: tuple[tuple[int, int, int], ...] | None = None):
        super().__init__()
        self.experts, self.axis = experts, axis
        size = (out_features, in_features)[axis - 1]
        self.pieces = pieces or ((size, size, 0),)
        shape = [experts[1], out_features, in_features]
        shape[axis] = sum(local for _, local, _ in self.pieces)
        self.weight = nn.Parameter(torch.empty(shape))

    def localize(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        """This rank's experts and slices of the checkpoint's ``[E, out, in]`` tensor."""
        total, count, first = self.experts
        full = sum(n for n, _, _ in self.pieces)
        if tensor.ndim != 3 or tensor.shape[0] != total or tensor.shape[self.axis] != full:
            return tensor  # not the checkpoint's layout: the shape check names it
        tensor = tensor[first: first + count]
        if all(n == local for n, local, _ in self.pieces):
            return tensor
        parts, start = [], 0
        for n, local, at in self.pieces:
            parts.append(tensor.narrow(self.axis, start + at, local))
            start += n
        return torch.cat(parts, dim=self.axis)


class GraniteMoeHybridMoE(nn.Module):
    """``block_sparse_moe``: router ``router.layer`` ``[E, H]``; expert e computes
    ``output_linear[e] · (silu(g) · u)`` with ``g | u = input_linear[e] · x``; the output is
    ``Σ_k softmax(top-k router logits)_k · expert_k(x)``. The exact eager loop over the hit
    experts (ascending, as the reference adds them) reads them on the host.

    Under tensor parallelism each rank holds a slice of every expert's intermediate size
    (``g`` and ``u`` rows of ``input_linear``, the columns of ``output_linear``); under expert
    parallelism (``TensorParallel.ep``) ``E / ep`` whole experts, their intermediate size
    split over the ``tp / ep`` ranks that share them, and it computes only the tokens routed
    to them. Either way the block all-reduces its output once (the router is replicated)."""

    reads_host = True

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int):
        super().__init__()
        self.top_k = top_k
        self.tp = tp = tensor_parallel()
        self.first_expert, count = tp.experts(num_experts)
        start, inter = tp.expert_slice(intermediate_size)
        experts = (num_experts, count, self.first_expert)
        half = (intermediate_size, inter, start)
        self.router = nn.Module()
        self.router.layer = nn.Linear(hidden_size, num_experts, bias=False)
        self.input_linear = StackedWeight(experts, 2 * intermediate_size, hidden_size, 1,
                                          (half, half))
        self.output_linear = StackedWeight(experts, hidden_size, intermediate_size, 2, (half,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        top, ids = self.router.layer(x).topk(self.top_k, dim=-1)
        gates = torch.softmax(top, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        count = self.input_linear.weight.shape[0]
        for e in torch.unique(ids).tolist():
            local = e - self.first_expert
            if not 0 <= local < count:  # another expert-parallel rank's expert
                continue
            token, slot = torch.where(ids == e)
            gate, up = F.linear(x[token], self.input_linear.weight[local]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.output_linear.weight[local])
            out.index_add_(0, token, y * gates[token, slot, None])
        return all_reduce(out, self.tp)


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, is_mamba: bool, index: int, attn: AttentionSpec,
                 dims: Mamba2Dims):
        super().__init__()
        h, eps = config.get_int("hidden_size"), config.get_float("rms_norm_eps", 1e-6)
        self.residual_multiplier = config.get_float("residual_multiplier", 1.0)
        self.is_mamba = is_mamba
        self.input_layernorm = RMSNorm(h, eps)
        if is_mamba:
            self.mamba = Mamba2Layer(dims, index)
        else:
            self.self_attn = SelfAttention(attn, index)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.shared_mlp = SwiGLUMLP(h, config.get_int("shared_intermediate_size"))
        experts = config.get_int("num_local_experts", 0)
        self.block_sparse_moe = (GraniteMoeHybridMoE(
            h, experts, config.get_int("num_experts_per_tok"),
            config.get_int("intermediate_size")) if experts else None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                batch: StateBatch) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = (self.mamba.run(h, batch) if self.is_mamba
             else self.self_attn(positions, h, batch))
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        out = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(h) + out
        return x + out * self.residual_multiplier


def granite_attention_spec(config: ModelConfig) -> AttentionSpec:
    hidden = config.get_int("hidden_size")
    heads = config.get_int("num_attention_heads")
    head_dim = hidden // heads
    rope = (RopeSpec.from_config(config, head_dim)
            if config.get_str("position_embedding_type", "nope") == "rope" else None)
    bias = config.get_bool("attention_bias", False)
    return AttentionSpec(hidden, heads, config.get_int("num_key_value_heads", heads), head_dim,
                         rope, qkv_bias=bias, out_bias=bias,
                         norm_eps=config.get_float("rms_norm_eps", 1e-6),
                         scaling=config.get_float("attention_multiplier", head_dim ** -0.5))


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config: ModelConfig, dims: Mamba2Dims):
        super().__init__()
        h = config.get_int("hidden_size")
        kinds = [k == "mamba" for k in config["layer_types"]]
        if any(k not in ("mamba", "attention") for k in config["layer_types"]):
            raise NotImplementedError(f"layer_types {config['layer_types']}")
        attn = granite_attention_spec(config)
        self.embedding_multiplier = config.get_float("embedding_multiplier", 1.0)
        self.embed_tokens = VocabEmbedding(config.get_int("vocab_size"), h)
        self.layers = nn.ModuleList(
            GraniteMoeHybridDecoderLayer(config, m, i, attn, dims)
            for m, i in zip(kinds, layer_indices(kinds), strict=True))
        self.norm = RMSNorm(h, config.get_float("rms_norm_eps", 1e-6))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: StateBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            x = layer(positions, x, batch)
        return self.norm(x)


class GraniteMoeHybridForCausalLM(HybridLM):
    checkpoint_rules = (
        WeightRule(_LAYER + r"shared_mlp\.input_linear\.weight",
                   r"model.layers.\g<l>.shared_mlp.gate_up_proj.weight"),
        WeightRule(_LAYER + r"shared_mlp\.output_linear\.weight",
                   r"model.layers.\g<l>.shared_mlp.down_proj.weight"),
    )

    def __init__(self, config: ModelConfig):
        check_silu(config)
        super().__init__(config)
        self.logits_scaling = config.get_float("logits_scaling", 1.0)
        self.model = GraniteMoeHybridModel(config, self.mamba_dims)
        self.make_head(config.get_int("vocab_size"), config.get_int("hidden_size"))
