"""The strongest oracle (DESIGN §11): generate one request at a time, recomputing the whole
sequence with an explicit attention mask at every denoise step, no KV cache, no batching.

It shares only the unmasking algorithms with the engine (those are tested on their own);
block layout, masks, caching, batching and stop rules here are written independently."""

from __future__ import annotations

import torch

from dllm.algorithms import get_algorithm
from dllm.algorithms.base import DenoiseInput, SamplingTensors
from dllm.algorithms.dream import dream_probs, dream_propose
from dllm.runner.attention.sdpa import SDPABackend
from dllm.runner.forward_batch import AttentionMask, ForwardBatch, ForwardMode, LogitsMode
from dllm.runner.memory import ReqToTokenPool, TokenToKVPool
from dllm.testing.harness import forward_full


def _sampling(temperature: float, top_k: int, top_p: float, seed: int) -> SamplingTensors:
    return SamplingTensors(
        temperature=torch.tensor([temperature], dtype=torch.float32),
        top_k=torch.tensor([top_k]),
        top_p=torch.tensor([top_p], dtype=torch.float32),
        seed=torch.tensor([seed]),
    )


def _denoise_block(model: torch.nn.Module, seq: list[int], *, block_size: int, mask_id: int,
                   algo, cfg: dict, sampling: SamplingTensors, shift: bool) -> list[int]:
    """Denoise the block holding the end of ``seq`` (its known tokens fixed, the rest masks)
    until the algorithm says done, recomputing the whole sequence block-causally at every
    step; ``shift``: position i reads the logits of position i-1 (position 0 its own).
    Returns the block's tokens."""
    b = block_size
    start = len(seq) // b * b
    fixed = len(seq) - start
    block = seq[start:] + [mask_id] * (b - fixed)
    editable = torch.tensor([[False] * fixed + [True] * (b - fixed)])
    state = {k: torch.zeros(1, dtype=torch.int64) for k in algo.state_keys}
    step = 0
    while True:
        logits = forward_full(model, seq[:start] + block, AttentionMask.BLOCK_CAUSAL, b)[start:]
        if shift:
            logits = torch.cat([logits[:1], logits[:-1]])
        res = algo.step(DenoiseInput(
            logits=logits[None], tokens=torch.tensor([block]), editable=editable,
            mask_id=mask_id, step=torch.tensor([step]),
            num_initial_masks=torch.tensor([b - fixed]),
            positions=torch.arange(start, start + b)[None], sampling=sampling,
            config=algo.stack_configs([cfg], torch.device("cpu")), state=state,
        ))
        block = res.tokens[0].tolist()
        state = res.state
        step += 1
        if bool(res.done[0]):
            break
    assert block[:fixed] == seq[start:], "a fixed position was changed"
    return block


def _emit(out: list[int], tokens: list[int], stop_ids: set[int], max_new_tokens: int) -> bool:
    """Append final tokens to ``out`` up to and including the first stop id or the
    ``max_new_tokens``-th token; True once the output has ended."""
    for t in tokens:
        out.append(t)
        if t in stop_ids or len(out) == max_new_tokens:
            return True
    return False


def naive_block_diffusion(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    block_size: int,
    mask_id: int,
    algorithm: str,
    algo_config: dict,
    max_new_tokens: int,
    stop_ids: set[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[int]:
    algo = get_algorithm(algorithm)
    cfg = algo.validate(algo_config, block_size)
    sampling = _sampling(temperature, top_k, top_p, seed)
    seq = list(prompt)
    out: list[int] = []
    while True:
        start = len(seq) // block_size * block_size
        fixed = len(seq) - start
        block = _denoise_block(model, seq, block_size=block_size, mask_id=mask_id, algo=algo,
                               cfg=cfg, sampling=sampling, shift=False)
        seq = seq[:start] + block
        if _emit(out, block[fixed:], stop_ids, max_new_tokens):
            return out


# ---- full-attention models (LLaDA, Dream) and Fast-dLLM v2 -----------------------------------
# The Fast-dLLM cache modes are defined by what they cache, so their reference keeps one
# sequence's KV (``_SequenceKV``): still one request at a time, no scheduler, no batching.


class _SequenceKV:
    """One sequence's own paged KV cache, for the Fast-dLLM cache modes: ``forward`` places
    ``tokens`` at positions ``[start, start + n)`` and lets them attend (FULL mask) to cache
    indices ``[0, seq_len)``: cached entries outside the query, fresh ones inside it."""

    def __init__(self, model: torch.nn.Module, max_len: int, page_size: int = 4):
        p = next(model.parameters())
        spec = model.kv_cache_spec()
        self.model = model
        self.req_pool = ReqToTokenPool(1, max_len, p.device)
        self.kv_pool = TokenToKVPool(-(-max_len // page_size) + 1, page_size, spec.num_layers,
                                     spec.num_kv_heads, spec.head_dim, p.dtype, p.device)
        self.row = self.req_pool.alloc()
        pages = self.kv_pool.alloc_pages(self.kv_pool.pages_for(max_len))
        self.req_pool.req_to_token[self.row, :max_len] = self.kv_pool.slots_for(pages, 0, max_len)

    @torch.no_grad()
    def forward(self, tokens: list[int], start: int, seq_len: int) -> torch.Tensor:
        n = len(tokens)
        ids = torch.tensor(tokens)
        pos = torch.arange(start, start + n)
        one = lambda v: torch.tensor([v])  # noqa: E731
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND, batch_size=1, input_ids=ids, positions=pos,
            req_pool_indices=one(self.row), prefix_lens=one(start), extend_lens=one(n),
            seq_lens=one(seq_len), out_cache_loc=self.req_pool.req_to_token[self.row, pos],
            prefix_lens_cpu=[start], extend_lens_cpu=[n], seq_lens_cpu=[seq_len],
            attention_mask=AttentionMask.FULL, logits_mode=LogitsMode.ALL,
            req_to_token=self.req_pool.req_to_token, kv_pool=self.kv_pool,
            attn_backend=SDPABackend(),
        )
        fb.attn_backend.prepare(fb)
        return self.model.compute_logits(self.model(ids, pos, fb))


def naive_full_diffusion(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    gen_length: int,
    block_size: int,
    mask_id: int,
    algorithm: str,
    algo_config: dict,
    stop_ids: set[int],
    logits_shift: int = 0,
    cfg_scale: float = 0.0,
    cache_mode: str = "exact",
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[int]:
    """LLaDA ``generate`` semantics: canvas = prompt + ``gen_length`` masks, blocks from the
    prompt end (the last may be shorter), ``algo_config`` per block. ``exact`` recomputes the
    canvas (FULL mask) at every step; ``prefix``/``dual`` follow Fast-dLLM: a full forward at
    a block's first step, then the block and everything after it (prefix) or the block alone
    (dual) against the KV cached at the block start. CFG: LLaDA's unconditional canvas (prompt
    masked) and ``un + (cfg_scale + 1) * (cond - un)``. Output cut after the first stop id."""
    algo = get_algorithm(algorithm)
    cfg = algo.validate(algo_config, block_size)
    n_prompt, length = len(prompt), len(prompt) + gen_length
    x = list(prompt) + [mask_id] * gen_length
    caches = {u: _SequenceKV(model, length) for u in (False, True)}
    shift = logits_shift

    def logits_of(canvas: list[int], start: int, end: int, step: int,
                  cache: _SequenceKV) -> torch.Tensor:
        if cache_mode == "exact":
            return forward_full(model, canvas, AttentionMask.FULL)[start - shift:end - shift]
        if step == 0:
            return cache.forward(canvas, 0, length)[start - shift:end - shift]
        # Later steps query from the block start (the K/V before it frozen at the block start);
        # shifted logits are read inside the query, its first position from its own.
        last = length if cache_mode == "prefix" else end
        query = cache.forward(canvas[start:last], start, length)
        if shift:
            query = torch.cat([query[:1], query[:-1]])
        return query[: end - start]

    out: list[int] = []
    for start in range(n_prompt, length, block_size):
        end = min(start + block_size, length)
        n = end - start
        state = {k: torch.zeros(1, dtype=torch.int64) for k in algo.state_keys}
        step = 0
        while True:
            logits = logits_of(x, start, end, step, caches[False])
            if cfg_scale > 0:
                un_x = [mask_id] * n_prompt + x[n_prompt:]
                un = logits_of(un_x, start, end, step, caches[True])
                logits = un + (cfg_scale + 1) * (logits - un)
            if shift and cache_mode != "exact" and step == 0:
                # Fast-dLLM's Dream block cache: the block-start forward fixes the block's
                # first position alone (Dream's proposal), and the schedule counts from 1.
                sampling = _sampling(temperature, top_k, top_p, seed)
                probs = dream_probs(logits[None, :1], sampling)
                x[start] = int(dream_propose(probs, sampling, torch.tensor([0]),
                                             torch.tensor([[start]]))[0, 0])
                step += 1
                if n == 1:
                    break
                continue
            res = algo.step(DenoiseInput(
                logits=logits[None], tokens=torch.tensor([x[start:end]]),
                editable=torch.ones(1, n, dtype=torch.bool), mask_id=mask_id,
                step=torch.tensor([step]), num_initial_masks=torch.tensor([n]),
                positions=torch.arange(start, end)[None],
                sampling=_sampling(temperature, top_k, top_p, seed),
                config=algo.stack_configs([cfg], torch.device("cpu")), state=state,
            ))
            x[start:end] = res.tokens[0].tolist()
            state = res.state
            step += 1
            if bool(res.done[0]):
                break
        for t in x[start:end]:
            out.append(t)
            if t in stop_ids:
                return out
    return out


def naive_fast_dllm_v2(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    block_size: int,
    mask_id: int,
    algorithm: str,
    algo_config: dict,
    max_new_tokens: int,
    stop_ids: set[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[int]:
    """Fast-dLLM v2 ``batch_sample`` semantics: block-causal, logits shifted by one (a block's
    position 0 reads its own logits, it is never masked), and the first token of every block
    after the prompt's is the greedy argmax at the last position of the finished previous
    block (the prompt's last token when the prompt ends on a block boundary)."""
    b = block_size
    algo = get_algorithm(algorithm)
    cfg = algo.validate(algo_config, b)
    seq = list(prompt)
    out: list[int] = []

    def emit(tokens: list[int]) -> bool:
        return _emit(out, tokens, stop_ids, max_new_tokens)

    def next_token() -> int:
        return int(forward_full(model, seq, AttentionMask.BLOCK_CAUSAL, b)[-1].argmax())

    if len(seq) % b == 0:
        seq.append(next_token())
        if emit(seq[-1:]):
            return out
    sampling = _sampling(temperature, top_k, top_p, seed)
    while True:
        start = len(seq) // b * b
        fixed = len(seq) - start
        block = _denoise_block(model, seq, block_size=b, mask_id=mask_id, algo=algo, cfg=cfg,
                               sampling=sampling, shift=True)
        seq = seq[:start] + block
        if emit(block[fixed:]):
            return out
        seq.append(next_token())
        if emit(seq[-1:]):
            return out
