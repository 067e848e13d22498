"""The engine loop (DESIGN §2): schedule, forward, update."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from collections.abc import Sequence
from typing import Any

import torch

from dllm.algorithms import get_algorithm
from dllm.autoregressive import AutoregressiveScheduler, SampleNext
from dllm.block_diffusion import BlockDiffusionScheduler
from dllm.checkpoint import ModelInfo, load_model_info, resolve_model_path
from dllm.config import EngineConfig
from dllm.denoise import DenoisePost, denoise_inputs
from dllm.embedding import EmbeddingScheduler
from dllm.full_diffusion import (
    DEFAULT_BLOCK_SIZE,
    FullDiffusionScheduler,
    full_diffusion_inputs,
    resolve_request,
)
from dllm.memory import ReqToTokenPool, TokenToKVPool
from dllm.models.decoder import fuse_projections
from dllm.models.loader import load_model
from dllm.models.ops import install_ops
from dllm.models.pooling import PoolingConfig
from dllm.outputs import EmbeddingOutput, RequestOutput
from dllm.request import FinishReason, Req
from dllm.runner.attention import make_backend, resolve_backend_name, triton_available
from dllm.runner.forward_batch import ForwardMode, ScheduledBatch
from dllm.runner.model_runner import ModelRunner
from dllm.sampling_params import SamplingParams, check_engine_keys
from dllm.scheduler import Scheduler, SchedulerConfig, Work
from dllm.stop import StopChecker
from dllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int] | list[dict[str, Any]]
DEFAULT_ALGORITHM = "low_confidence_dynamic"
# Each family's reference decoder, when neither the engine nor generation_config.json names one.
FAMILY_ALGORITHMS = {
    "LLaDAModelLM": "low_confidence_static", "LLaDAMoEModelLM": "low_confidence_static",
    "DreamModel": "entropy", "Fast_dLLM_QwenForCausalLM": "hierarchical",
}
# LLaDA samples with float64 Gumbel noise (``low_confidence_static``'s ``gumbel_fp64``) and
# runs every scheduled step of a block, zero-token steps included (``all_steps``).
FAMILY_ALGORITHM_CONFIG: dict[str, dict[str, Any]] = {
    "LLaDAModelLM": {"gumbel_fp64": True, "all_steps": True},
    "LLaDAMoEModelLM": {"gumbel_fp64": True, "all_steps": True},
}


@dataclasses.dataclass
class _Launched:
    """A queued forward whose result the host has not applied yet."""

    work: Work
    batch: ScheduledBatch
    output: Any


def embed_inputs(texts: str | list[int] | Sequence[str | list[int]]) -> list[str | list[int]]:
    """One text or list of token ids -> a batch of one; a list of them -> the list."""
    single = isinstance(texts, str) or (isinstance(texts, list) and bool(texts)
                                        and isinstance(texts[0], int))
    return [texts] if single else list(texts)


class Engine:
    """Owns the model, the memory pools, the scheduler and the runner. Single-threaded:
    ``AsyncLLM`` drives it from one background thread."""

    def __init__(self, config: EngineConfig | None = None, **engine_args: Any):
        self.config = config or EngineConfig(**engine_args)
        cfg = self.config
        self.device = cfg.resolve_device()
        self.dtype = cfg.resolve_dtype(self.device)
        path = resolve_model_path(cfg.model)
        self.tokenizer = load_tokenizer(cfg.tokenizer or path)
        self.info: ModelInfo = load_model_info(
            dataclasses.replace(cfg, model=path), self.tokenizer)
        self.task = self._resolve_task(path)
        torch.manual_seed(cfg.seed)
        self.model, _, _ = load_model(path, dtype=self.dtype, device=self.device,
                                      load_format=cfg.load_format, seed=cfg.seed)
        self.model.eval()
        fuse_projections(self.model)  # q/k/v and gate/up as one GEMM each
        diffusion = self.task == "generate" and self.info.spec.is_diffusion
        spec = self.info.spec
        full = self.full_attention = diffusion and spec.kind == "full_diffusion"
        # Full-attention requests have their own block size (``canvas_block_size`` by
        # default, None = the whole canvas) and reserve their canvas exactly: the engine's
        # granularity for them is one token.
        self.block_size = int(self.info.block_size) if diffusion and not full else 1
        self.canvas_block_size = (self.info.block_size or DEFAULT_BLOCK_SIZE.get(spec.name)
                                  if full else None)
        self.mask_token_id = self.info.mask_token_id if diffusion else None
        self.algorithm_name = (cfg.algorithm or self.info.generation_defaults.get("algorithm")
                               or (FAMILY_ALGORITHMS.get(spec.name) if diffusion else None)
                               or DEFAULT_ALGORITHM)
        get_algorithm(self.algorithm_name)  # fail fast on an unknown name
        family: dict[str, Any] = dict(FAMILY_ALGORITHM_CONFIG.get(spec.name, {}))
        if spec.default_sub_block_size and diffusion:
            family["sub_block_size"] = min(spec.default_sub_block_size, self.block_size)
        self.algorithm_config = {
            **family,
            **{k: v for k, v in self.info.generation_defaults.items() if k != "algorithm"},
            **cfg.algorithm_config,
        }
        self._init_memory()
        self._init_layer_ops()
        self.scheduler = self._make_scheduler(path)
        self.runner = ModelRunner(
            self.model, self.kv_pool, self.req_pool.req_to_token,
            make_backend(cfg.attention_backend, self.device, cfg.page_size), self.device,
            max_bs=cfg.max_running_requests,
            max_tokens=max(cfg.max_prefill_tokens, cfg.max_running_requests * self.block_size),
        )
        denoise_inputs(self.runner.registry)
        if isinstance(self.scheduler, FullDiffusionScheduler):
            full_diffusion_inputs(self.runner.registry)
        self._init_cuda_graphs()
        self.overlap = (cfg.overlap_schedule if cfg.overlap_schedule is not None
                        else self.device.type == "cuda")
        self._pending: list[_Launched] = []  # the last step's forwards, results not yet read
        self._rid_counter = itertools.count()
        self._seed_rng = random.Random(cfg.seed)
        self.step_count = 0

    # ---- setup -------------------------------------------------------------------------
    def _resolve_task(self, path: str) -> str:
        task = self.config.task
        if task == "auto":
            task = "embed" if PoolingConfig.is_sentence_transformers(path) else "generate"
        if task == "embed" and self.info.spec.kind != "causal_lm":
            raise ValueError(f"{self.info.architecture} cannot serve embeddings")
        return task

    def _make_scheduler(self, path: str) -> Scheduler:
        cfg = self.config
        sc = SchedulerConfig(cfg.max_running_requests, cfg.max_prefill_tokens, self.block_size,
                             self.mask_token_id)
        args = (sc, self.req_pool, self.kv_pool,
                StopChecker(self.tokenizer, self.info.eos_token_ids))
        kind = self.info.spec.kind
        if self.task == "embed":
            return EmbeddingScheduler(*args, pooling=PoolingConfig.from_checkpoint(path))
        if kind == "causal_lm":
            return AutoregressiveScheduler(*args)
        if kind == "block_diffusion":
            sched = BlockDiffusionScheduler(*args)
            sched.logits_shift = self.info.spec.logits_shift
            return sched
        if kind == "full_diffusion":
            return FullDiffusionScheduler(*args, compute_logits=self.model.compute_logits,
                                          logits_shift=self.info.spec.logits_shift)
        raise NotImplementedError(f"{self.info.architecture} ({kind}) is not served yet")

    def _init_memory(self) -> None:
        cfg = self.config
        spec = self.model.kv_cache_spec()
        page = cfg.page_size
        self.context_length = self.info.context_length
        # A request's reservation is rounded up to a whole block.
        max_context = -(-self.context_length // self.block_size) * self.block_size
        per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * self.dtype.itemsize
        want = cfg.max_running_requests * -(-max_context // page) + 1
        if cfg.num_kv_pages is not None:
            pages = cfg.num_kv_pages + 1
        else:
            budget_gb = cfg.kv_cache_memory_gb
            if budget_gb is None:
                budget_gb = self._default_kv_budget_gb()
            pages = min(want, int(budget_gb * 2**30 // (per_token * page)) + 1)
        self.req_pool = ReqToTokenPool(cfg.max_running_requests, max_context, self.device)
        self.kv_pool = TokenToKVPool(pages, page, spec.num_layers, spec.num_kv_heads,
                                     spec.head_dim, self.dtype, self.device)
        logger.info("KV cache: %d pages of %d tokens (%.1f MiB)", pages - 1, page,
                    self.kv_pool.memory_bytes() / 2**20)

    def _init_layer_ops(self) -> None:
        """FlashInfer's fused norm/activation/RoPE kernels where its attention runs (CUDA),
        with the Triton kernels of ``TritonOps`` where Triton is installed; the plain-PyTorch
        reference ops elsewhere."""
        cfg = self.config
        if (self.device.type == "cuda"
                and resolve_backend_name(cfg.attention_backend, self.device) == "flashinfer"):
            from dllm.runner.layer_ops import FlashInferOps, TritonOps

            ops = TritonOps if triton_available() else FlashInferOps
            install_ops(self.model, ops(self.model, self.req_pool.max_context, self.device))

    def _init_cuda_graphs(self) -> None:
        """Capture denoise (block diffusion) or decode (autoregressive) steps on CUDA with
        FlashInfer; everything else, and every shape not captured, runs eagerly. With
        ``disable_cuda_graph`` those steps still run padded to the capture sizes and planned
        as a graph would be, without capture (so eager and graph outputs are identical)."""
        cfg = self.config
        kind = self.info.spec.kind
        if (self.device.type != "cuda" or self.task != "generate"
                or resolve_backend_name(cfg.attention_backend, self.device) != "flashinfer"
                or not getattr(self.model, "supports_cuda_graph", True)
                or kind not in ("block_diffusion", "causal_lm")):
            return
        from dllm.runner.cuda_graph import CudaGraphRunner, capture_sizes

        diffusion = kind == "block_diffusion"
        mask_id, shift = self.mask_token_id, self.info.spec.logits_shift

        def post_for(mode: ForwardMode, bs: int, group: str, flags: tuple[bool, bool]):
            if mode is ForwardMode.DLLM_EXTEND:
                return DenoisePost({group: list(range(bs))}, bs, mask_id, shift, flags)
            return SampleNext(flags)

        max_bs = min(cfg.cuda_graph_max_bs or cfg.max_running_requests,
                     cfg.max_running_requests, 256)
        sizes = ([s for s in cfg.cuda_graph_batch_sizes if s <= cfg.max_running_requests]
                 if cfg.cuda_graph_batch_sizes else capture_sizes(max_bs))
        if cfg.cuda_graph_batch_sizes and len(sizes) < len(cfg.cuda_graph_batch_sizes):
            logger.warning("CUDA graphs: batch sizes above max_running_requests=%d are not "
                           "captured (asked for %s)", cfg.max_running_requests,
                           list(cfg.cuda_graph_batch_sizes))
        if not sizes:
            return
        graphs = CudaGraphRunner(
            self.runner, self.block_size, sizes, self.req_pool.max_context, cfg.page_size,
            post_for,
            modes=(ForwardMode.DLLM_EXTEND,) if diffusion else (ForwardMode.DECODE,),
            capture=not cfg.disable_cuda_graph)
        graphs.capture_all([self.algorithm_name] if diffusion else [""])
        self.runner.add_runner(graphs)

    def _default_kv_budget_gb(self) -> float:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return 0.8 * free / 2**30
        return 2.0

    # ---- requests ----------------------------------------------------------------------
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

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None,
                     rid: str | None = None) -> Req:
        """Validate and build a request (raises ``ValueError`` on bad input)."""
        params = params or SamplingParams()
        ids = self.tokenize_checked(prompt)
        if len(ids) + params.max_new_tokens > self.context_length:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the context length of {self.context_length}")
        dllm = dict(params.dllm)
        name = dllm.pop("algorithm", None) or self.algorithm_name
        algo_config: dict[str, Any] = {}
        extra: dict[str, Any] = {"block_size": self.block_size}
        merged = {**self.algorithm_config, **dllm}
        if self.full_attention:
            layout = resolve_request(merged, get_algorithm(name), self.canvas_block_size,
                                     params.max_new_tokens)
            algo_config = layout.algo_config
            extra = {"block_size": layout.block_size, "cache_mode": layout.cache_mode,
                    "cfg_scale": layout.cfg_scale}
        elif self.mask_token_id is not None:
            self._check_block_diffusion_keys(merged)
            algo_config = get_algorithm(name).validate(merged, self.block_size)
        elif dllm:
            raise ValueError(f"dllm settings apply to diffusion models; "
                             f"{self.info.architecture} is autoregressive")
        if params.seed is None:  # a copy: the caller may reuse one params object
            params = dataclasses.replace(params, seed=self._seed_rng.randrange(2**31))
        req = Req(
            rid=rid if rid is not None else f"req-{next(self._rid_counter)}",
            prompt_ids=ids, params=params, algorithm=name, algo_config=algo_config,
            arrival=self.step_count, **extra,
        )
        self.scheduler.check_fits(req)
        return req

    def _check_block_diffusion_keys(self, merged: dict[str, Any]) -> None:
        """Full-attention settings mean nothing to a block-causal model: its block size is
        the one it was trained with and its KV reuse is already exact."""
        check_engine_keys(merged)
        arch = self.info.architecture
        if merged.get("block_size", self.block_size) != self.block_size:
            raise ValueError(f"dllm.block_size: {arch} decodes in blocks of {self.block_size} "
                             f"(its training block size); got {merged['block_size']}")
        if merged.get("cfg_scale", 0):
            raise ValueError(f"dllm.cfg_scale applies to full-attention models; {arch} is "
                             "block-causal")
        if merged.get("cache_mode", "exact") != "exact":
            raise ValueError(f"dllm.cache_mode applies to full-attention models; {arch} "
                             "reuses its KV exactly")

    def max_new_tokens_room(self, prompt: Prompt) -> int:
        """The largest ``max_new_tokens`` this prompt could be given: within the context
        length and within the KV pool (reservations round up to a block)."""
        n = len(self.tokenize(prompt))
        pool = min(self.kv_pool.num_usable_pages * self.kv_pool.page_size,
                   self.req_pool.max_context)
        return min(self.context_length - n, pool // self.block_size * self.block_size - n)

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
        req = Req(rid=rid if rid is not None else f"req-{next(self._rid_counter)}",
                  prompt_ids=ids, params=SamplingParams(max_new_tokens=1),
                  algorithm=self.algorithm_name, algo_config={}, block_size=1,
                  arrival=self.step_count, is_embedding=True, embed_dimensions=dimensions,
                  embed_normalize=normalize)
        self.scheduler.check_fits(req)
        return req

    def add_request(self, req: Req) -> None:
        self.scheduler.add(req)

    def abort(self, rid: str) -> Req | None:
        return self.scheduler.abort(rid)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[Req]:
        """One engine step: every forward the scheduler plans (prefill and denoise both
        progress). Returns the requests whose output grew or that finished.

        Overlapped (``overlap_schedule``): this step's forwards are queued first, then the
        previous step's results are read and applied while the device runs them; the next
        step builds on results not yet read through ``Work.on_launch``. Outputs are the same
        as without overlap; a result reaches the caller one step later."""
        self.step_count += 1
        changed: list[Req] = []
        launched: list[_Launched] = []
        for work in self.scheduler.schedule():
            if not (self.overlap and work.prefetch is not None):
                changed.extend(self.drain())  # results apply in launch order
                changed.extend(self._guarded(work, work.batch))
                continue
            try:
                launched.append(self._launch(work, work.batch))
            except Exception as exc:  # noqa: BLE001 - retried below, request by request
                logger.warning("a batch failed (%s: %s); retrying it request by request",
                               type(exc).__name__, exc)
                # Apply the results in flight first (launch order): the batch was built before
                # them, so requests they finish drop out of the retry.
                changed.extend(self.drain())
                for unit in self._units(work, work.batch):
                    if all(self.scheduler.row_owner(unit, i) is not None
                           for i in range(unit.batch_size)):
                        changed.extend(self._guarded(work, unit))
        changed.extend(self.drain())
        self._pending = launched
        return changed

    @staticmethod
    def _units(work: Work, batch: ScheduledBatch) -> list[ScheduledBatch]:
        """A batch as one batch per request (``Work.split``, else one per row)."""
        return (work.split(batch) if work.split is not None
                else [batch.row(i) for i in range(batch.batch_size)])

    def drain(self) -> list[Req]:
        """Apply the results still in flight (overlapped scheduling)."""
        pending, self._pending = self._pending, []
        return [req for job in pending for req in job.work.apply(job.batch, job.output)]

    def idle_step(self) -> None:
        """An ``IDLE`` forward: nothing scheduled on this rank, but a step must be taken (a
        data-parallel rank joins its peers' collectives). Touches no memory pool."""
        self.runner.forward(ScheduledBatch(ForwardMode.IDLE))

    def _launch(self, work: Work, batch: ScheduledBatch) -> _Launched:
        """Queue one forward and its post-step; record what the next step may build on and,
        when overlapped, start copying the part the host reads."""
        batch.table_version = self.req_pool.version
        post = work.make_post(batch) if work.make_post is not None else None
        output = self.runner.forward(batch, post)
        fetched = work.prefetch(output) if self.overlap and work.prefetch is not None else output
        if work.on_launch is not None:  # last: nothing after it may fail (a retry would count
            work.on_launch(batch, output)  # the launch twice)
        return _Launched(work, batch, fetched)

    def _run(self, work: Work, batch: ScheduledBatch) -> list[Req]:
        job = self._launch(work, batch)
        return work.apply(batch, job.output)

    def _guarded(self, work: Work, batch: ScheduledBatch) -> list[Req]:
        """Run a batch; if it fails, run it again request by request so that only the request
        that fails is finished with an error. A request writes only its own KV slots, and a
        result is applied row by row with each row isolated (``Scheduler.apply_rows``), so
        an exception here means nothing was applied and a retry is safe."""
        try:
            return self._run(work, batch)
        except Exception as exc:  # noqa: BLE001 - isolate the failing request
            units = self._units(work, batch)
            if len(units) > 1:
                return [req for unit in units for req in self._guarded(work, unit)]
            failed, seen = [], set()
            for i, rid in enumerate(batch.rids):  # one request (a CFG request has two rows)
                req = self.scheduler.row_owner(batch, i)
                if req is not None and rid not in seen:
                    seen.add(rid)
                    logger.exception("request %s failed", rid)
                    self.scheduler.finish(req, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
                    failed.append(req)
            return failed

    # ---- outputs -----------------------------------------------------------------------
    def output_of(self, req: Req) -> RequestOutput:
        return RequestOutput(
            rid=req.rid,
            text=self.scheduler.stop_checker.output_text(req),
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            prompt_tokens=req.prompt_len,
            num_forward_passes=req.num_forward_passes,
            num_denoise_forwards=req.num_denoise_forwards,
            num_blocks=req.num_blocks_committed,
            error=req.error,
            prompt_token_ids=list(req.prompt_ids),
        )

    def embedding_of(self, req: Req) -> EmbeddingOutput:
        if req.embedding is None:
            raise RuntimeError(f"request {req.rid} ended without an embedding: "
                               f"{req.error or req.finish_reason}")
        return EmbeddingOutput(req.rid, req.embedding, req.prompt_len)

    def check_memory(self) -> None:
        """Raise ``AssertionError`` if any KV page or request slot leaked."""
        self.scheduler.check_memory()
        if not self.has_work:
            assert self.kv_pool.num_free_pages == self.kv_pool.num_usable_pages

    def run_to_completion(self, reqs: Sequence[Req]) -> list[RequestOutput]:
        for req in reqs:
            self.add_request(req)
        while any(not r.finished for r in reqs):
            self.step()
        self.drain()
        return [self.output_of(r) for r in reqs]
