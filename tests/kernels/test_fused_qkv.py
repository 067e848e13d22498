"""GPU tests (marker ``gpu``; skipped without CUDA or Triton) of the fused Triton kernels of
``dllm.runner.kernels.fused_qkv``: per-head RMSNorm + RoPE of q and k against the reference ops
(the float32 reference on upcast inputs, and the bf16 reference path), the KV-cache writes against
``index_put``, and the one-launch norm + RoPE + KV write against both. Outputs and caches are
poisoned with NaN first, so an element a kernel fails to write shows up.

The ``check_*`` helpers take the device and dtype: on the CPU they also run under Triton's
interpreter (``TRITON_INTERPRET=1``, float16: the interpreter truncates float32 → bfloat16
where the GPU rounds to nearest even)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                       reason="needs a CUDA device and triton"),
]

EPS = 1e-6
MAX_POS = 4096
SHAPES = [(8, 2, 128), (32, 8, 128)]  # (H, Hkv, D): a small GQA layer, SDAR-8B / Qwen3-8B


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().flatten(), ref.double().flatten()
    return ((out - ref).norm() / ref.norm()).item()


def _rope(factor: float, d: int, device):
    from dllm.models.config import ModelConfig
    from dllm.models.layers import RopeSpec, RotaryEmbedding

    return RotaryEmbedding(RopeSpec.from_config(
        ModelConfig({"partial_rotary_factor": factor, "rope_theta": 1e6}), d)).to(device)


def _inputs(t: int, h: int, hkv: int, d: int, device, dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, dtype=dtype)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g, **kw)
    wq = 1 + 0.1 * torch.randn(d, generator=g, **kw)
    wk = 1 + 0.1 * torch.randn(d, generator=g, **kw)
    pos = torch.randint(0, MAX_POS, (t,), generator=g, device=device)
    return qkv, wq, wk, pos


def _split(qkv: torch.Tensor, h: int, hkv: int, d: int):
    t = qkv.shape[0]
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
    return q, k, v


def _reference(rope, qkv, h, hkv, d, wq, wk, pos, upcast: bool):
    """The model's path (``TORCH_OPS`` head RMSNorm then RoPE) → q ``[T, H, D]``, k."""
    from dllm.models.ops import TORCH_OPS

    q, k, _ = _split(qkv, h, hkv, d)
    if upcast:
        q, k = q.float(), k.float()
        wq = None if wq is None else wq.float()
        wk = None if wk is None else wk.float()
    if wq is not None:
        q = TORCH_OPS.head_rms_norm(q, wq, EPS)
        k = TORCH_OPS.head_rms_norm(k, wk, EPS)
    rq, rk = TORCH_OPS.rope(rope, pos, q, k, None)
    t = qkv.shape[0]
    return rq.view(t, h, d), rk.view(t, hkv, d)


def check_qk_norm_rope(device, dtype, t: int, h: int, hkv: int, d: int, factor: float,
                       norm: bool, tol: float = 1e-2) -> None:
    from dllm.runner.kernels.fused_qkv import qk_norm_rope

    rope = _rope(factor, d, device)
    table = rope.cos_sin_cache(MAX_POS)
    qkv, wq, wk, pos = _inputs(t, h, hkv, d, device, dtype)
    if not norm:
        wq = wk = None
    q = torch.full((t, h, d), float("nan"), device=device, dtype=dtype)
    k = torch.full((t, hkv, d), float("nan"), device=device, dtype=dtype)
    out = qk_norm_rope(qkv, h, hkv, d, wq, wk, EPS, table, pos, out=(q, k))
    assert out[0] is q and out[1] is k
    assert torch.isfinite(q).all() and torch.isfinite(k).all()  # every element written
    r32 = _reference(rope, qkv, h, hkv, d, wq, wk, pos, upcast=True)
    r16 = _reference(rope, qkv, h, hkv, d, wq, wk, pos, upcast=False)
    for fast, ref32, ref16 in ((q, *[r[0] for r in (r32, r16)]), (k, *[r[1] for r in (r32, r16)])):
        assert _rel(fast, ref32) < tol, _rel(fast, ref32)
        assert _rel(ref16, ref32) < tol
        assert _rel(fast, ref16) < tol
    rot = rope.spec.rotary_dim
    if rot < d and not norm:  # channels past rotary_dim pass through bit for bit
        q_in, k_in, _ = _split(qkv, h, hkv, d)
        assert torch.equal(q[..., rot:], q_in[..., rot:])
        assert torch.equal(k[..., rot:], k_in[..., rot:])
    # The allocating form returns the same values.
    q2, k2 = qk_norm_rope(qkv, h, hkv, d, wq, wk, EPS, table, pos)
    assert q2.is_contiguous() and k2.is_contiguous() and q2.dtype == dtype
    assert torch.equal(q2, q) and torch.equal(k2, k)


def _poisoned_cache(slots: int, hkv: int, d: int, device, dtype, t: int, seed: int = 1):
    """NaN-filled K and V buffers and ``t`` distinct random slots."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    k_buf = torch.full((slots, hkv, d), float("nan"), device=device, dtype=dtype)
    loc = torch.randperm(slots, generator=g)[:t].to(device)
    return k_buf, k_buf.clone(), loc


def _assert_only_slots(buf: torch.Tensor, loc: torch.Tensor, want: torch.Tensor) -> None:
    """``buf[loc]`` equals ``want`` bit for bit and every other slot is still NaN."""
    assert torch.equal(buf[loc], want.to(buf.dtype))
    rest = torch.ones(buf.shape[0], dtype=torch.bool, device=buf.device)
    rest[loc] = False
    assert buf[rest].isnan().all()


def check_store_kv(device, dtype, t: int, hkv: int, d: int, src_dtype=None) -> None:
    from dllm.runner.kernels.fused_qkv import store_kv

    src_dtype = src_dtype or dtype
    g = torch.Generator(device=device).manual_seed(2)
    slots = max(2 * t, 64)
    k = torch.randn(t, hkv, d, generator=g, device=device, dtype=src_dtype)
    qkv = torch.randn(t, (4 * hkv + 2 * hkv) * d, generator=g, device=device, dtype=src_dtype)
    v = qkv[:, 5 * hkv * d :].view(t, hkv, d)  # the strided V column slice
    assert t == 1 or not v.is_contiguous()
    k_buf, v_buf, loc = _poisoned_cache(slots, hkv, d, device, dtype, t)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    k_ref[loc] = k.to(dtype)  # TokenToKVPool.set_kv
    v_ref[loc] = v.to(dtype)
    store_kv(k_buf, v_buf, loc, k, v)
    _assert_only_slots(k_buf, loc, k)
    _assert_only_slots(v_buf, loc, v)
    torch.testing.assert_close(k_buf, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_buf, v_ref, rtol=0, atol=0, equal_nan=True)


def check_qk_norm_rope_store(device, dtype, t: int, h: int, hkv: int, d: int, factor: float,
                             norm: bool) -> None:
    from dllm.runner.kernels.fused_qkv import qk_norm_rope, qk_norm_rope_store

    rope = _rope(factor, d, device)
    table = rope.cos_sin_cache(MAX_POS)
    qkv, wq, wk, pos = _inputs(t, h, hkv, d, device, dtype, seed=3)
    if not norm:
        wq = wk = None
    k_buf, v_buf, loc = _poisoned_cache(max(2 * t, 64), hkv, d, device, dtype, t)
    q = torch.full((t, h, d), float("nan"), device=device, dtype=dtype)
    assert qk_norm_rope_store(qkv, h, hkv, d, wq, wk, EPS, table, pos, k_buf, v_buf, loc,
                              q_out=q) is q
    want_q, want_k = qk_norm_rope(qkv, h, hkv, d, wq, wk, EPS, table, pos)
    assert torch.equal(q, want_q)
    _assert_only_slots(k_buf, loc, want_k)
    _assert_only_slots(v_buf, loc, _split(qkv, h, hkv, d)[2])


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 4, 37, 512])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("factor", [1.0, 0.5])
@pytest.mark.parametrize("shape", SHAPES)
def test_qk_norm_rope_matches_reference(shape, factor, norm, t):
    """METHOD: ‖out − ref‖/‖ref‖ < 1e-2 against the float32 reference on upcast inputs and
    against the bf16 reference path (which itself is within 1e-2 of float32)."""
    check_qk_norm_rope("cuda", torch.bfloat16, t, *shape, factor, norm)


@pytest.mark.parametrize("t", [1, 4, 37, 512])
@pytest.mark.parametrize("hkv,d", [(2, 128), (8, 128), (1, 64), (4, 256)])
def test_store_kv_writes_exactly_the_slots(t, hkv, d):
    check_store_kv("cuda", torch.bfloat16, t, hkv, d)


def test_store_kv_casts_to_the_cache_dtype():
    check_store_kv("cuda", torch.bfloat16, 37, 2, 128, src_dtype=torch.float32)


@pytest.mark.parametrize("t", [1, 4, 37, 512])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_qk_norm_rope_store_equals_the_two_steps(factor, norm, t):
    check_qk_norm_rope_store("cuda", torch.bfloat16, t, 32, 8, 128, factor, norm)


def test_fp16_and_empty():
    check_qk_norm_rope("cuda", torch.float16, 37, 8, 2, 128, 1.0, True)
    from dllm.runner.kernels.fused_qkv import qk_norm_rope, qk_norm_rope_store, store_kv

    rope = _rope(1.0, 128, "cuda")
    table = rope.cos_sin_cache(MAX_POS)
    qkv, wq, wk, pos = _inputs(0, 8, 2, 128, "cuda", torch.bfloat16)
    q, k = qk_norm_rope(qkv, 8, 2, 128, wq, wk, EPS, table, pos)
    assert q.shape == (0, 8, 128) and k.shape == (0, 2, 128)
    k_buf, v_buf, loc = _poisoned_cache(64, 2, 128, "cuda", torch.bfloat16, 0)
    assert qk_norm_rope_store(qkv, 8, 2, 128, wq, wk, EPS, table, pos, k_buf, v_buf,
                              loc).shape == (0, 8, 128)
    store_kv(k_buf, v_buf, loc, k, k)
    assert k_buf.isnan().all() and v_buf.isnan().all()


def test_cuda_graph_replay_follows_the_inputs():
    """Captured once, replayed on new qkv/positions/slots written in place: no host sync or
    host-side value in the launches."""
    from dllm.runner.kernels.fused_qkv import qk_norm_rope, qk_norm_rope_store

    h, hkv, d, t = 32, 8, 128, 4
    rope = _rope(1.0, d, "cuda")
    table = rope.cos_sin_cache(MAX_POS)
    qkv, wq, wk, pos = _inputs(t, h, hkv, d, "cuda", torch.bfloat16)
    k_buf, v_buf, loc = _poisoned_cache(64, hkv, d, "cuda", torch.bfloat16, t)
    qk_norm_rope_store(qkv, h, hkv, d, wq, wk, EPS, table, pos, k_buf, v_buf, loc)  # compile
    qk_norm_rope(qkv, h, hkv, d, wq, wk, EPS, table, pos)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_g = qk_norm_rope_store(qkv, h, hkv, d, wq, wk, EPS, table, pos, k_buf, v_buf, loc)
    for seed in (5, 6):
        new_qkv, _, _, new_pos = _inputs(t, h, hkv, d, "cuda", torch.bfloat16, seed=seed)
        qkv.copy_(new_qkv)
        pos.copy_(new_pos)
        loc.copy_(torch.randperm(64, device="cuda")[:t])
        k_buf.fill_(float("nan"))
        v_buf.fill_(float("nan"))
        graph.replay()
        want_q, want_k = qk_norm_rope(qkv, h, hkv, d, wq, wk, EPS, table, pos)
        assert torch.equal(q_g, want_q)
        _assert_only_slots(k_buf, loc, want_k)
        _assert_only_slots(v_buf, loc, _split(qkv, h, hkv, d)[2])


def test_supports():
    from dllm.runner.kernels.fused_qkv import supports, supports_store

    h, hkv, d = 32, 8, 128
    qkv = torch.empty(4, (h + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    buf = torch.empty(16, hkv, d, device="cuda", dtype=torch.bfloat16)
    assert supports(qkv, h, hkv, d, d) and supports(qkv, h, hkv, d, d // 2)
    assert supports_store(qkv, h, hkv, d, d, buf, buf)
    assert not supports(qkv.float(), h, hkv, d, d)
    assert not supports(qkv.cpu(), h, hkv, d, d)
    assert not supports(qkv, h, hkv, d, d - 1)  # odd rotary_dim
    assert not supports(qkv, h, hkv, 96, 96)  # not a power of two (and wrong width)
    assert not supports(qkv[:, :-d], h, hkv, d, d)  # wrong width
    assert not supports_store(qkv, h, hkv, d, d, buf[:, :4], buf)
