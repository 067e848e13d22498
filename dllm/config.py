"""Engine configuration: one frozen dataclass, validated once, never mutated (DESIGN §12)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

ATTENTION_BACKENDS = ("auto", "sdpa", "flashinfer")
TASKS = ("auto", "generate", "embed")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16, "half": torch.float16, "float": torch.float32}


@dataclass(frozen=True)
class EngineConfig:
    """Engine arguments (the ``LLM(**engine_args)`` / ``dllm serve`` flags).

    model: a local checkpoint directory (``None``: the built-in model, when shipped).
    algorithm / algorithm_config: the default unmasking algorithm and its settings; a
        request's ``dllm`` dict overrides them.
    block_size / mask_token_id: override the checkpoint's values (DESIGN §4 resolution order).
    max_running_requests: requests admitted at once (rows of a denoise batch).
    page_size / num_kv_pages: the paged KV cache; ``num_kv_pages=None`` sizes the pool from
        ``kv_cache_memory_gb`` (or enough for every admitted request at full context, if less).
    max_prefill_tokens: token budget of one prefill forward; longer prompts are chunked.
    context_length: longest prompt + output; defaults to the model's.
    load_format: ``safetensors``, or ``dummy`` (random weights of the checkpoint's shapes, for
        benchmarks).
    disable_cuda_graph / cuda_graph_max_bs: CUDA graphs (GPU with FlashInfer) capture denoise
        and decode steps for batch sizes (rows: a merged commit takes two) up to
        ``cuda_graph_max_bs`` (default: the rows the running cap can fill -- twice the cap for
        block diffusion with merged commits -- at most 256), at bucketed sizes (a live batch
        is padded to the next one);
        ``cuda_graph_batch_sizes`` names the sizes instead (every size from 1 to N: no padding).
        With graphs disabled those steps run eagerly at the same padded sizes and plans, so
        both give the same tokens.
    overlap_schedule: queue each denoise/decode step before reading the previous step's
        result, so host work overlaps the device (the same outputs; ``None``: on CUDA only,
        where the forward runs asynchronously).
    merged_commit: block diffusion runs a resolved block's commit forward (the forward over
        its final tokens that writes their KV, and a hybrid's committed state) in the same
        forward as the next block's first denoise step: two whole-block rows of the request
        (the final tokens, then the next block attending to their KV of the same layer), or
        for a hybrid one row of 2·block_size tokens whose state is split after the first
        block. One forward fewer per block, the same tokens. Not for shifted-logits models
        (Fast-dLLM v2 reads the next block's first token from its commit pass) or algorithms
        that edit a filled block (``joint_threshold``); False: always a separate commit
        forward. ``None``: on, except for hybrids on CUDA (their merged row runs outside the
        CUDA graphs).
    task: ``generate``, ``embed`` (pooled embeddings), or ``auto`` (``embed`` for a
        sentence-transformers layout, else ``generate``).
    enable_prefix_cache: reuse the KV (and a hybrid's state) of prompt prefixes other
        requests left in the radix prefix cache (``dllm.prefix_cache``); on for the models
        where reuse is exact (autoregressive and block-diffusion models, hybrids included),
        never for full-attention dLLMs (LLaDA, Dream) or embeddings.
    state_track_interval: hybrid models with the prefix cache snapshot their recurrent state
        at every multiple of ``lcm(block size, page size, state_track_interval)`` tokens a
        forward ends on (the only points a cached prefix of a hybrid can end).
    """

    # Each field is also a command-line flag (``dllm.cli_args``): ``--field-name`` unless
    # ``flag`` names it, its type read from the annotation, its default from here, and
    # ``help``/``choices`` from the metadata; a bool field is a switch storing ``const``
    # (default ``True``).
    model: str | None = field(default=None, metadata={
        "help": "local checkpoint directory (default: the built-in model)"})
    algorithm: str | None = field(default=None, metadata={
        "help": "default unmasking algorithm (e.g. low_confidence_dynamic, threshold)"})
    algorithm_config: dict[str, Any] = field(default_factory=dict, metadata={
        "help": 'algorithm settings as JSON, e.g. \'{"threshold": 0.9}\''})
    block_size: int | None = field(default=None, metadata={
        "help": "override the checkpoint's block size"})
    mask_token_id: int | None = field(default=None, metadata={
        "help": "override the checkpoint's mask token id"})
    max_running_requests: int = field(default=64, metadata={
        "help": "requests admitted at once (rows of a denoise batch)"})
    page_size: int = field(default=16, metadata={"help": "tokens per KV-cache page"})
    num_kv_pages: int | None = field(default=None, metadata={
        "help": "KV-cache pages (default: as many as --kv-cache-memory-gb holds, or enough "
                "for every admitted request at full context, if less)"})
    kv_cache_memory_gb: float | None = field(default=None, metadata={
        "help": "KV-cache budget in GiB when --num-kv-pages is not given"})
    max_prefill_tokens: int = field(default=4096, metadata={
        "help": "token budget of one prefill forward; longer prompts are chunked"})
    context_length: int | None = field(default=None, metadata={
        "aliases": ("--max-model-len",),
        "help": "longest prompt + output (default: the model's)"})
    dtype: str = field(default="auto", metadata={
        "choices": sorted(DTYPES), "help": "auto: bfloat16 on CUDA, float32 elsewhere (half: "
                                           "float16, float: float32)"})
    device: str = field(default="auto", metadata={
        "help": "auto (CUDA when there is a GPU, else the CPU), cpu, cuda, cuda:N"})
    attention_backend: str = field(default="auto", metadata={
        "choices": ATTENTION_BACKENDS,
        "help": "auto: FlashInfer on CUDA when it is installed, else SDPA"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer directory (default: --model)"})
    task: str = field(default="auto", metadata={
        "choices": TASKS, "help": "embed: pooled embeddings; auto: embed for a "
                                  "sentence-transformers layout, else generate"})
    load_format: str = field(default="safetensors", metadata={
        "choices": ("safetensors", "dummy"),
        "help": "dummy: random weights of the checkpoint's shapes, for benchmarks"})
    disable_cuda_graph: bool = field(default=False, metadata={
        "help": "capture no CUDA graphs (the steps run eagerly, to the same tokens)"})
    cuda_graph_max_bs: int | None = field(default=None, metadata={
        "help": "largest batch size captured, in rows (default: --max-running-requests, "
                "twice that for block diffusion with merged commits, at most 256)"})
    cuda_graph_batch_sizes: tuple[int, ...] | None = field(default=None, metadata={
        "flag": "--cuda-graph-bs",
        "help": "the batch sizes to capture (default: buckets 1, 2, 4, 8, 12, 16, 24, 32, … "
                "up to --cuda-graph-max-bs)"})
    served_model_name: tuple[str, ...] | None = field(default=None, metadata={
        "help": "the model name(s) the API answers to; the first is the one it reports "
                "(default: the checkpoint folder's name)"})
    chat_template: str | None = field(default=None, metadata={
        "help": "a chat template (Jinja) file, or the template itself, used instead of the "
                "checkpoint's (so a checkpoint without one can chat)"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "accepted for vLLM compatibility and not needed: dllm runs no code from "
                "checkpoints (every architecture is implemented here)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "aliases": ("--tp", "--tp-size"),
        "help": "ranks that split every layer (one process each; CPU ranks talk over Gloo, "
                "GPU ranks over NCCL, one GPU each)"})
    expert_parallel_size: int = field(default=1, metadata={
        "aliases": ("--ep", "--ep-size"),
        "help": "sets the MoE experts split into (each of the --tp ranks holds E/ep whole "
                "experts, their intermediate size split over tp/ep ranks; one all-reduce per "
                "layer as with tensor parallelism); must divide --tp; dense models ignore it"})
    data_parallel_size: int = field(default=1, metadata={
        "aliases": ("--dp", "--dp-size"),
        "help": "data-parallel attention: ranks that each schedule their own requests (rank 0 "
                "hands each new one to the least loaded) and hold their own KV cache, with "
                "attention and LM head replicated; the MLP / MoE layers are split over all of "
                "them (as under --tp, experts by --ep), a rank with nothing to run joining them "
                "with an empty IDLE forward. --tp defaults to --dp and may only equal it"})
    context_parallel_size: int = field(default=1, metadata={
        "aliases": ("--cp", "--cp-size"),
        "help": "ranks that split each prompt prefill's tokens (zigzag; each rank attends "
                "its tokens to the all-gathered K/V and keeps the whole KV cache, denoise and "
                "decode steps run unsplit on every rank); not combined with --tp yet"})
    nnodes: int = field(default=1, metadata={
        "help": "hosts the tensor-parallel ranks span (each starts `dllm serve` with the same "
                "flags and its own --node-rank; --tp ranks are split evenly)"})
    node_rank: int = field(default=0, metadata={
        "help": "this host's index among --nnodes (0 serves; the others host their ranks)"})
    dist_init_addr: str | None = field(default=None, metadata={
        "help": "HOST:PORT of node 0 where the ranks meet (needed with --nnodes > 1; "
                "default: a free local port)"})
    overlap_schedule: bool | None = field(default=None, metadata={
        "flag": "--disable-overlap-schedule", "const": False,
        "help": "read each step's result before queueing the next (default on CUDA: the host "
                "builds the next step while the device runs this one)"})

    merged_commit: bool | None = field(default=None, metadata={
        "flag": "--disable-merged-commit", "const": False,
        "help": "block diffusion: run each block's commit forward as its own forward instead "
                "of inside the next block's first denoise step (one forward fewer per block, "
                "the same tokens; the default, except for hybrid models on CUDA)"})

    enable_prefix_cache: bool = field(default=True, metadata={
        "flag": "--disable-prefix-cache", "const": False,
        "help": "turn the radix prefix cache off (default on where reuse is exact: "
                "autoregressive and block-diffusion models, hybrids included; full-attention "
                "dLLMs never use it)"})
    state_track_interval: int = field(default=256, metadata={
        "help": "hybrid models with the prefix cache: snapshot the recurrent state at every "
                "multiple of lcm(block size, page size, this) tokens"})

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "page_size", "max_prefill_tokens",
                     "tensor_parallel_size", "expert_parallel_size", "data_parallel_size",
                     "context_parallel_size",
                     "nnodes",
                     "state_track_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("block_size", "num_kv_pages", "context_length", "mask_token_id",
                     "cuda_graph_max_bs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0
                                  or (v == 0 and name != "mask_token_id")):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.cuda_graph_batch_sizes is not None:
            sizes = tuple(self.cuda_graph_batch_sizes)
            if not sizes or any(not isinstance(v, int) or isinstance(v, bool) or v < 1
                                for v in sizes):
                raise ValueError("cuda_graph_batch_sizes must be positive integers, got "
                                 f"{self.cuda_graph_batch_sizes!r}")
            object.__setattr__(self, "cuda_graph_batch_sizes", tuple(sorted(set(sizes))))
        if self.data_parallel_size > 1 and self.context_parallel_size > 1:
            raise ValueError(f"context_parallel_size {self.context_parallel_size} with "
                             f"data_parallel_size {self.data_parallel_size}: context and data "
                             "parallelism are not combined yet; use one of them")
        if self.data_parallel_size > 1:
            if self.tensor_parallel_size == 1:  # --dp N alone: N ranks
                object.__setattr__(self, "tensor_parallel_size", self.data_parallel_size)
            elif self.tensor_parallel_size != self.data_parallel_size:
                raise ValueError(
                    f"data_parallel_size {self.data_parallel_size} needs tensor_parallel_size "
                    f"1 or {self.data_parallel_size}, got {self.tensor_parallel_size} (attention "
                    "split inside a data-parallel rank is not built)")
        if self.tensor_parallel_size % self.expert_parallel_size:
            raise ValueError(f"expert_parallel_size {self.expert_parallel_size} must divide "
                             f"tensor_parallel_size {self.tensor_parallel_size} (the experts "
                             "split over the tensor-parallel ranks)")
        if self.context_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(f"context_parallel_size {self.context_parallel_size} with "
                             f"tensor_parallel_size {self.tensor_parallel_size}: context and "
                             "tensor parallelism are not combined yet; use one of them")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks (tensor_parallel_size × "
                             f"context_parallel_size) do not split evenly over nnodes "
                             f"{self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (node 0's HOST:PORT) is needed with nnodes > 1")
        if isinstance(self.served_model_name, str):  # LLM(served_model_name="name")
            object.__setattr__(self, "served_model_name", (self.served_model_name,))
        if self.served_model_name is not None:
            names = tuple(self.served_model_name)
            if not names or any(not isinstance(n, str) or not n for n in names):
                raise ValueError("served_model_name must be one or more non-empty names, got "
                                 f"{self.served_model_name!r}")
            object.__setattr__(self, "served_model_name", names)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be safetensors or dummy, got {self.load_format!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if not isinstance(self.algorithm_config, dict):
            raise ValueError("algorithm_config must be a dict")
        # Frozen, but the dict inside could still be mutated by the caller: take a copy.
        object.__setattr__(self, "algorithm_config", dict(self.algorithm_config))

    @property
    def world_size(self) -> int:
        """The ranks (processes) of one engine."""
        return self.tensor_parallel_size * self.context_parallel_size

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def resolve_device(self) -> torch.device:
        """The device to run on; a ``ValueError`` naming ``--device`` when this machine has
        no such device (instead of a failure deep inside the first CUDA call)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"--device {self.device}: not a device name; use auto, cpu, "
                             "cuda or cuda:N") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                build = ("a CPU-only build" if torch.version.cuda is None
                         else f"built for CUDA {torch.version.cuda}, but no GPU is visible")
                raise ValueError(f"--device {self.device}: no CUDA device here (torch "
                                 f"{torch.__version__} is {build}); use --device cpu")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"--device {self.device}: this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                                 f"cuda:{torch.cuda.device_count() - 1}")
        elif device.type != "cpu":
            raise ValueError(f"--device {self.device}: dllm runs on CUDA GPUs and on the CPU "
                             f"only ({device.type} is not supported); use --device cpu")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        dtype = DTYPES[self.dtype]
        if dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return dtype
