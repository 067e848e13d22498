"""The synchronous library API: ``LLM(model=DIR).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from dllm.config import EngineConfig
from dllm.engine import Engine, Prompt, embed_inputs
from dllm.outputs import EmbeddingOutput, RequestOutput
from dllm.sampling_params import SamplingParams


def is_single_prompt(prompts: Any) -> bool:
    """A string, a list of token ids, or one conversation (a list of message dicts)."""
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, list) and prompts:
        return all(isinstance(p, int) for p in prompts) or all(isinstance(p, dict) for p in prompts)
    return False


class LLM:
    """Offline generation. ``engine_args`` are the fields of ``EngineConfig`` (algorithm,
    algorithm_config, block_size, max_running_requests, page_size, dtype, device,
    attention_backend, ...), or ``model`` is an ``EngineConfig`` itself. ``model=None`` loads
    the built-in model."""

    def __init__(self, model: str | EngineConfig | None = None, **engine_args: Any):
        if isinstance(model, EngineConfig):
            if engine_args:
                raise TypeError("pass either an EngineConfig or engine arguments, not both")
            config = model
        else:
            unknown = sorted(set(engine_args) - EngineConfig.field_names())
            if unknown:
                raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
            config = EngineConfig(model=model, **engine_args)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Requests run together, continuously batched."""
        batch = [prompts] if is_single_prompt(prompts) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
        reqs = [self.engine.make_request(p, sp) for p, sp in zip(batch, params, strict=True)]
        self._run(reqs, use_tqdm, "generate")
        return [self.engine.output_of(r) for r in reqs]

    def embed(self, texts: str | list[int] | Sequence[str | list[int]],
              dimensions: int | None = None, normalize: bool | None = None,
              use_tqdm: bool = False) -> list[EmbeddingOutput]:
        """Pooled embeddings, one per text (``task="embed"`` engines). ``dimensions``
        truncates (Matryoshka) before normalisation; ``normalize`` overrides the checkpoint's
        Normalize module."""
        batch = embed_inputs(texts)
        reqs = [self.engine.make_embed_request(t, dimensions, normalize) for t in batch]
        self._run(reqs, use_tqdm, "embed")
        return [self.engine.embedding_of(r) for r in reqs]

    def _run(self, reqs: list, use_tqdm: bool, desc: str) -> None:
        for req in reqs:
            self.engine.add_request(req)
        bar = tqdm(total=len(reqs), disable=not use_tqdm, desc=desc)
        done = 0
        while any(not r.finished for r in reqs):
            self.engine.step()
            now = sum(r.finished for r in reqs)
            bar.update(now - done)
            done = now
        self.engine.drain()  # forwards queued for requests that have since finished
        bar.close()

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template applied)."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self.generate(list(messages), sampling_params, use_tqdm)
