"""Request state: plain data with derived values as properties (DESIGN §12)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm.sampling_params import SamplingParams
from dllm.trace import ReqTrace


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no memory
    RUNNING = "running"  # admitted: holds a request slot and its KV pages
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class BlockState:
    """The block a block-diffusion request is denoising. Host lists: the scheduler reads the
    step result once per step anyway, so keeping them here costs no extra device sync."""

    start: int  # cache index (absolute position) of the block's first token
    tokens: list[int]
    editable: list[bool]  # False at prompt positions inside the block
    num_initial_masks: int
    step: int = 0  # denoise forwards launched on this block
    resolved: bool = False  # all masks filled: the next forward is the commit forward
    # Overlapped scheduling: the forward after the resolving one was launched before the
    # host read that the block resolved; it was the commit forward.
    commit_launched: bool = False
    # The output row of the last forward launched on this block, ``(tokens, row)`` on the
    # device: the next step's input tokens while its result is in flight.
    carry: tuple[torch.Tensor, int] | None = None
    # Hybrid models: that output row's done flag, a 0-d int64 device tensor; the next
    # forward on this block is its commit forward, writing the committed state, exactly when
    # it is 1 (``ScheduledBatch.state_write_gate``).
    carry_done: torch.Tensor | None = None
    # Per-row algorithm state kept on the device between steps (0-d tensors).
    algo_state: dict[str, torch.Tensor] = field(default_factory=dict)
    transfers: int = 0  # mask→token transfers so far (metrics)
    # Full-attention diffusion under the overlap schedule: the block before this one, started
    # while the step that ends it was in flight; its tokens come from that step's output on
    # the device (``carry``) until the host reads them (then None).
    prev: BlockState | None = None


@dataclass
class DenoiseState:
    """A diffusion request's own state (block diffusion: SDAR, LLaDA2, Fast-dLLM v2): its
    unmasking algorithm and validated settings, and the block it is denoising."""

    algorithm: str
    algo_config: dict[str, Any]
    block: BlockState | None = None

    def drop_inflight(self) -> None:
        self.block = None


@dataclass
class FullAttentionState(DenoiseState):
    """Full-attention diffusion (LLaDA, Dream; ``dllm.full_diffusion``): the canvas is the
    prompt and ``max_new_tokens`` masks; the request's ``block_size`` is its own (blocks start
    at the prompt end)."""

    cache_mode: str = "exact"  # "exact" | "prefix" | "dual"
    cfg_scale: float = 0.0  # > 0: an unconditional twin sequence runs beside the request
    cfg_pool_idx: int | None = None  # the twin's request slot (its pages are in kv_pages)


@dataclass
class AutoregressiveState:
    # ``(tokens, row)`` on the device: the token the in-flight forward samples.
    carry: tuple[torch.Tensor, int] | None = None

    def drop_inflight(self) -> None:
        self.carry = None


@dataclass
class EmbeddingState:
    """An embedding request: its options, the running pooled sums across prefill chunks, and
    the result. It generates nothing."""

    normalize: bool | None = None
    dimensions: int | None = None
    pool_state: dict[str, Any] = field(default_factory=dict)
    embedding: list[float] | None = None

    def drop_inflight(self) -> None:
        self.pool_state = {}


KindState = DenoiseState | FullAttentionState | AutoregressiveState | EmbeddingState


@dataclass
class Req:
    """What every request has (identity, prompt, settings, memory, progress, output), and in
    ``state`` what its kind of generation keeps (``DenoiseState``, ``FullAttentionState``,
    ``AutoregressiveState``, ``EmbeddingState``); the typed views ``denoise``, ``full``,
    ``ar`` and ``embed`` read it."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    state: KindState
    block_size: int  # tokens per block: the KV reservation's grain (1 when autoregressive)
    arrival: int = 0  # engine step at which it was added
    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    stop_matched: str | int | None = None
    # Memory (while RUNNING).
    req_pool_idx: int | None = None
    kv_pages: list[int] = field(default_factory=list)
    # Hybrid models: the request's committed recurrent-state slot (``MambaStatePool``).
    state_slot: int | None = None
    # Prefix cache (``dllm.prefix_cache``): the deepest tree node the request locks, the pages
    # of ``kv_pages`` the tree owns (never freed by the request), and the prompt tokens its
    # admission found cached (not prefilled).
    prefix_node: Any = field(default=None, repr=False)
    tree_pages: set[int] = field(default_factory=set, repr=False)
    cached_tokens: int = 0
    # Hybrid models with the prefix cache: the track slots a forward ending on the track grid
    # writes its state into (the extra buffers), and those a launched forward is writing.
    track_slots: list[int] = field(default_factory=list)
    track_busy: set[int] = field(default_factory=set, repr=False)
    # Progress.
    prefilled_len: int = 0  # prompt tokens whose KV is cached (or queued to be: stream order)
    # Forwards launched for this request whose result the host has not applied yet (at most
    # one per step; overlapped scheduling applies a step's results after the next is queued).
    inflight: int = 0
    num_forward_passes: int = 0
    num_denoise_forwards: int = 0
    num_commit_forwards: int = 0  # forwards that only committed a block (no denoise step)
    num_merged_commits: int = 0  # commits run inside the next block's first denoise step
    num_blocks_committed: int = 0
    # Per-row numbers of its sampling and algorithm settings (``dllm.denoise``), computed at
    # the first step: they never change while the request runs.
    row_settings: dict[str, float | int] | None = field(default=None, repr=False)
    # The output's text, decoded incrementally (``StopChecker.text_of``): shared by the
    # stop-string search and streaming.
    text: Any = field(default=None, repr=False)
    # Requests that asked for step events or log-probabilities (``dllm.trace``).
    trace: ReqTrace | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.trace is None and self.params.traced:
            self.trace = ReqTrace(self.params.denoise_steps, self.params.logprobs)

    def _view(self, kind: type) -> Any:
        if not isinstance(self.state, kind):
            raise TypeError(f"request {self.rid!r} is a {type(self.state).__name__} request, "
                            f"not a {kind.__name__} one")
        return self.state

    @property
    def denoise(self) -> DenoiseState:
        return self._view(DenoiseState)

    @property
    def full(self) -> FullAttentionState:
        return self._view(FullAttentionState)

    @property
    def ar(self) -> AutoregressiveState:
        return self._view(AutoregressiveState)

    @property
    def embed(self) -> EmbeddingState:
        return self._view(EmbeddingState)

    @property
    def is_full_attention(self) -> bool:
        return isinstance(self.state, FullAttentionState)

    @property
    def is_embedding(self) -> bool:
        return isinstance(self.state, EmbeddingState)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def canvas_len(self) -> int:
        """Full-attention requests: prompt + ``max_new_tokens``, the sequence every step sees."""
        return self.prompt_len + self.params.max_new_tokens

    @property
    def prefill_target(self) -> int:
        """Prompt tokens prefilled in ``EXTEND``: the full prompt blocks (DESIGN §4). None for
        full-attention requests: each of their steps (or block starts) recomputes the prompt."""
        if self.is_full_attention:
            return 0
        return (self.prompt_len // self.block_size) * self.block_size

    @property
    def needs_prefill(self) -> bool:
        return self.prefilled_len < self.prefill_target

    @property
    def reserved_len(self) -> int:
        """Tokens of KV this request may ever write: the prompt and every block that can hold
        part of its output, rounded up to a whole block; a full-attention request reserves
        exactly its canvas (its twin for CFG reserves as much again)."""
        if self.is_full_attention:
            return self.canvas_len
        if self.is_embedding:
            return self.prompt_len
        end = self.prompt_len + self.params.max_new_tokens
        return -(-end // self.block_size) * self.block_size

    @property
    def committed_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED
