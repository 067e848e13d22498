"""One forward pass (DESIGN §7): load a ``ScheduledBatch`` into the static registry, run the
model, pick the logits, and run the post-step (the unmasking algorithm) on the device.

The post-step is handed in by the engine (``PostStep``), so the runner never imports the
engine or the algorithms, and a CUDA graph can capture forward and post-step together."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch

from dllm.runner.attention.base import AttentionBackend, KVCache
from dllm.runner.forward_batch import ForwardBatch, ForwardMode, LogitsMode, ScheduledBatch
from dllm.runner.input_registry import InputRegistry


class PostStep(Protocol):
    """Runs right after the forward on the device; must not synchronise with the host."""

    def __call__(self, forward_batch: ForwardBatch, hidden: torch.Tensor,
                 logits: torch.Tensor | None) -> Any: ...


class Runner(ABC):
    """The interface shared by ``EagerRunner`` and ``CudaGraphRunner``."""

    @abstractmethod
    def can_run(self, batch: ScheduledBatch) -> bool: ...

    @abstractmethod
    def load_batch(self, batch: ScheduledBatch) -> ForwardBatch: ...

    @abstractmethod
    def execute(self, forward_batch: ForwardBatch, post: PostStep | None) -> Any: ...


class ModelRunner:
    """Owns the model, the KV cache view, the attention backend and the runners."""

    def __init__(self, model: torch.nn.Module, kv_pool: KVCache, req_to_token: torch.Tensor,
                 backend: AttentionBackend, device: torch.device, max_bs: int,
                 max_tokens: int):
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.backend = backend
        self.device = device
        self.registry = InputRegistry(max_bs, max_tokens, device)
        self.eager = EagerRunner(self)
        self.runners: list[Runner] = [self.eager]

    def add_runner(self, runner: Runner) -> None:
        """Put a faster runner (e.g. CUDA graphs) in front of the eager fallback."""
        self.runners.insert(0, runner)

    @torch.no_grad()
    def forward(self, batch: ScheduledBatch, post: PostStep | None = None) -> Any:
        runner = next(r for r in self.runners if r.can_run(batch))
        return runner.execute(runner.load_batch(batch), post)

    def run_model(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states ``[T, H]`` and the logits the batch asks for."""
        fb.attn_backend.prepare(fb)
        fb.memo.clear()
        hidden = self.model(fb.input_ids, fb.positions, fb)
        if fb.logits_mode is LogitsMode.NONE:
            return hidden, None
        if fb.logits_mode is LogitsMode.LAST:
            return hidden, self.model.compute_logits(hidden[fb.last_token_index])
        return hidden, self.model.compute_logits(hidden)


class EagerRunner(Runner):
    """Runs any batch as it comes, unpadded; the fallback for shapes not captured."""

    def __init__(self, owner: ModelRunner):
        self.owner = owner

    def can_run(self, batch: ScheduledBatch) -> bool:
        return True

    def load_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        o = self.owner
        fb = o.registry.load(batch, o.req_to_token)
        fb.kv_pool = o.kv_pool
        fb.attn_backend = o.backend
        return fb

    def execute(self, forward_batch: ForwardBatch, post: PostStep | None) -> Any:
        """Dispatch on the mode. ``DECODE``, ``EXTEND`` and ``DLLM_EXTEND`` share one path
        (their differences live in the batch's mask, lengths and logits mode);
        ``IDLE`` computes nothing and writes nothing to the KV pool — a data-parallel rank
        would still join its peers' collectives there."""
        fb = forward_batch
        if fb.mode is ForwardMode.IDLE:
            return None
        hidden, logits = self.owner.run_model(fb)
        return post(fb, hidden, logits) if post is not None else (hidden, logits)
