"""NVIDIA Nemotron-H (``NemotronHForCausalLM``; not in transformers 4.x: the hub's own
``modeling_nemotron_h.py``). One pre-norm and one mixer per layer, by the characters of
``hybrid_override_pattern``: ``M`` a Mamba2 mixer (gated norm per group of
``intermediate / n_groups`` channels), ``*`` attention without positional encoding, ``-`` an
MLP ``down(relu(up(x))²)``, ``E`` a mixture of relu² experts (sigmoid router scores, the
choice biased by ``e_score_correction_bias``, group-limited top-k, weights normalised and
× ``routed_scaling_factor``, plus a shared expert). Per layer ``x += mixer(rmsnorm(x))``.

Checkpoint names: ``backbone.embeddings``, ``backbone.layers.{i}.norm``,
``backbone.layers.{i}.mixer.*`` (``in_proj, conv1d, dt_bias, A_log, D, norm, out_proj``;
``q,k,v,o_proj``; ``up_proj, down_proj``; ``gate.weight, gate.e_score_correction_bias,
experts.{e}.{up,down}_proj, shared_experts.{up,down}_proj``), ``backbone.norm_f``,
``lm_head``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm.models.attention import StateBatch
from dllm.models.config import ModelConfig
from dllm.models.decoder import AttentionSpec, SelfAttention
from dllm.models.hybrid import HybridLM, Mamba2Layer
from dllm.models.layers import PackedLinear, RMSNorm, RowLinear, VocabEmbedding, column_parts
from dllm.models.mamba2 import Mamba2Dims
from dllm.models.ops import UsesOps
from dllm.models.parallel import all_reduce, tensor_parallel


class Relu2MLP(nn.Module):
    """``down_proj(relu(up_proj(x))²)``. Under tensor parallelism ``up_proj`` is split by its
    rows and ``down_proj`` by its input; the output is all-reduced (``reduce``; an expert's
    partial output is left to its MoE block, which all-reduces once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        self.up_proj = PackedLinear(hidden_size, [intermediate_size], bias=bias,
                                    parts=column_parts(intermediate_size))
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias=bias)
        self.tp, self.reduce = self.down_proj.tp, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(torch.relu(self.up_proj(x)).square())
        return all_reduce(out, self.tp) if self.reduce else out


class NemotronHGate(nn.Module):
    """Router ``weight [E, H]`` and ``e_score_correction_bias [E]``, kept in float32."""

    fp32_params = ("weight", "e_score_correction_bias")

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> float32 [T, E]
        return F.linear(x.float(), self.weight.float())


class NemotronHMoE(UsesOps, nn.Module):
    """Routed relu² experts plus ``shared_experts``; the routing is the layer ops' sigmoid
    group-limited top-k (``LayerOps.moe_route_sigmoid``: the reference's in torch, one Triton
    launch where the runner installs it), and the exact loop over the hit experts
    (ascending, as the reference adds them) reads them on the host. Under tensor parallelism
    every expert is split by its intermediate size and the block all-reduces once; expert
    parallelism is not built for these per-expert modules (``ValueError``)."""

    reads_host = True

    def __init__(self, config: ModelConfig, hidden_size: int):
        super().__init__()
        e = config.get_int("n_routed_experts")
        self.top_k = config.get_int("num_experts_per_tok")
        self.n_group = config.get_int("n_group", 1)
        self.topk_group = config.get_int("topk_group", 1)
        self.renormalize = config.get_bool("norm_topk_prob", True)
        self.scaling = config.get_float("routed_scaling_factor", 1.0)
        bias = config.get_bool("mlp_bias", False)
        self.tp = tensor_parallel()
        if self.tp.ep > 1:
            raise ValueError("expert parallelism over Nemotron-H MoE layers is not built; "
                             "leave --ep at 1 (tensor parallelism splits every expert by its "
                             "intermediate size)")
        self.gate = NemotronHGate(hidden_size, e)
        self.experts = nn.ModuleList(
            Relu2MLP(hidden_size, config.get_int("moe_intermediate_size"), bias, reduce=False)
            for _ in range(e))
        self.shared_experts = Relu2MLP(
            hidden_size, config.get_int("moe_shared_expert_intermediate_size"), bias,
            reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.moe_route_sigmoid(self.gate(x), self.top_k, self.n_group,
                                                  self.topk_group,
                                                  self.gate.e_score_correction_bias,
                                                  self.renormalize, self.scaling)
        out = torch.zeros_like(x, dtype=weights.dtype)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return all_reduce(out.to(x.dtype) + self.shared_experts(x), self.tp)


class NemotronHBlock(nn.Module):
    def __init__(self, config: ModelConfig, kind: str, index: int, attn: AttentionSpec,
                 dims: Mamba2Dims):
        super().__init__()
        h = config.get_int("hidden_size")
        self.kind = kind
        self.norm = RMSNorm(h, config.get_float("layer_norm_epsilon", 1e-5))
        if kind == "M":
            self.mixer = Mamba2Layer(dims, index)
        elif kind == "*":
            self.mixer = SelfAttention(attn, index)
        elif kind == "-":
            self.mixer = Relu2MLP(h, config.get_int("intermediate_size"),
                                  config.get_bool("mlp_bias", False))
        elif kind == "E":
            self.mixer = NemotronHMoE(config, h)
        else:
            raise NotImplementedError(f"layer kind {kind!r} of hybrid_override_pattern")

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                batch: StateBatch) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "M":
            return x + self.mixer.run(h, batch)
        if self.kind == "*":
            return x + self.mixer(positions, h, batch)
        return x + self.mixer(h)


def nemotron_attention_spec(config: ModelConfig) -> AttentionSpec:
    hidden = config.get_int("hidden_size")
    heads = config.get_int("num_attention_heads")
    head_dim = config.get_int("head_dim", hidden // heads)
    bias = config.get_bool("attention_bias", False)
    return AttentionSpec(hidden, heads, config.get_int("num_key_value_heads", heads), head_dim,
                         None, qkv_bias=bias, out_bias=bias)


class NemotronHBackbone(nn.Module):
    def __init__(self, config: ModelConfig, dims: Mamba2Dims):
        super().__init__()
        h = config.get_int("hidden_size")
        pattern = config.get_str("hybrid_override_pattern")
        attn = nemotron_attention_spec(config)
        counts: dict[str, int] = {}
        blocks = []
        for kind in pattern:
            key = kind if kind in "M*" else "other"
            blocks.append(NemotronHBlock(config, kind, counts.get(key, 0), attn, dims))
            counts[key] = counts.get(key, 0) + 1
        self.embeddings = VocabEmbedding(config.get_int("vocab_size"), h)
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(h, config.get_float("layer_norm_epsilon", 1e-5))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: StateBatch) -> torch.Tensor:
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(positions, x, batch)
        return self.norm_f(x)


class NemotronHForCausalLM(HybridLM):
    def __init__(self, config: ModelConfig):
        for key, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            if config.get_str(key, want) != want:
                raise NotImplementedError(f"{key} {config.get_str(key)!r} (only {want!r})")
        super().__init__(config)
        self.backbone = NemotronHBackbone(config, self.mamba_dims)
        self.make_head(config.get_int("vocab_size"), config.get_int("hidden_size"))

    def embedding(self) -> VocabEmbedding:
        return self.backbone.embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: StateBatch) -> torch.Tensor:
        return self.backbone(input_ids, positions, batch)
