"""The kinds of step and what each runs on the device after the forward (DESIGN §2, §7): the
registry the engine hands its ``ModelRunner``. A post-step is built from the batch alone, so
the runner picks it from the batch's ``StepKind``; ``read`` names the part of the output the
scheduler reads, which the overlap schedule copies to the host early."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from dllm.autoregressive import SampleNext
from dllm.denoise import GRAPH_FLAGS, DenoisePost, denoise_inputs, graph_flags
from dllm.embedding import pool_parts
from dllm.full_diffusion import FullDiffusionPost, full_diffusion_inputs
from dllm.runner.forward_batch import ForwardBatch, ScheduledBatch, StepKind
from dllm.runner.host_copy import HostCopy
from dllm.runner.input_registry import InputRegistry
from dllm.runner.model_runner import StepSpec


def _greedy_last(fb: ForwardBatch, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``[bs]`` argmax of each row's last-token logits (``LogitsMode.LAST``)."""
    return logits.argmax(dim=-1)


def _unread(output: Any) -> None:
    """A prefill without logits: nothing of its output is read."""
    return None


def _read_denoise(output: tuple[torch.Tensor, dict[str, torch.Tensor]]
                  ) -> tuple[HostCopy, dict[str, torch.Tensor]]:
    packed, states = output
    return HostCopy(packed), states


def _denoise_key(batch: ScheduledBatch) -> Hashable | None:
    """A denoise or decode graph's key: the rows' algorithm group (``graph_group``; one for
    the whole batch) and the sampling flags."""
    groups = set(batch.row_groups) or {""}
    if len(groups) != 1:
        return None
    return groups.pop(), graph_flags(batch.row_inputs)


def startup_graph_keys(kind: StepKind, group: str, width: int | None) -> tuple[Hashable, ...]:
    """The keys captured at start for the engine's algorithm ``group``: greedy and sampling
    (full-attention steps: over blocks of ``width`` positions, without CFG and Dream's
    block-start step, the common ones)."""
    if kind is StepKind.FULL_STEP:
        return tuple((group, f, width, False, False) for f in GRAPH_FLAGS) if width else ()
    return tuple((group if kind is StepKind.DENOISE else "", f) for f in GRAPH_FLAGS)


def step_specs(mask_token_id: int | None, logits_shift: int,
               compute_logits: Callable[[], Callable[[torch.Tensor], torch.Tensor]]
               ) -> dict[StepKind, StepSpec]:
    """``compute_logits()`` gives the model's LM head (read once the model is loaded)."""
    return {
        StepKind.PREFILL: StepSpec(lambda b: None, read=_unread),
        StepKind.FIRST_TOKEN: StepSpec(lambda b: _greedy_last, read=HostCopy),
        StepKind.DENOISE: StepSpec(
            lambda b: DenoisePost.for_reqs([r.req for r in b.rows], [r.block for r in b.rows],
                                           mask_token_id, logits_shift),
            read=_read_denoise,
            capture=lambda bs, key: DenoisePost.for_graph(bs, *key, mask_token_id,
                                                           logits_shift),
            graph_key=_denoise_key),
        StepKind.SAMPLE: StepSpec(SampleNext.for_batch, read=HostCopy,
                                  capture=lambda bs, key: SampleNext(key[1]),
                                  graph_key=_denoise_key),
        StepKind.FULL_STEP: StepSpec(
            lambda b: FullDiffusionPost.for_batch(b, mask_token_id, logits_shift,
                                                  compute_logits()),
            read=_read_denoise,
            capture=lambda bs, key: FullDiffusionPost.for_graph(
                bs, key, mask_token_id, logits_shift, compute_logits()),
            graph_key=FullDiffusionPost.graph_key),
        StepKind.POOL: StepSpec(lambda b: pool_parts),
    }


def register_inputs(registry: InputRegistry, full_attention: bool) -> None:
    """The post-steps' per-row inputs in the runner's static registry."""
    denoise_inputs(registry)
    if full_attention:
        full_diffusion_inputs(registry)
