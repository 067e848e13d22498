"""MoE routing in one launch (``route_sigmoid``, ``route_softmax``), with static shapes and no
host read (CUDA-graph capturable); ``fused_moe`` runs the routed experts.

The torch routers (``dllm.models.moe.sigmoid_grouped_topk``, ``softmax_topk``) take about ten
small kernels. Here one program per ``BLOCK_T`` tokens holds their ``[BLOCK_T, E]`` logits and
computes what the torch routers compute, with the same float32 operations on the same values:
the sigmoid as ``1 / (1 + exp(-x))`` with libdevice's ``expf`` and a correctly rounded division
(the expression ATen evaluates; Triton's own ``exp`` and ``/`` are approximate), the bias added
for the choice only, the group scores (the sum of each group's best two), the ``topk_group``
best groups and the ``top_k`` best experts among theirs by repeated argmax (ties to the lower
index), and the renormalisation ``w / (sum + 1e-20)`` and scaling. So the experts chosen are
the torch router's (ties aside) and the weights equal its weights to float32 rounding (the
K-term sum is not summed in the same order).

**Measured** (H200, LLaDA2.0-mini's router: 256 experts, 8 groups, top-8; ``bench/kernels/moe.py``):
7 / 8 / 16 µs at 32 / 1024 / 4096 tokens against 46 / 83 / 183 for ``sigmoid_grouped_topk``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["route_sigmoid", "route_softmax", "supports_sigmoid", "supports_softmax"]

# Under TRITON_INTERPRET=1 the kernels run on CPU tensors (numpy); used by the tests only.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _on_device(t: torch.Tensor) -> bool:
    return t.is_cuda or (_INTERPRET and t.device.type == "cpu")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0




@triton.jit
def _top_k(choice, scores, re, rk, K: tl.constexpr, BLOCK_T: tl.constexpr, K_P: tl.constexpr):
    """The K best of ``choice`` per row (ties to the lower index) and ``scores`` there, as
    ``[BLOCK_T, K_P]`` ids and values (columns past K left zero)."""
    ids = tl.zeros((BLOCK_T, K_P), tl.int32)
    wts = tl.zeros((BLOCK_T, K_P), tl.float32)
    for k in tl.static_range(K):
        best = tl.argmax(choice, axis=1)
        hit = re[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # one term: exactly the score
        wts = tl.where(rk == k, w[:, None], wts)
        ids = tl.where(rk == k, best[:, None], ids)
        choice = tl.where(hit, float("-inf"), choice)
    return ids, wts


@triton.jit(do_not_specialize=["T"])
def _sigmoid_route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, scaling, stride_t,
                          E: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr,
                          N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                          HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                          LIBDEVICE: tl.constexpr, BLOCK_T: tl.constexpr):
    # E is a power of two, and so are N_GROUP and E / N_GROUP (``supports_sigmoid``).
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    re = tl.arange(0, E)
    t_ok = rt < T
    x = tl.load(logits_ptr + rt[:, None] * stride_t + re[None, :], mask=t_ok[:, None],
                other=0.0).to(tl.float32)
    # ATen's sigmoid: 1 / (1 + expf(-x)), IEEE division.
    if LIBDEVICE:
        ex = libdevice.exp(-x)
    else:
        ex = tl.exp(-x)
    scores = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + ex)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + re).to(tl.float32)[None, :]
    if N_GROUP > 1:
        EG: tl.constexpr = E // N_GROUP
        c3 = tl.reshape(choice, (BLOCK_T, N_GROUP, EG))
        best = tl.max(c3, axis=2)
        if EG > 1:  # the group's score: its two best, summed
            first = tl.argmax(c3, axis=2)
            ie = tl.arange(0, EG)[None, None, :]
            best = best + tl.max(tl.where(ie == first[:, :, None], float("-inf"), c3), axis=2)
        rg = tl.arange(0, N_GROUP)[None, :]
        keep = rg < 0
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(best, axis=1)
            hit = rg == g[:, None]
            keep = keep | hit
            best = tl.where(hit, float("-inf"), best)
        c3 = tl.where(keep[:, :, None], c3, float("-inf"))
        choice = tl.reshape(c3, (BLOCK_T, E))
    rk = tl.arange(0, K_P)[None, :]
    ids, wts = _top_k(choice, scores, re, rk, K, BLOCK_T, K_P)
    if RENORMALIZE:
        wts = tl.math.div_rn(wts, tl.sum(wts, axis=1)[:, None] + 1e-20)
    wts = wts * scaling
    out = rt[:, None] * K + rk
    ok = t_ok[:, None] & (rk < K)
    tl.store(w_ptr + out, wts, mask=ok)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=ok)


@triton.jit(do_not_specialize=["T"])
def _softmax_route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_t,
                          E: tl.constexpr, E_P: tl.constexpr, K: tl.constexpr,
                          K_P: tl.constexpr, HAS_BIAS: tl.constexpr,
                          RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    re = tl.arange(0, E_P)
    t_ok = rt < T
    x = tl.load(logits_ptr + rt[:, None] * stride_t + re[None, :],
                mask=t_ok[:, None] & (re[None, :] < E), other=float("-inf")).to(tl.float32)
    x = tl.where(t_ok[:, None], x, 0.0)  # rows past T: finite, never stored
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]
    choice = probs
    if HAS_BIAS:  # the biased values are the weights too (LLaDA-MoE)
        choice = probs + tl.load(bias_ptr + re, mask=re < E, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(re[None, :] < E, choice, float("-inf"))
    rk = tl.arange(0, K_P)[None, :]
    ids, wts = _top_k(choice, choice, re, rk, K, BLOCK_T, K_P)
    if RENORMALIZE:
        wts = wts / tl.sum(wts, axis=1)[:, None]
    out = rt[:, None] * K + rk
    ok = t_ok[:, None] & (rk < K)
    tl.store(w_ptr + out, wts, mask=ok)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=ok)


def _route_outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = logits.shape[0]
    return (torch.empty((t, top_k), dtype=torch.float32, device=logits.device),
            torch.empty((t, top_k), dtype=torch.int64, device=logits.device))


def _block_t(e: int) -> int:
    """Tokens a routing program takes: about 1024 logits a program."""
    return max(1, min(16, 1024 // triton.next_power_of_2(e)))


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _logits_ok(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None) -> bool:
    """Logits ``[T, E]`` (rows contiguous, read as float32 like the torch routers' ``float()``)
    and a bias ``[E]`` on their device; at most 4096 experts and 64 of them a token."""
    e = logits.shape[-1]
    return (_on_device(logits) and logits.dim() == 2 and logits.dtype in _FLOATS
            and logits.stride(1) == 1 and 1 <= top_k <= min(e, 64) and e <= 4096
            and (bias is None or (bias.shape == (e,) and bias.is_contiguous()
                                  and bias.device == logits.device and bias.dtype in _FLOATS)))


def supports_sigmoid(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                     bias: torch.Tensor | None) -> bool:
    """Whether ``route_sigmoid`` takes these: logits ``[T, E]`` (rows contiguous) on the
    device, E a power of two, ``n_group`` groups of a power-of-two size whose ``topk_group``
    best hold at least ``top_k`` experts."""
    e = logits.shape[-1]
    groups = max(1, n_group)
    keep = topk_group if groups > 1 else 1  # one group: the reference ignores topk_group
    return (_logits_ok(logits, top_k, bias) and _pow2(e) and _pow2(groups) and e % groups == 0
            and 1 <= keep <= groups and top_k <= keep * (e // groups))


def route_sigmoid(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  bias: torch.Tensor | None, renormalize: bool, scaling_factor: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``dllm.models.moe.sigmoid_grouped_topk`` in one launch: float32 weights and int64
    expert ids, ``[T, K]`` (check ``supports_sigmoid`` first)."""
    t, e = logits.shape
    weights, ids = _route_outputs(logits, top_k)
    block = _block_t(e)
    groups = max(1, n_group)
    _sigmoid_route_kernel[(triton.cdiv(t, block),)](
        logits, bias if bias is not None else logits, weights, ids, t, float(scaling_factor),
        logits.stride(0), E=e, K=top_k, K_P=triton.next_power_of_2(top_k), N_GROUP=groups,
        TOPK_GROUP=topk_group if groups > 1 else 1, HAS_BIAS=bias is not None,
        RENORMALIZE=renormalize and top_k > 1, LIBDEVICE=not _INTERPRET, BLOCK_T=block,
        num_warps=4)
    return weights, ids


def supports_softmax(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None) -> bool:
    """Whether ``route_softmax`` takes these: logits ``[T, E]`` (rows contiguous) on the
    device."""
    return _logits_ok(logits, top_k, bias)


def route_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``dllm.models.moe.softmax_topk`` in one launch (check ``supports_softmax`` first). The
    probabilities use Triton's ``exp`` and sum in its order: the weights agree with torch's
    to about 1e-7, and the experts chosen agree but for near-ties."""
    t, e = logits.shape
    weights, ids = _route_outputs(logits, top_k)
    block = _block_t(e)
    _softmax_route_kernel[(triton.cdiv(t, block),)](
        logits, bias if bias is not None else logits, weights, ids, t, logits.stride(0), E=e,
        E_P=triton.next_power_of_2(e), K=top_k, K_P=triton.next_power_of_2(top_k),
        HAS_BIAS=bias is not None, RENORMALIZE=renormalize, BLOCK_T=block, num_warps=4)
    return weights, ids
