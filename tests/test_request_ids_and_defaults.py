"""Request ids in flight stay unique without harming the running request, and the server's
default ``max_tokens`` is fitted before a full-attention request is laid out."""

from __future__ import annotations

import asyncio

import pytest

from dllm import AsyncLLM, SamplingParams
from dllm.engine import Engine
from dllm.server.serving import DEFAULT_MAX_TOKENS, Serving
from dllm.testing import make_tiny_checkpoint


def test_duplicate_request_id_is_refused_and_the_first_completes(sdar_dir):
    llm = AsyncLLM(engine=Engine(model=sdar_dir, max_running_requests=4))
    first_params = SamplingParams(max_new_tokens=40, ignore_eos=True)

    async def main():
        first = asyncio.ensure_future(llm.generate([5, 6, 7], first_params, rid="x"))
        await asyncio.sleep(0)  # let the first request reach the engine
        while llm.num_streams == 0:
            await asyncio.sleep(0.001)
        with pytest.raises(ValueError, match="already in use"):
            await llm.generate([8, 9], SamplingParams(max_new_tokens=4), rid="x")
        return await asyncio.wait_for(first, timeout=60)

    try:
        out = asyncio.run(main())
    finally:
        llm.shutdown()
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    llm.engine.check_memory()


def test_server_default_max_tokens_is_known_before_the_layout(tmp_path):
    path = make_tiny_checkpoint("LLaDAModelLM", tmp_path, seed=0,
                                max_sequence_length=512)
    llm = AsyncLLM(engine=Engine(model=str(path), max_running_requests=2))
    serving = Serving(llm)

    async def main():
        params = serving.sampling_params({}, "max_tokens")
        return await serving.make("g1", ["hello world"], params, explicit_max=False)

    try:
        (req,) = asyncio.run(main())
    finally:
        llm.shutdown()
    assert req.params.max_new_tokens == DEFAULT_MAX_TOKENS
    assert req.block_size == 32  # LLaDA's default block, not a block of one token
    assert req.denoise.algo_config["steps_per_block"] == 32


def test_every_tokenizer_thread_holds_its_copy_before_the_first_request(tmp_path):
    """The tokenizer pool's threads copy the tokenizer at start-up, each its own (a deep
    copy of a large vocabulary is not done on a request's time), none the engine's."""
    import threading

    path = make_tiny_checkpoint("SDARForCausalLM", tmp_path, seed=0)
    llm = AsyncLLM(engine=Engine(model=str(path), max_running_requests=2))
    try:
        serving = Serving(llm)
        for f in serving._primed:
            f.result(timeout=60)
        n = serving.limits.tokenizer_workers
        barrier = threading.Barrier(n)

        def held() -> tuple[int, int]:  # every thread at once: each answers for itself
            tok = getattr(serving._local, "tokenizer", None)
            barrier.wait(timeout=60)
            return threading.get_ident(), id(tok) if tok is not None else 0

        answers = [f.result(timeout=60) for f in [serving._pool.submit(held) for _ in range(n)]]
        assert len({t for t, _ in answers}) == n  # n threads
        copies = {c for _, c in answers}
        assert 0 not in copies and len(copies) == n and id(llm.engine.tokenizer) not in copies
        serving.close()
    finally:
        llm.shutdown()


def test_cuda_graph_batch_sizes_flag_and_validation():
    """``--cuda-graph-bs`` reaches the engine config sorted and without repeats; a size that
    is not a positive integer is refused with a clear error."""
    from dllm.cli_args import engine_config_from_args
    from dllm.config import EngineConfig
    from dllm.server.cli import build_parser

    args = build_parser().parse_args(["serve", "--cuda-graph-bs", "8", "1", "4", "4"])
    assert engine_config_from_args(args).cuda_graph_batch_sizes == (1, 4, 8)
    assert engine_config_from_args(build_parser().parse_args(["serve"])).cuda_graph_batch_sizes \
        is None
    for bad in ((), (0, 2), (1, True), (2.5,)):
        with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
            EngineConfig(cuda_graph_batch_sizes=bad)
