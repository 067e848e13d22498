"""What the library returns: one ``RequestOutput`` per prompt, ``StreamChunk`` per committed
block when streaming."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dllm.trace import StepEvent, TokenLogprob

if TYPE_CHECKING:
    from dllm.request import Req


@dataclass
class RequestOutput:
    rid: str
    text: str
    token_ids: list[int]  # generated ids (a stop token id that ended the output included)
    finish_reason: str | None  # "stop", "length", "abort" (or "error")
    prompt_tokens: int
    num_forward_passes: int  # model forwards this request took part in
    num_denoise_forwards: int = 0
    # block diffusion: forwards that only committed a block (the merged commit runs inside
    # the next block's first denoise step and adds none)
    num_commit_forwards: int = 0
    num_blocks: int = 0
    error: str | None = None
    prompt_token_ids: list[int] | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not prefilled)
    # ``SamplingParams.logprobs``: one per token of ``token_ids`` (``dllm.trace``)
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, req: Req, text: str) -> RequestOutput:
        """A request's output so far (``text``: its detokenised output)."""
        return cls(
            rid=req.rid, text=text, token_ids=list(req.output_ids),
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            prompt_tokens=req.prompt_len, num_forward_passes=req.num_forward_passes,
            num_denoise_forwards=req.num_denoise_forwards,
            num_commit_forwards=req.num_commit_forwards, num_blocks=req.num_blocks_committed,
            error=req.error, prompt_token_ids=list(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            logprobs=(list(req.trace.logprobs) if req.trace is not None
                      and req.trace.top is not None else None))

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_forward(self) -> float:
        return self.completion_tokens / max(self.num_forward_passes, 1)


@dataclass
class StreamChunk:
    rid: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    output: RequestOutput | None = None  # set on the last chunk
    # ``SamplingParams.denoise_steps``: the denoise steps since the last chunk, in order
    steps: list[StepEvent] = field(default_factory=list)
    # ``SamplingParams.logprobs``: one per id of ``delta_token_ids``
    delta_logprobs: list[TokenLogprob] | None = None


@dataclass
class EmbeddingOutput:
    rid: str
    embedding: list[float]
    prompt_tokens: int

    @classmethod
    def of(cls, req: Req) -> EmbeddingOutput:
        if req.embed.embedding is None:
            raise RuntimeError(f"request {req.rid} ended without an embedding: "
                               f"{req.error or req.finish_reason}")
        return cls(req.rid, req.embed.embedding, req.prompt_len)
