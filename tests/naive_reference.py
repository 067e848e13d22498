"""The strongest oracle (DESIGN §11): generate one request at a time, recomputing the whole
sequence with an explicit attention mask at every denoise step, no KV cache, no batching.

It shares only the unmasking algorithms with the engine (those are tested on their own);
block layout, masks, caching, batching and stop rules here are written independently."""

from __future__ import annotations

import torch

from dllm.algorithms import get_algorithm
from dllm.algorithms.base import DenoiseInput, SamplingTensors
from dllm.runner.forward_batch import AttentionMask
from dllm.testing.harness import forward_full


def naive_block_diffusion(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    block_size: int,
    mask_id: int,
    algorithm: str,
    algo_config: dict,
    max_new_tokens: int,
    stop_ids: set[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[int]:
    algo = get_algorithm(algorithm)
    cfg = algo.validate(algo_config, block_size)
    seq = list(prompt)
    out: list[int] = []
    while True:
        start = len(seq) // block_size * block_size
        fixed = len(seq) - start
        block = seq[start:] + [mask_id] * (block_size - fixed)
        editable = torch.tensor([[False] * fixed + [True] * (block_size - fixed)])
        state = {k: torch.zeros(1, dtype=torch.int64) for k in algo.state_keys}
        step = 0
        while True:
            logits = forward_full(model, seq[:start] + block, AttentionMask.BLOCK_CAUSAL,
                                  block_size)[start:]
            res = algo.step(DenoiseInput(
                logits=logits[None],
                tokens=torch.tensor([block]),
                editable=editable,
                mask_id=mask_id,
                step=torch.tensor([step]),
                num_initial_masks=torch.tensor([block_size - fixed]),
                positions=torch.arange(start, start + block_size)[None],
                sampling=SamplingTensors(
                    temperature=torch.tensor([temperature], dtype=torch.float32),
                    top_k=torch.tensor([top_k]),
                    top_p=torch.tensor([top_p], dtype=torch.float32),
                    seed=torch.tensor([seed]),
                ),
                config=algo.stack_configs([cfg], torch.device("cpu")),
                state=state,
            ))
            block = res.tokens[0].tolist()
            state = res.state
            step += 1
            if bool(res.done[0]):
                break
        assert block[:fixed] == seq[start:], "a prompt position was changed"
        seq = seq[:start] + block
        for t in block[fixed:]:
            out.append(t)
            if t in stop_ids or len(out) == max_new_tokens:
                return out
