"""Mamba2 (``Mamba2ForCausalLM``, e.g. Mamba-Codestral): the pure-SSM case of the hybrids, every
layer ``x += mixer(rmsnorm(x))`` with a Mamba2 mixer (full-width gated norm, as transformers
4.57's ``modeling_mamba2.py``). No attention and so no KV cache: the state pool is all the
memory a request holds besides its token table.

Checkpoint names: ``backbone.embeddings``, ``backbone.layers.{i}.{norm, mixer.*}``,
``backbone.norm_f``, ``lm_head``."""

from __future__ import annotations

import torch
from torch import nn

from dllm.models.attention import StateBatch
from dllm.models.config import ModelConfig
from dllm.models.hybrid import HybridLM, Mamba2Layer
from dllm.models.layers import RMSNorm, VocabEmbedding
from dllm.models.mamba2 import Mamba2Dims


class Mamba2Block(nn.Module):
    def __init__(self, dims: Mamba2Dims, index: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dims.hidden_size, eps)
        self.mixer = Mamba2Layer(dims, index)

    def forward(self, x: torch.Tensor, batch: StateBatch) -> torch.Tensor:
        return x + self.mixer.run(self.norm(x), batch)


class Mamba2Backbone(nn.Module):
    def __init__(self, config: ModelConfig, dims: Mamba2Dims):
        super().__init__()
        eps = config.get_float("layer_norm_epsilon", 1e-5)
        self.embeddings = VocabEmbedding(config.get_int("vocab_size"), dims.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(dims, i, eps)
                                    for i in range(config.get_int("num_hidden_layers")))
        self.norm_f = RMSNorm(dims.hidden_size, eps)

    def forward(self, input_ids: torch.Tensor, batch: StateBatch) -> torch.Tensor:
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, batch)
        return self.norm_f(x)


class Mamba2ForCausalLM(HybridLM):
    def __init__(self, config: ModelConfig):
        if not config.get_bool("rms_norm", True):
            raise NotImplementedError("Mamba2 without rms_norm")
        super().__init__(config)
        self.backbone = Mamba2Backbone(config, self.mamba_dims)
        self.make_head(config.get_int("vocab_size"), config.get_int("hidden_size"))

    def embedding(self) -> VocabEmbedding:
        return self.backbone.embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: StateBatch) -> torch.Tensor:
        return self.backbone(input_ids, batch)
