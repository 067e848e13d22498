"""The kinds of step and what each runs on the device after the forward (DESIGN §2, §7): the
registry the engine hands its ``ModelRunner``. A post-step is built from the batch alone, so
the runner picks it from the batch's ``StepKind``; ``read`` names the part of the output the
scheduler reads, which the overlap schedule copies to the host early."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dllm.autoregressive import SampleNext
from dllm.denoise import DenoisePost, denoise_inputs, parse_group
from dllm.embedding import pool_parts
from dllm.full_diffusion import FullDiffusionPost, full_diffusion_inputs
from dllm.runner.forward_batch import ForwardBatch, StepKind
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


def _capture_denoise(bs: int, group: str, flags: tuple[bool, bool, bool],
                     mask_token_id: int | None, logits_shift: int) -> DenoisePost:
    """The post-step a graph of ``group`` (``dllm.denoise.graph_group``) captures."""
    name, trace = parse_group(group)
    return DenoisePost({name: list(range(bs))}, bs, mask_token_id, logits_shift, flags, trace)


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
            capture=lambda bs, group, flags: _capture_denoise(
                bs, group, flags, mask_token_id, logits_shift)),
        StepKind.SAMPLE: StepSpec(SampleNext.for_batch, read=HostCopy,
                                  capture=lambda bs, group, flags: SampleNext(flags)),
        StepKind.FULL_STEP: StepSpec(lambda b: FullDiffusionPost.for_batch(
            b, mask_token_id, logits_shift, compute_logits())),
        StepKind.POOL: StepSpec(lambda b: pool_parts),
    }


def register_inputs(registry: InputRegistry, full_attention: bool) -> None:
    """The post-steps' per-row inputs in the runner's static registry."""
    denoise_inputs(registry)
    if full_attention:
        full_diffusion_inputs(registry)
