"""The engine loop (DESIGN §2): schedule, forward, update.

The engine resolves the checkpoint (``dllm.checkpoint``), builds the request factory
(``dllm.requests``), the runner that owns the model and its memory
(``dllm.runner.model_runner``) and the scheduler of the model's kind, and then loops:
``Engine.step`` below. The overlap schedule and per-request failure isolation live in
``dllm.pipeline``.

Data-parallel attention (``data_parallel_size`` > 1, DESIGN §9): every rank is a DP rank with
its own scheduler, requests and KV cache. Rank 0 hands each new request to the least loaded
rank (fewest unfinished requests; ties to the lowest rank) and keeps a shadow of the requests
it handed away; a step runs each rank's own batches in lockstep — before each forward the
ranks agree whether any of them has one, and a rank that has none runs an ``IDLE`` forward
(zero rows through the shared MLP / MoE collectives) — and then the other ranks send rank 0
what their requests gained, so outputs come back through rank 0."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

from dllm.autoregressive import AutoregressiveScheduler
from dllm.block_diffusion import BlockDiffusionScheduler, merges_in_two_rows
from dllm.checkpoint import ModelInfo, load_model_info, resolve_model_path
from dllm.config import EngineConfig
from dllm.distributed import RankGroup, launch
from dllm.embedding import EmbeddingScheduler
from dllm.full_diffusion import MAX_WINDOW, FullDiffusionScheduler
from dllm.models.pooling import PoolingConfig
from dllm.outputs import EmbeddingOutput, RequestOutput
from dllm.pipeline import Isolation, OverlapPipeline
from dllm.prefix_cache import PrefixCache
from dllm.request import FinishReason, Req, ReqStatus
from dllm.requests import Prompt, RequestFactory, generation_layout, resolve_task
from dllm.runner.forward_batch import ForwardMode, ScheduledBatch, StepKind
from dllm.runner.model_runner import ModelRunner, RunnerConfig
from dllm.scheduler import Scheduler, SchedulerConfig
from dllm.steps import register_inputs, startup_graph_keys, step_specs
from dllm.stop import StopChecker
from dllm.tokenizer import load_tokenizer

__all__ = ["Engine", "Prompt", "embed_inputs"]

logger = logging.getLogger(__name__)

# The largest full-attention step captured in a CUDA graph on first use (rows × window
# tokens). Past it a step is compute-bound: launching it eagerly costs less than the GPU
# time, and each graph holds its own activations.
FULL_GRAPH_TOKENS = 2048


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
        # Data-parallel attention: this rank's index (= its rank); rank 0's shadows of the
        # requests other ranks run, rid -> (request, rank).
        self.dp_size = cfg.data_parallel_size
        self.dp_rank = self.ranks.rank if self.dp_size > 1 else 0
        self.remote: dict[str, tuple[Req, int]] = {}
        self.dp_forwards = [0, 0]  # this rank's forwards run: of its own batches, IDLE
        overlap = (cfg.overlap_schedule if cfg.overlap_schedule is not None
                   else self.device.type == "cuda")
        if self.dp_size > 1:  # the ranks' forwards line up one by one, each result read
            overlap = False
        # Merged commits: on by default, except over a recurrent state on CUDA, where the
        # merged row (2·B tokens, its state split after the first block) runs outside the
        # CUDA graphs; an attention-only model runs it as two whole-block rows, captured.
        self.merged_commit = (cfg.merged_commit if cfg.merged_commit is not None
                              else not (self.device.type == "cuda"
                                        and self.info.spec.recurrent_state))
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
        self.runner.capture_cuda_graphs()  # after ``self.model``: the steps' LM head reads it
        self.scheduler = self._make_scheduler(path)
        self.step_count = 0
        self.requests = RequestFactory(self.tokenizer, self.info, layout, self.task,
                                       self.context_length, self.scheduler.check_fits,
                                       lambda: self.step_count, cfg.seed,
                                       self.tp_size // self.dp_size)
        self.make_request, self.make_embed_request = (self.requests.make_request,
                                                      self.requests.make_embed_request)
        self.tokenize, self.apply_chat_template = (self.requests.tokenize,
                                                   self.requests.apply_chat_template)
        self.isolation = Isolation(self.runner, self.scheduler, self.req_pool,
                                   self.ranks.check_peers, retry=self.dp_size == 1)
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
        graph_kind = ({"block_diffusion": StepKind.DENOISE, "causal_lm": StepKind.SAMPLE,
                       "full_diffusion": StepKind.FULL_STEP}
                      .get(kind) if self.task == "generate" else None)
        # Full attention: the dual cache's window (a block of the default size) at start,
        # every other window on first use, up to FULL_GRAPH_TOKENS a graph.
        window = (self.canvas_block_size if graph_kind is StepKind.FULL_STEP
                  else self.block_size)
        return RunnerConfig(
            model_path=path, device=self.device, dtype=self.dtype, load_format=cfg.load_format,
            seed=cfg.seed, attention_backend=cfg.attention_backend, page_size=cfg.page_size,
            num_kv_pages=cfg.num_kv_pages, kv_cache_memory_gb=cfg.kv_cache_memory_gb,
            max_running_requests=cfg.max_running_requests,
            max_prefill_tokens=cfg.max_prefill_tokens, context_length=self.context_length,
            block_size=self.block_size, graph_kind=graph_kind,
            graph_keys=(startup_graph_keys(graph_kind, self.algorithm_name, window)
                        if graph_kind is not None else ()),
            graph_windows=(window,) if window else (),
            graph_lazy_tokens=FULL_GRAPH_TOKENS if graph_kind is StepKind.FULL_STEP else 0,
            disable_cuda_graph=cfg.disable_cuda_graph, cuda_graph_max_bs=cfg.cuda_graph_max_bs,
            cuda_graph_batch_sizes=cfg.cuda_graph_batch_sizes,
            rows_per_request=2 if kind == "full_diffusion" or (
                kind == "block_diffusion" and merges_in_two_rows(
                    self.merged_commit, self.info.spec.logits_shift,
                    self.info.spec.recurrent_state)) else 1,
            tp_rank=self.ranks.rank if self.tp_size > 1 else 0, tp_size=self.tp_size,
            ep_size=cfg.expert_parallel_size, dp_size=self.dp_size, cpu_group=self.ranks.control,
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
            return BlockDiffusionScheduler(*args, logits_shift=spec.logits_shift,
                                           merged_commit=self.merged_commit, **kw)
        if spec.kind == "full_diffusion":
            # Context parallelism splits EXTEND forwards: no window form under it.
            return FullDiffusionScheduler(*args, logits_shift=spec.logits_shift,
                                          max_window=0 if cfg.context_parallel_size > 1
                                          else MAX_WINDOW)
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
        if self.dp_size == 1:
            self.scheduler.add(req)  # raises on bad input before any other rank hears of it
            self.ranks.mirror("add_request", req)
            return
        # Data parallel: checked here (every rank's pools are the same size), then handed
        # to the least loaded rank.
        self.scheduler.check_fits(req)
        if self._in_use(req.rid):
            raise ValueError(f"request id {req.rid!r} is already in use")
        loads = [len(self.scheduler.waiting) + len(self.scheduler.running)] + [0] * (
            self.dp_size - 1)
        for _, rank in self.remote.values():
            loads[rank] += 1
        target = loads.index(min(loads))
        self.ranks.mirror("dp_add", req, target)
        self.dp_add(req, target)

    def dp_add(self, req: Req, target: int) -> None:
        """Data parallel: ``req`` goes to rank ``target`` (rank 0 keeps a shadow of it)."""
        if target == self.dp_rank:
            self.scheduler.add(req)
        elif self.dp_rank == 0:
            self.remote[req.rid] = (req, target)

    def _in_use(self, rid: str) -> bool:
        s = self.scheduler
        return rid in s.running or any(r.rid == rid for r in s.waiting) or rid in self.remote

    def abort(self, rid: str) -> Req | None:
        self.ranks.mirror("abort", rid)
        if rid in self.remote:  # the rank running it aborts it at the same call
            req, _ = self.remote.pop(rid)
            req.finish_reason, req.status = FinishReason.ABORT, ReqStatus.FINISHED
            return req
        return self.scheduler.abort(rid)

    @property
    def has_work(self) -> bool:
        return (self.scheduler.has_work or bool(self.pipeline.pending)
                or bool(self.remote))  # data parallel: another rank's requests

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[Req]:
        """One engine step: every forward the scheduler plans (prefill and denoise both
        progress). Returns the requests whose output grew or that finished."""
        self.ranks.mirror("step")
        self.step_count += 1
        if self.dp_size > 1:
            return self._dp_step()
        changed: list[Req] = []
        for batch in self.scheduler.schedule():
            if self.pipeline.overlaps(batch):  # queued now, applied next step
                changed += self.pipeline.launch(batch)
            else:  # results apply in launch order
                changed += self.pipeline.drain() + self.isolation.run(batch)
        return changed + self.pipeline.end_step()

    def _dp_step(self) -> list[Req]:
        """Data parallel: this rank's batches, forward by forward in lockstep with the other
        ranks (an ``IDLE`` forward while it has none and another rank still has one), then
        the other ranks' changed requests sent to rank 0."""
        changed: list[Req] = []
        batches = iter(self.scheduler.schedule())
        while True:
            batch = next(batches, None)
            if not self.ranks.any_rank(batch is not None):
                break
            self.dp_forwards[batch is None] += 1
            if batch is None:
                self.runner.forward(ScheduledBatch(ForwardMode.IDLE))
            else:
                changed += self.isolation.run(batch)
        sent = self.ranks.gather([] if self.dp_rank == 0 else
                                 [_progress(req) for req in {r.rid: r for r in changed}.values()])
        for updates in sent[1:] if sent is not None else ():
            for rid, fields in updates:
                if rid not in self.remote:  # aborted meanwhile
                    continue
                req = self.remote[rid][0]
                for name, value in fields.items():
                    setattr(req, name, value)
                if req.finished:
                    del self.remote[rid]
                changed.append(req)
        return changed

    def dp_forward_counts(self) -> list[tuple[int, int]] | None:
        """Data parallel: every rank's forwards so far, ``(own batches, IDLE)``, in rank
        order (on rank 0; None on the others)."""
        self.ranks.mirror("dp_forward_counts")
        got = self.ranks.gather(tuple(self.dp_forwards))
        return [tuple(c) for c in got] if got is not None else None

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
        no request left, every page and slot is free or held by the prefix cache). Under
        data parallelism every rank checks its own and rank 0 raises for any of them."""
        if self.dp_size == 1:
            return self._check_memory()
        self.ranks.mirror("check_memory")
        try:
            self._check_memory()
            error = None
        except AssertionError as exc:
            error = f"rank {self.dp_rank}: {exc!r}"
        errors = self.ranks.gather(error)
        failed = [e for e in errors or () if e is not None]
        if failed:
            raise AssertionError("; ".join(failed))

    def _check_memory(self) -> None:
        self.scheduler.check_memory()
        if not (self.scheduler.has_work or self.pipeline.pending):
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


# What a data-parallel rank sends rank 0 of a request that changed in a step (rank 0's
# shadow takes these; the text is decoded on rank 0 from ``output_ids``).
_PROGRESS = ("status", "output_ids", "finish_reason", "error", "stop_matched", "cached_tokens",
             "prefilled_len", "num_forward_passes", "num_denoise_forwards",
             "num_commit_forwards", "num_blocks_committed", "trace")


def _progress(req: Req) -> tuple[str, dict]:
    fields = {name: getattr(req, name) for name in _PROGRESS}
    if req.is_embedding and req.finished:
        fields["state"] = dataclasses.replace(req.state, pool_state={})
    return req.rid, fields
