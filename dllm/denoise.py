"""The post-step of a ``DLLM_EXTEND`` forward: align the logits, run each row's unmasking
algorithm on the device, and pack the result into one small tensor for the host."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from dllm.algorithms import get_algorithm
from dllm.algorithms.base import DenoiseInput, SamplingTensors
from dllm.request import Req
from dllm.runner.forward_batch import ForwardBatch
from dllm.runner.input_registry import InputRegistry


@dataclass(frozen=True)
class DenoiseResult:
    """Host copy of one denoise step's result (the one read per step)."""

    tokens: list[list[int]]  # [bs][B]
    done: list[bool]
    num_transferred: list[int]
    state: list[dict]  # per row: algorithm state, name -> 0-d device tensor


ROW_INPUTS = {  # name -> (dtype, pad)
    "step": (torch.int64, 0),
    "num_initial_masks": (torch.int64, 0),
    "is_commit": (torch.int64, 1),
    "temperature": (torch.float32, 0.0),
    "top_k": (torch.int64, 0),
    "top_p": (torch.float32, 1.0),
    "seed": (torch.int64, 0),
}


def denoise_inputs(registry: InputRegistry) -> None:
    """Declare the post-step inputs in the runner's static registry."""
    registry.register("editable", "tokens", torch.int64, 0)
    for name, (dtype, pad) in ROW_INPUTS.items():
        registry.register(name, "reqs", dtype, pad)


class DenoisePost:
    """Built per batch on the host (which rows run which algorithm is host knowledge);
    ``__call__`` runs on the device with no host synchronisation."""

    def __init__(self, reqs: list[Req], mask_token_id: int, logits_shift: int):
        self.reqs = reqs
        self.mask_token_id = mask_token_id
        self.logits_shift = logits_shift
        groups: dict[str, list[int]] = defaultdict(list)
        for i, r in enumerate(reqs):
            if not r.block.resolved:  # commit rows only write their KV
                groups[r.algorithm].append(i)
        self.groups = dict(groups)

    def __call__(self, fb: ForwardBatch, hidden: torch.Tensor,
                 logits: torch.Tensor | None) -> tuple[torch.Tensor, list[dict]]:
        bs, b = len(self.reqs), fb.block_size
        device = fb.input_ids.device
        logits = logits[: bs * b].view(bs, b, -1)
        if self.logits_shift:
            # Token i is read from position i-1; position 0 of a block is never masked.
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        tokens = fb.input_ids[: bs * b].view(bs, b)
        editable = fb.extras["editable"][: bs * b].view(bs, b).bool()
        positions = fb.positions[: bs * b].view(bs, b)
        ex = {k: fb.extras[k][:bs] for k in ROW_INPUTS}
        out_tokens = tokens.clone()
        done = torch.zeros(bs, dtype=torch.int64, device=device)
        transferred = torch.zeros(bs, dtype=torch.int64, device=device)
        states: list[dict] = [{} for _ in range(bs)]
        for name, rows in self.groups.items():
            algo = get_algorithm(name)
            idx = torch.tensor(rows, dtype=torch.int64, device=device)
            group = [self.reqs[i] for i in rows]
            x = DenoiseInput(
                logits=logits.index_select(0, idx),
                tokens=tokens.index_select(0, idx),
                editable=editable.index_select(0, idx),
                mask_id=self.mask_token_id,
                step=ex["step"].index_select(0, idx),
                num_initial_masks=ex["num_initial_masks"].index_select(0, idx),
                positions=positions.index_select(0, idx),
                sampling=SamplingTensors(
                    temperature=ex["temperature"].index_select(0, idx),
                    top_k=ex["top_k"].index_select(0, idx),
                    top_p=ex["top_p"].index_select(0, idx),
                    seed=ex["seed"].index_select(0, idx),
                ),
                config=algo.stack_configs([r.algo_config for r in group], device),
                state=_stack_state(algo, group, device),
            )
            out = algo.step(x)
            out_tokens.index_copy_(0, idx, out.tokens)
            done.index_copy_(0, idx, out.done.to(torch.int64))
            transferred.index_copy_(0, idx, out.num_transferred.to(torch.int64))
            for j, i in enumerate(rows):
                states[i] = {k: v[j] for k, v in out.state.items()}
        packed = torch.cat([out_tokens, done[:, None], transferred[:, None]], dim=1)
        return packed, states

    @staticmethod
    def read(output: tuple[torch.Tensor, list[dict]]) -> DenoiseResult:
        """The one host read of a denoise step."""
        packed, states = output
        rows = packed.tolist()
        return DenoiseResult(
            tokens=[r[:-2] for r in rows],
            done=[bool(r[-2]) for r in rows],
            num_transferred=[r[-1] for r in rows],
            state=states,
        )


def _stack_state(algo, group: list[Req], device: torch.device) -> dict[str, torch.Tensor]:
    state = {}
    for key in algo.state_keys:
        values = [r.block.algo_state.get(key) for r in group]
        if all(v is None for v in values):
            state[key] = torch.zeros(len(group), dtype=torch.int64, device=device)
            continue
        like = next(v for v in values if v is not None)
        state[key] = torch.stack([v if v is not None else torch.zeros_like(like) for v in values])
    return state
