"""What the hybrid Mamba2 + attention models share (Granite 4.0-H, Bamba, Nemotron-H, and
Mamba2 as the case without attention): the Mamba2 mixer over the batch's state pool, and the
model contract the runner reads (``compute_logits``, ``kv_cache_spec``, ``state_spec``).

A Mamba layer reads each row's state from ``state_read_slots``, runs the mixer
(``dllm.models.mamba2``: the recurrence of a whole row from that state, or one token a row
in ``DECODE``) and writes the state after the row to ``state_write_slots`` (and, for the
prefix cache, to ``state_track_slots`` where the batch has them). The forward modes
differ only in those indices (DESIGN §6): an autoregressive prefill chunk or decode step
reads and writes the request's committed slot; a block-diffusion denoise step writes
to slot 0, the padding slot, so the committed state stays as it was. Reads are gathers
(copies), so a row that reads and writes the same slot sees the state before the step.
Attention layers are numbered over the attention layers only (their KV-pool layer) and
Mamba layers over the Mamba layers only (their state-pool layer)."""

from __future__ import annotations

import torch
from torch import nn

from dllm.models.attention import KVCacheSpec, StateBatch
from dllm.models.config import ModelConfig
from dllm.models.decoder import SelfAttention
from dllm.models.layers import LMHead, VocabEmbedding
from dllm.models.mamba2 import Mamba2Dims, Mamba2Mixer, MambaStateSpec
from dllm.models.ops import UsesOps
from dllm.models.parallel import ShardedLogits
from dllm.models.weights import SKIP_ROTARY, SKIP_TIED_HEAD, WeightRule


class Mamba2Layer(Mamba2Mixer):
    """A Mamba2 mixer (the checkpoint's parameter names) whose states live in the batch's
    state pool, as Mamba layer ``state_index``."""

    def __init__(self, dims: Mamba2Dims, state_index: int):
        super().__init__(dims)
        self.state_index = state_index

    def run(self, hidden: torch.Tensor, batch: StateBatch) -> torch.Tensor:
        """``hidden [T, H]`` of the batch's rows → ``[T, H]``; each row's state read from its
        read slot and the new one written to its write slot (no host sync). A batch without
        a state pool runs each row from zeros and keeps no state."""
        pool = getattr(batch, "state_pool", None)
        if pool is None:  # no pool (a stateless full forward): rows start from zeros
            conv, ssm = self.zero_states(len(batch.extend_lens_cpu))
            return self(hidden, conv, ssm, batch.extend_lens_cpu)[0]
        conv_pool, ssm_pool = pool.layer(self.state_index)
        read, write = batch.state_read_slots, batch.state_write_slots
        conv, ssm = conv_pool[read], ssm_pool[read]
        split = getattr(batch, "state_split_cpu", None)
        if batch.is_decode:
            out, conv, ssm = self.decode(hidden, conv, ssm)
        elif split is not None:
            out, conv, ssm = self._split_rows(hidden, conv, ssm, batch.extend_lens_cpu, split,
                                              (conv_pool.dtype, ssm_pool.dtype))
        else:
            out, conv, ssm = self(hidden, conv, ssm, batch.extend_lens_cpu)
        conv, ssm = conv.to(conv_pool.dtype), ssm.to(ssm_pool.dtype)
        conv_pool.index_copy_(0, write, conv)
        ssm_pool.index_copy_(0, write, ssm)
        track = getattr(batch, "state_track_slots", None)
        if track is not None:  # the prefix cache's snapshot (slot 0 for rows that keep none)
            conv_pool.index_copy_(0, track, conv)
            ssm_pool.index_copy_(0, track, ssm)
        return out


    def _split_rows(self, hidden: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                    lens: list[int], split: list[int], dtypes: tuple[torch.dtype, torch.dtype]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows whose state is kept after their first ``split[r]`` tokens (0: after the whole
        row): those tokens run first, from the read state, and give the state returned; the
        rest of the row (a merged commit row's denoise block) continues from it and its
        state is dropped. Exactly the two forwards such a row replaces: the rest starts from
        the state as the pool (``dtypes``) would hold it. Host slicing only."""
        starts = [sum(lens[:r]) for r in range(len(lens))]
        head = [n if k == 0 else k for n, k in zip(lens, split, strict=True)]
        first = torch.cat([hidden[s : s + h] for s, h in zip(starts, head, strict=True)])
        y1, conv1, ssm1 = self(first, conv, ssm, head)
        tails = [r for r, k in enumerate(split) if 0 < k < lens[r]]
        parts: list[torch.Tensor] = []
        offs = [sum(head[:r]) for r in range(len(head))]
        y2 = None
        if tails:
            rest = torch.cat([hidden[starts[r] + head[r] : starts[r] + lens[r]] for r in tails])
            y2, _, _ = self(rest, torch.cat([conv1[r : r + 1] for r in tails]).to(dtypes[0]),
                            torch.cat([ssm1[r : r + 1] for r in tails]).to(dtypes[1]),
                            [lens[r] - head[r] for r in tails])
        at = 0
        for r in range(len(lens)):
            parts.append(y1[offs[r] : offs[r] + head[r]])
            if r in tails:
                n = lens[r] - head[r]
                parts.append(y2[at : at + n])
                at += n
        return torch.cat(parts), conv1, ssm1


class HybridLM(UsesOps, nn.Module):
    """Base of the hybrid models. Subclasses build their network under the checkpoint's own
    module names and implement ``forward(input_ids, positions, batch) -> hidden [T, H]``
    (final norm applied) and ``embedding()``; ``lm_head`` is None when tied to the
    embedding. ``logits_scaling`` divides the logits (Granite)."""

    checkpoint_rules: tuple[WeightRule, ...] = ()
    logits_scaling: float = 1.0

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tie_word_embeddings = config.get_bool("tie_word_embeddings", False)
        self.mamba_dims = Mamba2Dims.from_config(config)

    def make_head(self, vocab_size: int, hidden_size: int) -> None:
        self.lm_head = None if self.tie_word_embeddings else LMHead(vocab_size, hidden_size)

    def embedding(self) -> VocabEmbedding:
        """The token embedding (the tied head); ``model.embed_tokens`` by default (HF's
        layout: Granite-H, Bamba), ``backbone.embeddings`` in the ``backbone`` families."""
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: StateBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    @property
    def weight_rules(self) -> tuple[WeightRule, ...]:
        tied = (SKIP_TIED_HEAD,) if self.tie_word_embeddings else ()
        return (SKIP_ROTARY, *tied, *self.checkpoint_rules)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | ShardedLogits:
        """``[N, hidden]`` → ``[N, vocab]`` in the model dtype; under tensor parallelism this
        rank's vocabulary columns as ``ShardedLogits`` (as ``DecoderLM.compute_logits``)."""
        head = self.embedding() if self.lm_head is None else self.lm_head
        logits = self.ops.linear(hidden, head)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if head.weight.shape[0] == head.vocab_size:
            return logits
        logits[:, head.end - head.start:] = float("-inf")  # padding rows: never chosen
        return ShardedLogits(logits, head.start, head.vocab_size, head.tp)

    def _attention_layers(self) -> list[SelfAttention]:
        return [m for m in self.modules() if isinstance(m, SelfAttention)]

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self._attention_layers()
        if not attn:  # pure Mamba2: no KV at all
            return KVCacheSpec(0, 1, 1)
        s = attn[0].spec
        return KVCacheSpec(len(attn), s.num_kv_heads, s.head_dim)

    def state_spec(self) -> MambaStateSpec:
        """The state pool's shape: under tensor parallelism each rank's slots hold its own
        heads' conv and SSM state (``Mamba2Mixer.dims``, this rank's part)."""
        layers = [m for m in self.modules() if isinstance(m, Mamba2Layer)]
        return MambaStateSpec(len(layers), layers[0].dims if layers else self.mamba_dims)

    @property
    def supports_cuda_graph(self) -> bool:
        """False when a module reads device values on the host (the MoE expert loops)."""
        return not any(getattr(m, "reads_host", False) for m in self.modules())


def layer_indices(kinds: list[bool]) -> list[int]:
    """For a list of flags (is this layer of the kind?), each layer's index among the layers
    of its kind: ``[True, False, True] → [0, 0, 1]``."""
    out, seen = [], {True: 0, False: 0}
    for k in kinds:
        out.append(seen[k])
        seen[k] += 1
    return out
