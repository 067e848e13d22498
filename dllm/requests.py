"""Turning prompts into validated requests (DESIGN §2, first arrow): tokenising, chat
templates, and the settings of each generation kind (block diffusion, full attention,
autoregressive, embedding), checked before a request reaches the scheduler."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dllm.algorithms import get_algorithm
from dllm.checkpoint import ModelInfo
from dllm.full_diffusion import resolve_request
from dllm.models.pooling import PoolingConfig
from dllm.request import (
    AutoregressiveState,
    DenoiseState,
    EmbeddingState,
    FullAttentionState,
    KindState,
    Req,
)
from dllm.sampling_params import SamplingParams, check_engine_keys
from dllm.tokenizer import check_chat_template

Prompt = str | list[int] | list[dict[str, Any]]
# The decoder of a diffusion family that names none (and of the non-diffusion ones, unused).
DEFAULT_ALGORITHM = "low_confidence_dynamic"


def resolve_task(task: str, info: ModelInfo, path: str) -> str:
    """``generate`` or ``embed`` for a model: ``auto`` is ``embed`` for a
    sentence-transformers layout; embeddings come from causal attention models only."""
    if task == "auto":
        task = "embed" if PoolingConfig.is_sentence_transformers(path) else "generate"
    if task == "embed" and info.spec.kind != "causal_lm":
        raise ValueError(f"{info.architecture} cannot serve embeddings")
    if task == "embed" and info.spec.recurrent_state:
        raise NotImplementedError(f"{info.architecture}: embeddings of hybrid models are not "
                                  "served yet")
    return task


@dataclass(frozen=True)
class GenerationLayout:
    """What the engine decided about generation for its checkpoint: the block a request
    reserves at a time (1 for full attention and autoregressive models), a full-attention
    family's default block (None: the canvas), the mask token (None: autoregressive), and the
    default algorithm with its settings."""

    block_size: int
    full_attention: bool
    canvas_block_size: int | None
    mask_token_id: int | None
    algorithm_name: str
    algorithm_config: dict[str, Any]


def generation_layout(info: ModelInfo, task: str, algorithm: str | None,
                      algorithm_config: dict[str, Any]) -> GenerationLayout:
    """The engine argument first, then ``generation_config.json``, then the family's facts
    (``ArchitectureSpec``)."""
    spec = info.spec
    diffusion = task == "generate" and spec.is_diffusion
    full = diffusion and spec.kind == "full_diffusion"
    block = int(info.block_size) if diffusion and not full else 1
    name = (algorithm or info.generation_defaults.get("algorithm")
            or (spec.default_algorithm if diffusion else None) or DEFAULT_ALGORITHM)
    get_algorithm(name)  # fail fast on an unknown name
    family: dict[str, Any] = dict(spec.algorithm_config)
    if spec.default_sub_block_size and diffusion:
        family["sub_block_size"] = min(spec.default_sub_block_size, block)
    config = {**family,
              **{k: v for k, v in info.generation_defaults.items() if k != "algorithm"},
              **algorithm_config}
    return GenerationLayout(
        block_size=block, full_attention=full,
        canvas_block_size=(info.block_size or spec.canvas_block_size) if full else None,
        mask_token_id=info.mask_token_id if diffusion else None,
        algorithm_name=name, algorithm_config=config)


class RequestFactory:
    """Builds ``Req`` objects for one engine. ``check_fits(req)`` is the scheduler's check
    that a request could ever be admitted; ``clock()`` the engine's step count (arrival)."""

    def __init__(self, tokenizer: Any, info: ModelInfo, layout: GenerationLayout, task: str,
                 context_length: int, check_fits: Callable[[Req], None],
                 clock: Callable[[], int], seed: int, tensor_parallel_size: int = 1):
        self.tokenizer = tokenizer
        self.tensor_parallel_size = tensor_parallel_size
        self.info = info
        self.layout = layout
        self.task = task
        self.context_length = context_length
        self.check_fits = check_fits
        self.clock = clock
        self._rid_counter = itertools.count()
        self._seed_rng = random.Random(seed)

    def _rid(self, rid: str | None) -> str:
        return rid if rid is not None else f"req-{next(self._rid_counter)}"

    # ---- prompts -----------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.apply_chat_template(prompt)
        if isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return list(prompt)
        raise ValueError("a prompt is a string, a list of token ids or a list of chat messages")

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each chat message needs a string 'role' and 'content'")
        check_chat_template(self.tokenizer)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize_checked(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, each inside the vocabulary (``ValueError`` otherwise)."""
        ids = self.tokenize(prompt)
        bad = next((t for t in ids if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary of "
                             f"{self.info.vocab_size} tokens")
        return ids

    # ---- generation --------------------------------------------------------------------
    def make_request(self, prompt: Prompt, params: SamplingParams | None = None,
                     rid: str | None = None) -> Req:
        """Validate and build a request (raises ``ValueError`` on bad input)."""
        params = params or SamplingParams()
        ids = self.tokenize_checked(prompt)
        if len(ids) + params.max_new_tokens > self.context_length:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the context length of {self.context_length}")
        state, block_size = self._state(params)
        if params.seed is None:  # a copy: the caller may reuse one params object
            params = dataclasses.replace(params, seed=self._seed_rng.randrange(2**31))
        req = Req(rid=self._rid(rid), prompt_ids=ids, params=params, state=state,
                  block_size=block_size, arrival=self.clock())
        self.check_fits(req)
        return req

    def _state(self, params: SamplingParams) -> tuple[KindState, int]:
        """The request's state of its kind (the algorithm and its validated settings; for
        full attention also the cache mode and CFG scale) and its block size."""
        lay = self.layout
        if params.traced and self.tensor_parallel_size > 1:
            # The trace's log-softmax reads whole-vocabulary logits; each rank holds a slice.
            raise ValueError("logprobs and denoise steps are not recorded under tensor "
                             f"parallelism yet (tensor_parallel_size "
                             f"{self.tensor_parallel_size}); serve with one rank to use them")
        dllm = dict(params.dllm)
        name = dllm.pop("algorithm", None) or lay.algorithm_name
        merged = {**lay.algorithm_config, **dllm}
        if lay.full_attention:
            layout = resolve_request(merged, get_algorithm(name), lay.canvas_block_size,
                                     params.max_new_tokens)
            return FullAttentionState(name, layout.algo_config, cache_mode=layout.cache_mode,
                                      cfg_scale=layout.cfg_scale), layout.block_size
        if lay.mask_token_id is not None:
            self._check_block_diffusion_keys(merged)
            config = get_algorithm(name).validate(merged, lay.block_size)
            return DenoiseState(name, config), lay.block_size
        if dllm:
            raise ValueError(f"dllm settings apply to diffusion models; "
                             f"{self.info.architecture} is autoregressive")
        if params.traced:
            raise ValueError(f"logprobs and denoise steps are recorded for diffusion models; "
                             f"{self.info.architecture} is autoregressive")
        return AutoregressiveState(), lay.block_size

    def _check_block_diffusion_keys(self, merged: dict[str, Any]) -> None:
        """Full-attention settings mean nothing to a block-causal model: its block size is
        the one it was trained with and its KV reuse is already exact."""
        check_engine_keys(merged)
        arch, block = self.info.architecture, self.layout.block_size
        if merged.get("block_size", block) != block:
            raise ValueError(f"dllm.block_size: {arch} decodes in blocks of {block} "
                             f"(its training block size); got {merged['block_size']}")
        if merged.get("cfg_scale", 0):
            raise ValueError(f"dllm.cfg_scale applies to full-attention models; {arch} is "
                             "block-causal")
        if merged.get("cache_mode", "exact") != "exact":
            raise ValueError(f"dllm.cache_mode applies to full-attention models; {arch} "
                             "reuses its KV exactly")

    # ---- embeddings --------------------------------------------------------------------
    def make_embed_request(self, text: str | list[int], dimensions: int | None = None,
                           normalize: bool | None = None, rid: str | None = None) -> Req:
        if self.task != "embed":
            raise ValueError("this engine generates; start it with task='embed' for embeddings")
        hidden = int(self.info.config.get("hidden_size", 0))
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(
                dimensions, int) or not 1 <= dimensions <= hidden):
            raise ValueError(f"dimensions must be an integer in [1, {hidden}], got {dimensions!r}")
        ids = self.tokenize_checked(text)
        if len(ids) > self.context_length:
            raise ValueError(f"input ({len(ids)} tokens) exceeds the context length of "
                             f"{self.context_length}")
        req = Req(rid=self._rid(rid), prompt_ids=ids, params=SamplingParams(max_new_tokens=1),
                  state=EmbeddingState(normalize, dimensions), block_size=1,
                  arrival=self.clock())
        self.check_fits(req)
        return req
