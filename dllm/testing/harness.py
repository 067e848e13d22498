"""Run a model directly on one sequence, with or without a paged KV cache.

For tests of models and attention backends that want no scheduler in the way. The engine
builds its ``ForwardBatch`` through the runner; this builds the same object by hand."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dllm.models.parallel import full_logits
from dllm.runner.attention.base import AttentionBackend
from dllm.runner.attention.sdpa import SDPABackend
from dllm.runner.forward_batch import AttentionMask, ForwardBatch, ForwardMode, LogitsMode
from dllm.runner.memory import ReqToTokenPool, TokenToKVPool


def _batch(
    mode: ForwardMode,
    ids: torch.Tensor,
    positions: torch.Tensor,
    prefix: int,
    mask: AttentionMask,
    block_size: int,
    backend: AttentionBackend,
    req_pool: ReqToTokenPool | None = None,
    kv_pool: TokenToKVPool | None = None,
    req_index: int = 0,
) -> ForwardBatch:
    n = int(ids.shape[0])
    device = ids.device
    if kv_pool is not None and req_pool is not None:
        loc = req_pool.req_to_token[req_index, prefix : prefix + n]
    else:
        loc = torch.zeros(n, dtype=torch.int64, device=device)
    t = lambda x: torch.tensor([x], dtype=torch.int64, device=device)  # noqa: E731
    return ForwardBatch(
        mode=mode,
        batch_size=1,
        input_ids=ids,
        positions=positions,
        req_pool_indices=t(req_index),
        prefix_lens=t(prefix),
        extend_lens=t(n),
        seq_lens=t(prefix + n),
        out_cache_loc=loc,
        prefix_lens_cpu=[prefix],
        extend_lens_cpu=[n],
        seq_lens_cpu=[prefix + n],
        attention_mask=mask,
        block_size=block_size,
        logits_mode=LogitsMode.ALL,
        req_to_token=req_pool.req_to_token if req_pool is not None else None,
        kv_pool=kv_pool,
        attn_backend=backend,
    )


@torch.no_grad()
def forward_full(
    model: torch.nn.Module,
    token_ids: list[int] | torch.Tensor,
    mask: AttentionMask = AttentionMask.CAUSAL,
    block_size: int = 1,
    backend: AttentionBackend | None = None,
) -> torch.Tensor:
    """Logits ``[T, V]`` of a whole sequence, no cache, positions ``0..T-1`` (under tensor
    parallelism gathered from the ranks' vocabulary columns: a test's view)."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(token_ids, dtype=torch.int64, device=device)
    pos = torch.arange(ids.shape[0], device=device)
    fb = _batch(ForwardMode.EXTEND, ids, pos, 0, mask, block_size, backend or SDPABackend())
    fb.attn_backend.prepare(fb)
    return full_logits(model.compute_logits(model(ids, pos, fb)))


class CachedSequence:
    """One sequence with its own paged KV cache; ``extend`` appends tokens."""

    def __init__(self, model: torch.nn.Module, max_len: int, page_size: int = 4,
                 backend: AttentionBackend | None = None):
        p = next(model.parameters())
        spec = model.kv_cache_spec()
        self.model = model
        self.backend = backend or SDPABackend()
        self.req_pool = ReqToTokenPool(1, max_len, p.device)
        self.kv_pool = TokenToKVPool(
            -(-max_len // page_size) + 1, page_size, spec.num_layers, spec.num_kv_heads,
            spec.head_dim, p.dtype, p.device,
        )
        pages = self.kv_pool.alloc_pages(self.kv_pool.pages_for(max_len))
        self.row = self.req_pool.alloc()
        self.req_pool.req_to_token[self.row, :max_len] = self.kv_pool.slots_for(pages, 0, max_len)
        self.length = 0

    @torch.no_grad()
    def extend(self, token_ids: list[int] | torch.Tensor, mask: AttentionMask,
               block_size: int = 1, mode: ForwardMode = ForwardMode.EXTEND,
               advance: bool = True) -> torch.Tensor:
        """Logits ``[n, V]`` for ``token_ids`` placed at positions ``length..length+n-1``
        on top of the cached prefix. ``advance=False`` keeps them out of the prefix (a
        denoise step whose KV will be overwritten)."""
        device = next(self.model.parameters()).device
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=device)
        n = int(ids.shape[0])
        pos = torch.arange(self.length, self.length + n, device=device)
        fb = _batch(mode, ids, pos, self.length, mask, block_size, self.backend,
                    self.req_pool, self.kv_pool, self.row)
        self.backend.prepare(fb)
        logits = full_logits(self.model.compute_logits(self.model(ids, pos, fb)))
        if advance:
            self.length += n
        return logits


def run_staggered(engine, reqs: list, after_step=None) -> list[list[int]]:
    """Run ``reqs`` on ``engine`` with one new arrival per engine step (continuous batching
    with requests joining mid-flight); the generated token ids of each, in order.
    ``after_step()``, if given, runs after every step (e.g. ``engine.check_memory``)."""
    pending = list(reqs)
    while any(not r.finished for r in reqs):
        if pending:
            engine.add_request(pending.pop(0))
        engine.step()
        if after_step is not None:
            after_step()
    return [engine.output_of(r).token_ids for r in reqs]


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


@contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Inside, any tensor read back to the host (``.item()``, ``.tolist()``, ``bool(t)``…)
    raises: wrap a step's forward and post-step to show they never synchronise."""

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation inside the step")

    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, forbidden)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@contextmanager
def fail_on_token(model: torch.nn.Module, token: int | None,
                  inside: torch.nn.Module | None = None) -> Iterator[None]:
    """Inside, a forward of ``model`` whose input ids contain ``token`` (every forward, for
    ``None``) raises ``RuntimeError("injected failure")``: a request-specific failure, to
    show the engine finishes only that request. ``inside``: raise when the forward reaches
    that submodule instead of at its start (the layers before it have run: a hybrid's Mamba
    layers have written their state)."""
    hit = [False]

    def check(module: torch.nn.Module, args: tuple) -> None:
        hit[0] = token is None or bool((args[0] == token).any())
        if hit[0] and inside is None:
            raise RuntimeError("injected failure")

    def fail(module: torch.nn.Module, args: tuple) -> None:
        if hit[0]:
            raise RuntimeError("injected failure")

    handles = [model.register_forward_pre_hook(check)]
    if inside is not None:
        handles.append(inside.register_forward_pre_hook(fail))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
