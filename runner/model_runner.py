"""One rank's forward (DESIGN §7): the ``ModelRunner`` loads the model (q/k/v and gate/up
packed at load), installs the kernels, sizes and owns the KV cache, captures CUDA graphs, and runs one
``ScheduledBatch`` at a time: load it into the static registry, run the model, pick the
logits, run the post-step on the device.

The post-step of each kind of step (``StepKind``) comes from a ``StepSpec`` the engine hands
in, so the runner never imports the engine or the algorithms, and a CUDA graph can capture
forward and post-step together."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dllm.models.decoder import DecoderLayer
from dllm.models.loader import load_model
from dllm.models.ops import install_ops
from dllm.models.parallel import (
    DataParallel,
    TensorParallel,
    data_parallel,
    set_data_parallel,
    set_tensor_parallel,
)
from dllm.runner.attention import make_backend, resolve_backend_name, triton_available
from dllm.runner.context_parallel import ContextParallel
from dllm.runner.forward_batch import (
    ForwardBatch,
    ForwardMode,
    LogitsMode,
    ScheduledBatch,
    StepKind,
)
from dllm.runner.fused_layer import fuse_decoder_layers
from dllm.runner.input_registry import InputRegistry
from dllm.runner.memory import MambaStatePool, ReqToTokenPool, TokenToKVPool

logger = logging.getLogger(__name__)


class PostStep(Protocol):
    """Runs right after the forward on the device; must not synchronise with the host."""

    def __call__(self, forward_batch: ForwardBatch, hidden: torch.Tensor,
                 logits: torch.Tensor | None) -> Any: ...


@dataclass(frozen=True)
class StepSpec:
    """How one kind of step runs. ``post(batch)``: its device post-step (None: the output is
    the hidden states and logits). ``read(output)``: under the overlap schedule, start the
    copy of the part the scheduler's ``update`` reads (None: the kind is applied at once,
    never a step late). ``graph_key(batch)``: what a CUDA graph of the batch's post-step
    depends on besides the batch's shape (the rows' algorithm, the sampling flags, ...;
    None: no graph takes the batch); ``capture(bs, key)``: the post-step a graph of ``bs``
    rows captures for that key."""

    post: Callable[[ScheduledBatch], PostStep | None]
    read: Callable[[Any], Any] | None = None
    capture: Callable[[int, Hashable], PostStep] | None = None
    graph_key: Callable[[ScheduledBatch], Hashable | None] | None = None


@dataclass(frozen=True)
class RunnerConfig:
    """What a runner is built from (the engine derives it from its config and the checkpoint).
    ``block_size``: the tokens a request reserves at a time; ``graph_kind`` the step kind
    captured in CUDA graphs (None: none): at start for ``graph_keys`` (``StepSpec.graph_key``
    values: the engine's algorithm, greedy and sampling) and rows of ``graph_windows`` tokens
    (denoise steps: the block size), other windows on first use up to ``graph_lazy_tokens``
    tokens a graph (``dllm.runner.cuda_graph``)."""

    model_path: str
    device: torch.device
    dtype: torch.dtype
    load_format: str
    seed: int
    attention_backend: str
    page_size: int
    num_kv_pages: int | None
    kv_cache_memory_gb: float | None
    max_running_requests: int
    max_prefill_tokens: int
    context_length: int
    block_size: int
    graph_kind: StepKind | None = None
    graph_keys: tuple[Hashable, ...] = ()
    graph_windows: tuple[int, ...] = ()
    graph_lazy_tokens: int = 0
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # The most forward rows one request takes in a step: 2 where block diffusion runs a merged
    # commit as two whole-block rows (``dllm.block_diffusion``) and for full-attention
    # diffusion (a CFG request's unconditional twin), else 1.
    rows_per_request: int = 1
    tp_rank: int = 0  # this rank among the tensor-parallel ranks (``dllm.models.parallel``)
    tp_size: int = 1
    ep_size: int = 1  # expert-parallel sets among the tp ranks (``TensorParallel.ep``)
    # Data-parallel attention (``DataParallel``): ``dp_size`` = ``tp_size`` ranks, each with
    # its own requests, attention and KV; the MLP / MoE layers split over all of them.
    # ``cpu_group``: the Gloo group the per-forward token counts cross (None: the default).
    dp_size: int = 1
    cpu_group: Any = None
    cp_rank: int = 0  # this rank among the context-parallel ranks (``context_parallel``)
    cp_size: int = 1
    # Hybrid models: recurrent-state slots per running request (the committed slot, and with
    # the prefix cache its track slots and room for the cache's snapshots).
    state_slots_per_request: int = 1


class Runner(ABC):
    """The interface shared by ``EagerRunner`` and ``CudaGraphRunner``. ``name``: how its
    forwards run, ``"cuda_graph"`` (a graph replayed) or ``"eager"``."""

    name = "eager"

    @abstractmethod
    def can_run(self, batch: ScheduledBatch) -> bool: ...

    @abstractmethod
    def load_batch(self, batch: ScheduledBatch) -> ForwardBatch: ...

    @abstractmethod
    def execute(self, forward_batch: ForwardBatch, post: PostStep | None) -> Any: ...


class ModelRunner:
    """Owns the model, the memory pools, the attention backend and the runners of one rank.
    ``register_inputs(registry)`` declares the post-steps' per-row inputs. ``forward_counts``
    counts the forwards launched, by ``(Runner.name, StepKind)`` (not a data-parallel rank's
    ``IDLE`` ones, nor one that raised): e.g. the denoise steps that fell back to the eager
    runner because no graph took their shape."""

    def __init__(self, config: RunnerConfig, steps: dict[StepKind, StepSpec],
                 register_inputs: Callable[[InputRegistry], None]):
        self.config = config
        self.steps = steps
        self.device = config.device
        torch.manual_seed(config.seed)
        mlp_tp = TensorParallel(config.tp_rank, config.tp_size, ep=config.ep_size)
        if config.dp_size > 1:  # attention replicated, MLPs over every rank
            set_tensor_parallel(TensorParallel())
            set_data_parallel(DataParallel(config.tp_rank, config.dp_size, mlp_tp,
                                           config.cpu_group))
        else:
            set_tensor_parallel(mlp_tp)
            set_data_parallel(DataParallel())
        self.dp = data_parallel()
        self.context_parallel = ContextParallel(config.cp_rank, config.cp_size)
        self.model, _, _ = load_model(config.model_path, dtype=config.dtype, device=self.device,
                                      load_format=config.load_format, seed=config.seed)
        self.model.eval()
        self._init_memory()
        self.req_to_token = self.req_pool.req_to_token
        self._install_ops()
        self.backend = make_backend(config.attention_backend, self.device, config.page_size,
                                    config.dtype)
        rows = config.max_running_requests * config.rows_per_request
        self.registry = InputRegistry(
            rows, max(config.max_prefill_tokens, rows * config.block_size), self.device)
        register_inputs(self.registry)
        self.eager = EagerRunner(self)
        self.runners: list[Runner] = [self.eager]
        self.forward_counts: Counter[tuple[str, StepKind]] = Counter()

    # ---- setup -------------------------------------------------------------------------
    def _init_memory(self) -> None:
        cfg = self.config
        spec = self.model.kv_cache_spec()
        page = cfg.page_size
        # A request's reservation is rounded up to a whole block.
        max_context = -(-cfg.context_length // cfg.block_size) * cfg.block_size
        itemsize = cfg.dtype.itemsize
        per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize
        want = cfg.max_running_requests * -(-max_context // page) + 1
        if cfg.num_kv_pages is not None:
            pages = cfg.num_kv_pages + 1
            self._init_state_pool(None)
        else:
            budget_gb = cfg.kv_cache_memory_gb
            if budget_gb is None:
                budget_gb = self._default_kv_budget_gb()
            budget = budget_gb * 2**30 - self._init_state_pool(budget_gb * 2**30)
            pages = (min(want, int(budget // (per_token * page)) + 1) if per_token
                     else want)  # no attention layer (Mamba2): pages only count tokens
        if cfg.tp_size * cfg.cp_size > 1:  # every rank's scheduler must see the same pool
            agreed = torch.tensor([pages], device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            pages = int(agreed.item())
        self.req_pool = ReqToTokenPool(cfg.max_running_requests, max_context, self.device)
        self.kv_pool = TokenToKVPool(pages, page, spec.num_layers, spec.num_kv_heads,
                                     spec.head_dim, cfg.dtype, self.device)
        logger.info("KV cache: %d pages of %d tokens (%.1f MiB)", pages - 1, page,
                    self.kv_pool.memory_bytes() / 2**20)

    def _init_state_pool(self, budget: float | None) -> int:
        """The recurrent-state pool of a hybrid model (None otherwise):
        ``state_slots_per_request`` slots per running request, out of the same memory budget as the KV cache (``budget`` bytes; None: the
        KV pages are fixed, the slots are not limited). The slots take at most half the
        budget; fewer slots than ``max_running_requests`` then bound the running requests
        (admission waits for a free slot). Returns the bytes the pool holds. Under tensor
        parallelism each rank's slots hold its own heads' state (``state_spec``), and the
        ranks agree on the smallest slot count (a rank holding more B/C groups has bigger
        slots), so every scheduler sees the same pool."""
        spec_of = getattr(self.model, "state_spec", None)
        self.state_pool = None
        if spec_of is None:
            return 0
        if self.config.dp_size > 1:  # its mixers would run replicated, untested
            raise NotImplementedError("data-parallel attention (--dp) over hybrid Mamba2 models "
                                      "is not built yet; use --tp")
        spec, cfg = spec_of(), self.config
        dims = spec.dims
        conv, ssm = dims.conv_state_shape(1)[1:], dims.ssm_state_shape(1)[1:]
        per_slot = MambaStatePool.bytes_per_slot(spec.num_layers, conv, ssm, cfg.dtype,
                                                 spec.ssm_dtype)
        slots = cfg.max_running_requests * cfg.state_slots_per_request
        if budget is not None and per_slot:
            slots = min(slots, int(budget / 2 // per_slot))
            if slots < 1:
                raise ValueError(f"the memory budget ({budget / 2**30:.2f} GiB) is too small for "
                                 f"one recurrent-state slot ({per_slot / 2**20:.1f} MiB, at most "
                                 "half the budget)")
        if cfg.tp_size > 1:
            agreed = torch.tensor([slots], device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            slots = int(agreed.item())
        self.state_pool = MambaStatePool(slots, spec.num_layers, conv, ssm, cfg.dtype,
                                         spec.ssm_dtype, self.device)
        logger.info("state pool: %d slots of %.2f MiB (%.1f MiB)", slots, per_slot / 2**20,
                    self.state_pool.memory_bytes() / 2**20)
        return self.state_pool.memory_bytes()

    def _default_kv_budget_gb(self) -> float:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return 0.8 * free / 2**30
        return 2.0

    def _flashinfer(self) -> bool:
        return (self.device.type == "cuda"
                and resolve_backend_name(self.config.attention_backend, self.device,
                                         self.config.dtype) == "flashinfer")

    def _install_ops(self) -> None:
        """FlashInfer's fused norm/activation/RoPE kernels where its attention runs (CUDA),
        with the Triton kernels of ``TritonOps`` where Triton is installed; the plain-PyTorch
        reference ops elsewhere. With ``TritonOps`` the decoder layers become
        ``FusedDecoderLayer`` s, whose projections take the residual steps along."""
        if self._flashinfer():
            from dllm.runner.layer_ops import FlashInferOps, TritonOps

            ops = TritonOps if triton_available() else FlashInferOps
            install_ops(self.model, ops(self.model, self.req_pool.max_context, self.device))
            if ops is TritonOps:  # its GEMMs take the residual steps along
                fuse_decoder_layers(self.model)
        elif self.device.type == "cuda":
            # No FlashInfer kernels (float32, or attention_backend 'sdpa'): the reference ops,
            # with fla-core's scan for a hybrid's long rows where it is installed.
            from dllm.runner.kernels.settings import KernelSettings
            from dllm.runner.kernels.ssm_scan import FlaScanOps

            fla = FlaScanOps(self.model, KernelSettings.from_env().fla_scan)
            if fla.fla_scan:
                install_ops(self.model, fla)

    def capture_cuda_graphs(self) -> None:
        """Capture the ``graph_kind`` steps (denoise, full-attention or decode) on CUDA with
        FlashInfer; everything else, and every shape not captured, runs eagerly. With
        ``disable_cuda_graph`` those steps still run padded to the capture sizes and planned
        as a graph would be, without capture (so eager and graph outputs are identical).
        Called by the owner once the post-steps can run (they may read the model through
        it: a full-attention step's LM head)."""
        cfg, kind = self.config, self.config.graph_kind
        if (kind is None or not self._flashinfer() or cfg.dp_size > 1  # host count exchange
                or not getattr(self.model, "supports_cuda_graph", True)):
            return
        from dllm.runner.cuda_graph import CudaGraphRunner, capture_sizes

        spec = self.steps[kind]
        # Rows, not requests: a merged commit, or a CFG twin, takes a second row.
        max_rows = cfg.max_running_requests * (cfg.rows_per_request if kind is not StepKind.SAMPLE
                                               else 1)
        max_bs = min(cfg.cuda_graph_max_bs or max_rows, max_rows, 256)
        sizes = ([s for s in cfg.cuda_graph_batch_sizes if s <= max_rows]
                 if cfg.cuda_graph_batch_sizes else capture_sizes(max_bs))
        if cfg.cuda_graph_batch_sizes and len(sizes) < len(cfg.cuda_graph_batch_sizes):
            logger.warning("CUDA graphs: batch sizes above %d rows (max_running_requests=%d) "
                           "are not captured (asked for %s)", max_rows,
                           cfg.max_running_requests, list(cfg.cuda_graph_batch_sizes))
        if not sizes or spec.capture is None or spec.graph_key is None:
            return
        graphs = CudaGraphRunner(
            self, kind, sizes, self.req_pool.max_context, cfg.page_size, spec.capture,
            spec.graph_key, cfg.graph_windows, cfg.graph_lazy_tokens,
            capture=not cfg.disable_cuda_graph)
        graphs.capture_all(list(cfg.graph_keys))
        self.add_runner(graphs)

    def add_runner(self, runner: Runner) -> None:
        """Put a faster runner (e.g. CUDA graphs) in front of the eager fallback."""
        self.runners.insert(0, runner)

    # ---- one step ----------------------------------------------------------------------
    def post_for(self, batch: ScheduledBatch) -> PostStep | None:
        return self.steps[batch.kind].post(batch)

    def overlappable(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch``'s result may be applied a step late (overlap schedule)."""
        return self.steps[batch.kind].read is not None

    def read(self, batch: ScheduledBatch, output: Any) -> Any:
        """Start the host copy of what the scheduler reads of ``output``."""
        return self.steps[batch.kind].read(output)

    @torch.no_grad()
    def forward(self, batch: ScheduledBatch, post: PostStep | None = None) -> Any:
        """Run ``batch`` and its post-step (``post``, else the one of its kind)."""
        post = post if post is not None else self.post_for(batch)
        if (self.state_pool is not None and batch.mode is not ForwardMode.IDLE
                and len(batch.state_read_slots) != batch.batch_size):
            raise ValueError("a batch of a hybrid model needs the state slots of every row")
        runner = next(r for r in self.runners if r.can_run(batch))
        if self.dp.size == 1:
            out = runner.execute(runner.load_batch(batch), post)
        else:
            self.dp.begin()
            try:
                out = runner.execute(runner.load_batch(batch), post)
            except Exception:
                self.join_peers()  # a failed forward: its peers' collectives still line up
                raise
        if batch.mode is not ForwardMode.IDLE:  # launched (a failed one is not counted)
            self.forward_counts[runner.name, batch.kind] += 1
        return out

    def join_peers(self) -> None:
        """Data-parallel attention: take part, with zero rows, in the collectives the peers
        still run in this forward — the count exchange if this rank has not reached it, then
        the MLPs of the layers it has not run. An ``IDLE`` forward is all of it; a forward
        that failed part way is the rest of it, so every rank's next collective is the same
        one (a failure inside one MLP, between its gather and its all-reduce, cannot be lined
        up so)."""
        dp = self.dp
        if dp.stage == "done":
            return
        if dp.stage == "started":
            dp.exchange(0)
        layers = [m for m in self.model.modules() if isinstance(m, DecoderLayer)]
        for layer in layers[dp.layers_done:]:
            layer.idle(self.model.attn_spec.hidden_size, self.config.dtype, self.device)
        dp.close()

    def run_idle(self) -> None:
        """An ``IDLE`` forward: under data-parallel attention, zero rows through every layer's
        MLP collectives (the peers' rows still pass through this rank's experts); else
        nothing."""
        if self.dp.size > 1:
            self.dp.begin()
            self.join_peers()

    def run_model(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states ``[T, H]`` and the logits the batch asks for. Under context
        parallelism an ``EXTEND`` (not a hybrid's: its Mamba layers run unsplit) is split
        over the ranks, and its hidden states gathered before the LM head."""
        if self.context_parallel.splits(fb.mode) and self.state_pool is None:
            hidden = self.context_parallel.forward(self.model, fb)
        else:
            fb.attn_backend.prepare(fb)
            fb.memo.clear()
            self.dp.exchange(int(fb.input_ids.shape[0]))
            hidden = self.model(fb.input_ids, fb.positions, fb)
            self.dp.close()
        if fb.logits_mode is LogitsMode.NONE:
            return hidden, None
        if fb.logits_mode is LogitsMode.LAST:
            return hidden, self.model.compute_logits(hidden[fb.last_token_index])
        if fb.logits_mode is LogitsMode.BLOCK:
            return hidden, self.model.compute_logits(hidden[fb.block_token_index])
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
        fb.state_pool = o.state_pool
        return fb

    def execute(self, forward_batch: ForwardBatch, post: PostStep | None) -> Any:
        """Dispatch on the mode. ``DECODE``, ``EXTEND`` and ``DLLM_EXTEND`` share one path
        (their differences live in the batch's mask, lengths and logits mode);
        ``IDLE`` computes nothing and writes nothing to the KV pool — a data-parallel rank
        would still join its peers' collectives there."""
        fb = forward_batch
        if fb.mode is ForwardMode.IDLE:
            self.owner.run_idle()
            return None
        hidden, logits = self.owner.run_model(fb)
        return post(fb, hidden, logits) if post is not None else (hidden, logits)
