"""The engine loop (DESIGN §2): schedule, forward, update.

The engine resolves the checkpoint (``dllm.checkpoint``), builds the request factory
(``dllm.requests``), the runner that owns the model and its memory
(``dllm.runner.model_runner``) and the scheduler of the model's kind, and then loops:
``Engine.step`` below. The overlap schedule and per-request failure isolation live in
``dllm.pipeline``."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

from dllm.autoregressive import AutoregressiveScheduler
from dllm.block_diffusion import BlockDiffusionScheduler
from dllm.checkpoint import ModelInfo, load_model_info, resolve_model_path
from dllm.config import EngineConfig
from dllm.distributed import RankGroup, launch
from dllm.embedding import EmbeddingScheduler
from dllm.full_diffusion import FullDiffusionScheduler
from dllm.models.pooling import PoolingConfig
from dllm.outputs import EmbeddingOutput, RequestOutput
from dllm.pipeline import Isolation, OverlapPipeline
from dllm.prefix_cache import PrefixCache
from dllm.request import Req
from dllm.requests import Prompt, RequestFactory, generation_layout, resolve_task
from dllm.runner.forward_batch import ForwardMode, ScheduledBatch, StepKind
from dllm.runner.model_runner import ModelRunner, RunnerConfig
from dllm.scheduler import Scheduler, SchedulerConfig
from dllm.steps import register_inputs, step_specs
from dllm.stop import StopChecker
from dllm.tokenizer import load_tokenizer

__all__ = ["Engine", "Prompt", "embed_inputs"]

logger = logging.getLogger(__name__)


def embed_inputs(texts: str | list[int] | Sequence[str | list[int]]) -> list[str | list[int]]:
    """One text or list of token ids -> a batch of one; a list of them -> the list."""
    single = isinstance(texts, str) or (isinstance(texts, list) and bool(texts)
                                        and isinstance(texts[0], int))
    return [texts] if single else list(texts)


class Engine:
    """Owns the tokenizer, the request factory, the scheduler and the runner. Single-threaded:
    ``AsyncLLM`` drives it from one background thread."""

    def __init__(self, config: EngineConfig | None = None, *, ranks: RankGroup | None = None,
                 **engine_args):
        self.config = cfg = config or EngineConfig(**engine_args)
        self.device = cfg.resolve_device()
        # Tensor parallelism: rank 0 starts the other ranks (``dllm.distributed``).
        self.ranks = ranks if ranks is not None else launch(cfg, self.device)
        # Under torchrun the ranks started are the tensor-parallel ones unless --cp splits them.
        self.tp_size = self.ranks.world // cfg.context_parallel_size
        self.dtype = cfg.resolve_dtype(self.device)
        path = resolve_model_path(cfg.model)
        self.tokenizer = load_tokenizer(cfg.tokenizer or path, cfg.chat_template)
        self.info: ModelInfo = load_model_info(dataclasses.replace(cfg, model=path),
                                               self.tokenizer)
        self.task = resolve_task(self.config.task, self.info, path)
        layout = generation_layout(self.info, self.task, cfg.algorithm, cfg.algorithm_config)
        self.block_size, self.mask_token_id = layout.block_size, layout.mask_token_id
        self.full_attention, self.canvas_block_size = layout.full_attention, layout.canvas_block_size
        self.algorithm_name, self.algorithm_config = layout.algorithm_name, layout.algorithm_config
        self.context_length = self.info.context_length
        overlap = (cfg.overlap_schedule if cfg.overlap_schedule is not None
                   else self.device.type == "cuda")
        self.prefix_cache_reason = self._prefix_cache_off_reason()
        if self.prefix_cache_reason and cfg.enable_prefix_cache:
            logger.info("prefix cache: off (%s)", self.prefix_cache_reason)
        # Hybrids: track slots per request (two under the overlap schedule: the next step
        # may write one while the host still reads the other's result).
        self.num_track_slots = (2 if overlap else 1) if self.prefix_cache_enabled else 0
        self.runner = ModelRunner(self._runner_config(path), step_specs(
            self.mask_token_id, self.info.spec.logits_shift, lambda: self.model.compute_logits),
            lambda r: register_inputs(r, full_attention=self.full_attention))
        self.model, self.kv_pool, self.req_pool = (self.runner.model, self.runner.kv_pool,
                                                   self.runner.req_pool)
        self.scheduler = self._make_scheduler(path)
        self.step_count = 0
        self.requests = RequestFactory(self.tokenizer, self.info, layout, self.task,
                                       self.context_length, self.scheduler.check_fits,
                                       lambda: self.step_count, cfg.seed,
                                       self.tp_size)
        self.make_request, self.make_embed_request = (self.requests.make_request,
                                                      self.requests.make_embed_request)
        self.tokenize, self.apply_chat_template = (self.requests.tokenize,
                                                   self.requests.apply_chat_template)
        self.isolation = Isolation(self.runner, self.scheduler, self.req_pool,
                                   self.ranks.check_peers)
        self.pipeline = OverlapPipeline(self.isolation, overlap)

    # ---- setup -------------------------------------------------------------------------
    def _prefix_cache_off_reason(self) -> str:
        """Why this engine runs without the prefix cache ('' if it runs with it)."""
        kind = self.info.spec.kind
        if not self.config.enable_prefix_cache:
            return "--disable-prefix-cache"
        if self.task != "generate":
            return "embeddings: each request is one prefill, nothing to reuse"
        if kind == "full_diffusion" or self.full_attention:
            return (f"{self.info.architecture} attends to the whole sequence, masked tail "
                    "included: a prefix's KV depends on what follows it, so none is exact")
        if kind not in ("causal_lm", "block_diffusion"):
            return f"{kind} models are not cached"
        return ""

    @property
    def prefix_cache_enabled(self) -> bool:
        return not self.prefix_cache_reason

    def _runner_config(self, path: str) -> RunnerConfig:
        cfg, kind = self.config, self.info.spec.kind
        graph_kind = ({"block_diffusion": StepKind.DENOISE, "causal_lm": StepKind.SAMPLE}
                      .get(kind) if self.task == "generate" else None)
        return RunnerConfig(
            model_path=path, device=self.device, dtype=self.dtype, load_format=cfg.load_format,
            seed=cfg.seed, attention_backend=cfg.attention_backend, page_size=cfg.page_size,
            num_kv_pages=cfg.num_kv_pages, kv_cache_memory_gb=cfg.kv_cache_memory_gb,
            max_running_requests=cfg.max_running_requests,
            max_prefill_tokens=cfg.max_prefill_tokens, context_length=self.context_length,
            block_size=self.block_size, graph_kind=graph_kind,
            graph_group=self.algorithm_name if graph_kind is StepKind.DENOISE else "",
            disable_cuda_graph=cfg.disable_cuda_graph, cuda_graph_max_bs=cfg.cuda_graph_max_bs,
            cuda_graph_batch_sizes=cfg.cuda_graph_batch_sizes,
            tp_rank=self.ranks.rank if self.tp_size > 1 else 0, tp_size=self.tp_size,
            ep_size=cfg.expert_parallel_size,
            cp_rank=self.ranks.rank if cfg.context_parallel_size > 1 else 0,
            cp_size=cfg.context_parallel_size,
            # committed + track slots per request, and one more for the cache's snapshots
            state_slots_per_request=2 + self.num_track_slots if self.num_track_slots else 1)

    def _make_scheduler(self, path: str) -> Scheduler:
        cfg, spec = self.config, self.info.spec
        page, state_pool = self.kv_pool.page_size, self.runner.state_pool
        sc = SchedulerConfig(cfg.max_running_requests, cfg.max_prefill_tokens, self.block_size,
                             self.mask_token_id,
                             track_grid=math.lcm(self.block_size, page, cfg.state_track_interval),
                             num_track_slots=self.num_track_slots)
        self.prefix_cache = (PrefixCache(self.kv_pool, PrefixCache.chunk_for(page, self.block_size),
                                         state_pool)
                             if self.prefix_cache_enabled else None)
        args = (sc, self.req_pool, self.kv_pool,
                StopChecker(self.tokenizer, self.info.eos_token_ids), state_pool)
        kw = {"prefix_cache": self.prefix_cache}
        if self.task == "embed":
            return EmbeddingScheduler(*args, pooling=PoolingConfig.from_checkpoint(path))
        if spec.recurrent_state and spec.kind == "full_diffusion":
            raise NotImplementedError(f"{self.info.architecture}: full-attention diffusion "
                                      "over a recurrent state is not served (no such model)")
        if spec.kind == "causal_lm":
            return AutoregressiveScheduler(*args, **kw)
        if spec.kind == "block_diffusion":
            return BlockDiffusionScheduler(*args, logits_shift=spec.logits_shift, **kw)
        if spec.kind == "full_diffusion":
            return FullDiffusionScheduler(*args, logits_shift=spec.logits_shift)
        raise NotImplementedError(f"{self.info.architecture} ({spec.kind}) is not served yet")

    # ---- requests ----------------------------------------------------------------------
    def max_new_tokens_room(self, prompt: Prompt) -> int:
        """The largest ``max_new_tokens`` this prompt could be given: within the context
        length and within the KV pool (reservations round up to a block)."""
        n = len(self.tokenize(prompt))
        pool = min(self.kv_pool.num_usable_pages * self.kv_pool.page_size,
                   self.req_pool.max_context)
        return min(self.context_length - n, pool // self.block_size * self.block_size - n)

    def add_request(self, req: Req) -> None:
        self.scheduler.add(req)  # raises on bad input before any other rank hears of it
        self.ranks.mirror("add_request", req)

    def abort(self, rid: str) -> Req | None:
        self.ranks.mirror("abort", rid)
        return self.scheduler.abort(rid)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.pipeline.pending)

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[Req]:
        """One engine step: every forward the scheduler plans (prefill and denoise both
        progress). Returns the requests whose output grew or that finished."""
        self.ranks.mirror("step")
        self.step_count += 1
        changed: list[Req] = []
        for batch in self.scheduler.schedule():
            if self.pipeline.overlaps(batch):  # queued now, applied next step
                changed += self.pipeline.launch(batch)
            else:  # results apply in launch order
                changed += self.pipeline.drain() + self.isolation.run(batch)
        return changed + self.pipeline.end_step()

    def drain(self) -> list[Req]:
        """Apply the results still in flight (overlapped scheduling)."""
        self.ranks.mirror("drain")
        return self.pipeline.drain()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (also done at interpreter exit)."""
        self.ranks.shutdown()

    @property
    def overlap(self) -> bool:
        """Whether steps run under the overlap schedule (settable between steps)."""
        return self.pipeline.enabled

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self.pipeline.enabled = value

    def idle_step(self) -> None:
        """An ``IDLE`` forward: nothing scheduled on this rank, but a step must be taken (a
        data-parallel rank joins its peers' collectives). Touches no memory pool."""
        self.ranks.mirror("idle_step")
        self.runner.forward(ScheduledBatch(ForwardMode.IDLE))

    # ---- outputs -----------------------------------------------------------------------
    def output_of(self, req: Req) -> RequestOutput:
        return RequestOutput.of(req, self.scheduler.stop_checker.output_text(req))

    def embedding_of(self, req: Req) -> EmbeddingOutput:
        return EmbeddingOutput.of(req)

    def check_memory(self) -> None:
        """Raise ``AssertionError`` if any KV page, request slot or state slot leaked (with
        no request left, every page and slot is free or held by the prefix cache)."""
        self.scheduler.check_memory()
        if not self.has_work:
            cache = self.prefix_cache
            pages, states = cache.held() if cache is not None else ([], [])
            assert self.kv_pool.num_free_pages + len(pages) == self.kv_pool.num_usable_pages
            assert cache is None or (cache.evictable_pages == len(pages)
                                     and cache.evictable_states == len(states))
            state = self.runner.state_pool
            assert state is None or state.num_free + len(states) == state.num_slots

    def clear_prefix_cache(self) -> None:
        """Evict every prefix-cache node no running request uses."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def run_to_completion(self, reqs: Sequence[Req]) -> list[RequestOutput]:
        for req in reqs:
            self.add_request(req)
        while any(not r.finished for r in reqs):
            self.step()
        self.drain()
        return [self.output_of(r) for r in reqs]
