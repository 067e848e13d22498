"""Token sampling and the counter-based RNG (dllm.algorithms.sampling / .rng)."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from dllm.algorithms.base import SamplingTensors
from dllm.algorithms.reductions import fixed_order_cumsum, fixed_order_sum
from dllm.algorithms.rng import (
    MASK32,
    Stream,
    counter_key,
    hash32,
    position_uniform,
    unit_float32,
    unit_float64,
    vocab_bits,
)
from dllm.algorithms.sampling import entropy, log_confidence, log_normalizer, sample_tokens


def sampling(bs: int, temperature=0.0, top_k=0, top_p=1.0, seed=0, **flags) -> SamplingTensors:
    def row(v, dtype):
        return torch.as_tensor(v if isinstance(v, list) else [v] * bs, dtype=dtype)

    return SamplingTensors(
        temperature=row(temperature, torch.float32),
        top_k=row(top_k, torch.int64),
        top_p=row(top_p, torch.float32),
        seed=row(seed, torch.int64),
        **flags,
    )


def grid(bs: int, block: int, start: int = 0) -> torch.Tensor:
    return (torch.arange(block) + start).expand(bs, block).clone()


def draw(logits, s, step=0, positions=None, **kw):
    bs, block, _ = logits.shape
    positions = grid(bs, block) if positions is None else positions
    return sample_tokens(logits, s, positions, torch.full((bs,), step), **kw)


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Make every tensor -> host conversion raise (a hook on torch, not on dllm)."""

    def refuse(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name} called in the step path")

        return raiser

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__",
                     "__index__", "nonzero"):  # fmt: skip
            m.setattr(torch.Tensor, name, refuse(name))
        m.setattr(torch, "nonzero", refuse("torch.nonzero"))
        yield


# ---------------------------------------------------------------- counter RNG


def lowbias32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def test_hash32_matches_python_reference():
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, MASK32] + [
        (i * 2654435761) & MASK32 for i in range(200)
    ]
    got = hash32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [lowbias32_reference(v) for v in values]


def test_hash32_is_a_bijection_on_a_range():
    x = torch.arange(1 << 16, dtype=torch.int64) * 65537
    assert hash32(x).unique().numel() == x.numel()


def test_counter_key_range_and_seed_bits():
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 1 << 32, (1 << 32) + 1])
    key = counter_key(seeds, torch.zeros(7, dtype=torch.int64), grid(7, 4), Stream.TOKEN)
    assert key.min() >= 0 and key.max() <= MASK32
    # Seeds that differ only above bit 32 still give different streams.
    assert not torch.equal(key[0], key[5]) and not torch.equal(key[1], key[6])
    assert not torch.equal(key[0], key[1])


def test_counter_key_depends_on_every_input():
    seed, step, pos = torch.tensor([7]), torch.tensor([3]), torch.tensor([[11]])
    base = counter_key(seed, step, pos, Stream.TOKEN)
    assert base != counter_key(seed + 1, step, pos, Stream.TOKEN)
    assert base != counter_key(seed, step + 1, pos, Stream.TOKEN)
    assert base != counter_key(seed, step, pos + 1, Stream.TOKEN)
    assert base != counter_key(seed, step, pos, Stream.POSITION)


def test_unit_floats_are_open_interval():
    edges = torch.tensor([0, 1, MASK32 - 1, MASK32], dtype=torch.int64)
    u32 = unit_float32(edges)
    assert u32.dtype == torch.float32 and (u32 > 0).all() and (u32 < 1).all()
    u64 = unit_float64(edges, edges)
    assert u64.dtype == torch.float64 and (u64 > 0).all() and (u64 < 1).all()
    # The float64 draw refines the float32 one.
    bits = vocab_bits(counter_key(torch.tensor([1]), torch.tensor([0]), grid(1, 8), 0), 64)
    low = vocab_bits(counter_key(torch.tensor([1]), torch.tensor([0]), grid(1, 8), 3), 64)
    assert (unit_float64(bits, low) - unit_float32(bits).double()).abs().max() < 2**-22


def test_uniforms_are_uniform():
    u = position_uniform(torch.arange(64), torch.zeros(64, dtype=torch.int64), grid(64, 2048), 1)
    u = u.flatten().double()
    assert abs(u.mean().item() - 0.5) < 0.002
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    expected = u.numel() / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 50  # 15 degrees of freedom: p ~ 1e-5


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_plain_softmax_confidence():
    torch.manual_seed(0)
    logits = torch.randn(3, 8, 40) * 4
    out = draw(logits.bfloat16(), sampling(3))
    ref = logits.bfloat16().float()
    assert torch.equal(out.x0, ref.argmax(-1))
    expected = torch.softmax(ref, -1).gather(-1, out.x0[..., None]).squeeze(-1)
    torch.testing.assert_close(out.confidence, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.logprobs, torch.log_softmax(ref, -1), rtol=1e-5, atol=1e-5)
    assert out.x0.dtype == torch.int64 and out.confidence.dtype == torch.float32


def test_greedy_ties_go_to_lowest_vocab_id():
    logits = torch.tensor([[[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]]])
    out = draw(logits, sampling(1))
    assert out.x0.tolist() == [[1, 0]]
    assert out.confidence[0, 1].item() == 0.25


def test_greedy_ignores_top_k_and_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    out = draw(logits, sampling(1, top_k=1, top_p=0.1))
    assert out.x0.item() == 0
    assert out.confidence.item() == pytest.approx(0.5, abs=1e-6)


def test_excluded_id_is_never_proposed():
    logits = torch.zeros(2, 16, 5)
    logits[..., 4] = 10.0  # the mask token would win everywhere
    for temperature in (0.0, 1.0):
        out = draw(logits, sampling(2, temperature=temperature, seed=[1, 2]), exclude_id=4)
        assert (out.x0 != 4).all()
        assert out.logprobs[..., 4].eq(float("-inf")).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_batch_without_sampling_rows_equals_the_general_path(dtype):
    """A batch whose rows are all greedy skips the division by the temperature (exact for
    1.0): the same result as with the sampling flags on, and the caller's logits untouched
    (float32 logits are not copied by ``float()``)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 50, generator=g).to(dtype)
    before = logits.clone()
    fast = draw(logits, sampling(3, may_sample=False, may_filter=False), exclude_id=7)
    full = draw(logits, sampling(3, may_sample=True, may_filter=True), exclude_id=7)
    assert torch.equal(logits, before)
    assert torch.equal(fast.x0, full.x0) and torch.equal(fast.logprobs, full.logprobs)
    assert torch.equal(fast.confidence, full.confidence)


def test_confidence_keeps_order_near_one():
    # 1 - p = 1e-9 and 2e-9: both round to 1.0 in float32, the log-probabilities do not.
    logits = torch.tensor([[[0.0, math.log(1e-9)], [0.0, math.log(2e-9)]]])
    out = draw(logits, sampling(1))
    assert out.confidence.tolist() == [[1.0, 1.0]]
    lc = log_confidence(out)[0]
    assert lc[0] > lc[1]
    assert lc[0].item() == pytest.approx(-1e-9, rel=1e-4)
    assert lc[1].item() == pytest.approx(-2e-9, rel=1e-4)


def test_log_normalizer_is_logsumexp():
    torch.manual_seed(1)
    x = torch.randn(4, 6, 33) * 5
    torch.testing.assert_close(log_normalizer(x), torch.logsumexp(x, -1), rtol=1e-6, atol=1e-6)


def test_entropy_matches_definition():
    p = torch.tensor([[[0.5, 0.25, 0.25, 0.0]]])
    h = entropy(torch.log(p))
    assert h.item() == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)), rel=1e-6)


# ---------------------------------------------------------------- temperature > 0


def test_sampling_is_deterministic_per_seed_and_varies_with_seed_step_position():
    torch.manual_seed(2)
    logits = torch.randn(1, 64, 30)
    s = sampling(1, temperature=1.0, seed=5)
    a, b = draw(logits, s), draw(logits, s)
    assert torch.equal(a.x0, b.x0) and torch.equal(a.confidence, b.confidence)
    assert not torch.equal(a.x0, draw(logits, sampling(1, temperature=1.0, seed=6)).x0)
    assert not torch.equal(a.x0, draw(logits, s, step=1).x0)
    assert not torch.equal(a.x0, draw(logits, s, positions=grid(1, 64, start=64)).x0)


def test_sampling_is_batch_invariant():
    torch.manual_seed(3)
    bs, block, vocab = 8, 16, 50
    logits = torch.randn(bs, block, vocab) * 3
    s = sampling(
        bs,
        temperature=[0.0, 1.0, 0.7, 1.3, 1.0, 0.0, 2.0, 0.5],
        top_k=[0, 0, 5, 0, 3, 2, 0, 10],
        top_p=[1.0, 0.9, 1.0, 0.5, 0.8, 1.0, 0.95, 1.0],
        seed=[11, 12, 13, 14, 15, 16, 17, 18],
    )
    positions = torch.stack([torch.arange(block) + 32 * r for r in range(bs)])
    step = torch.arange(bs)
    fp64 = torch.tensor([False, True, False, True, False, True, False, True])
    for flags in (None, fp64):
        full = sample_tokens(logits, s, positions, step, exclude_id=49, gumbel_fp64=flags)
        for r in range(bs):
            one = dataclasses.replace(
                s,
                **{f: getattr(s, f)[r : r + 1] for f in ("temperature", "top_k", "top_p", "seed")},
            )
            alone = sample_tokens(
                logits[r : r + 1], one, positions[r : r + 1], step[r : r + 1], exclude_id=49,
                gumbel_fp64=None if flags is None else flags[r : r + 1],
            )  # fmt: skip
            assert torch.equal(alone.x0[0], full.x0[r])
            assert torch.equal(alone.confidence[0], full.confidence[r])
            assert torch.equal(alone.logprobs[0], full.logprobs[r])


def test_top_k_restricts_support():
    torch.manual_seed(4)
    logits = torch.randn(2, 512, 50)
    allowed = logits.topk(3, dim=-1).indices
    for step in range(10):
        out = draw(logits, sampling(2, temperature=1.5, top_k=3, seed=[1, 2]), step=step)
        assert (out.x0[..., None] == allowed).any(-1).all()
    # Confidence is renormalised over the kept set.
    kept = torch.softmax(logits.gather(-1, allowed) / 1.5, -1)
    conf = torch.where(out.x0[..., None] == allowed, kept, 0.0).sum(-1)
    torch.testing.assert_close(out.confidence, conf, rtol=1e-5, atol=1e-6)


def test_top_p_restricts_support_and_renormalises():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).expand(1, 2000, 4)
    out = draw(logits, sampling(1, temperature=1.0, top_p=0.7, seed=9))
    assert set(out.x0.unique().tolist()) == {0, 1}
    expected = torch.where(out.x0 == 0, 0.5 / 0.8, 0.3 / 0.8)
    torch.testing.assert_close(out.confidence, expected, rtol=1e-5, atol=1e-6)
    out = draw(logits, sampling(1, temperature=1.0, top_p=0.85, seed=9))
    assert set(out.x0.unique().tolist()) == {0, 1, 2}


def test_top_k_is_applied_before_top_p():
    # top-k 2 renormalises to [4/7, 3/7]; top-p 0.5 then keeps only token 0.
    # (top-p first would keep {0, 1}.)
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])).expand(1, 1000, 4)
    out = draw(logits, sampling(1, temperature=1.0, top_k=2, top_p=0.5, seed=3))
    assert out.x0.unique().tolist() == [0]
    assert torch.equal(out.confidence, torch.ones_like(out.confidence))


def test_filters_keep_ties_at_the_boundary():
    logits = torch.tensor([[[2.0, 1.0, 1.0, 0.0]]]).expand(1, 3000, 4)
    out = draw(logits, sampling(1, temperature=1.0, top_k=2, seed=4))
    assert set(out.x0.unique().tolist()) == {0, 1, 2}


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5, -2.0])
    target = torch.softmax(logits / temperature, -1)
    out = draw(logits.expand(4, 4096, 5), sampling(4, temperature=temperature, seed=[1, 2, 3, 4]))
    freq = torch.bincount(out.x0.flatten(), minlength=5).float() / out.x0.numel()
    assert (freq - target).abs().max() < 0.01  # sd <= 0.0039 over 16384 draws
    torch.testing.assert_close(out.confidence, target[out.x0], rtol=1e-5, atol=1e-6)


def test_gumbel_fp64_matches_llada_sampler():
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5, -2.0])
    s = sampling(4, temperature=[0.7, 0.7, 0.0, 0.7], top_k=[0, 0, 0, 2], seed=[1, 2, 3, 4])
    flags = torch.tensor([True, True, True, True])
    out = draw(logits.expand(4, 4096, 5), s, gumbel_fp64=flags)
    again = draw(logits.expand(4, 4096, 5), s, gumbel_fp64=flags)
    assert torch.equal(out.x0, again.x0)
    target = torch.softmax(logits / 0.7, -1)
    freq = torch.bincount(out.x0[:2].flatten(), minlength=5).float() / out.x0[:2].numel()
    assert (freq - target).abs().max() < 0.015
    # Confidence is LLaDA's plain softmax, not the tempered one.
    plain = torch.softmax(logits, -1)
    torch.testing.assert_close(out.confidence[:2], plain[out.x0[:2]], rtol=1e-5, atol=1e-6)
    # Greedy rows are argmax; filters still bound the support.
    assert (out.x0[2] == 0).all()
    assert set(out.x0[3].unique().tolist()) == {0, 3}


def test_gumbel_fp64_and_float32_draws_agree_almost_always():
    torch.manual_seed(5)
    logits = torch.randn(2, 1024, 64)
    s = sampling(2, temperature=1.0, seed=[7, 8])
    a = draw(logits, s)
    b = draw(logits, s, gumbel_fp64=torch.tensor([True, True]))
    assert (a.x0 == b.x0).float().mean() > 0.99  # same u to float32 precision


def test_sample_tokens_makes_no_host_sync(monkeypatch):
    torch.manual_seed(6)
    logits = torch.randn(3, 8, 20).bfloat16()
    s = sampling(3, temperature=[0.0, 1.0, 0.8], top_k=[0, 4, 0], top_p=[1.0, 1.0, 0.9])
    with no_host_sync(monkeypatch):
        out = draw(logits, s, exclude_id=19, gumbel_fp64=torch.tensor([False, True, True]))
        entropy(out.logprobs)
    assert out.x0.shape == (3, 8)


# ---------------------------------------------------------------- host-side batch flags


def test_flags_off_give_the_same_bits_for_rows_that_do_not_need_them():
    torch.manual_seed(7)
    logits = torch.randn(3, 8, 30) * 3
    greedy = sampling(3)
    ref = draw(logits, greedy, exclude_id=29)
    for flags in ({"may_sample": False}, {"may_filter": False},
                  {"may_sample": False, "may_filter": False}):  # fmt: skip
        out = draw(logits, sampling(3, **flags), exclude_id=29)
        assert torch.equal(out.x0, ref.x0) and torch.equal(out.confidence, ref.confidence)
        assert torch.equal(out.logprobs, ref.logprobs)
    hot = sampling(3, temperature=[1.0, 0.5, 0.0], seed=[1, 2, 3])
    out = draw(logits, sampling(3, temperature=[1.0, 0.5, 0.0], seed=[1, 2, 3], may_filter=False))
    ref = draw(logits, hot)
    assert torch.equal(out.x0, ref.x0) and torch.equal(out.confidence, ref.confidence)


# ---------------------------------------------------------------- fixed-order reductions


@pytest.mark.parametrize("n", [1, 2, 5, 32, 255, 256, 257, 1000, 5000])
def test_fixed_order_sums_match_torch(n):
    torch.manual_seed(n)
    x = torch.rand(3, n, dtype=torch.float64)
    torch.testing.assert_close(fixed_order_sum(x), x.sum(-1))
    torch.testing.assert_close(fixed_order_cumsum(x), x.cumsum(-1))
    assert fixed_order_cumsum(x).shape == x.shape


def test_fixed_order_sums_are_batch_invariant():
    torch.manual_seed(8)
    x = torch.rand(64, 20000)
    s, c = fixed_order_sum(x), fixed_order_cumsum(x)
    for r in (0, 17, 63):
        assert torch.equal(fixed_order_sum(x[r : r + 1])[0], s[r])
        assert torch.equal(fixed_order_cumsum(x[r : r + 1])[0], c[r])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_is_batch_invariant_on_cuda():
    torch.manual_seed(9)
    bs, block, vocab = 16, 32, 65536
    logits = (torch.randn(bs, block, vocab, device="cuda") * 4).bfloat16()
    s = sampling(
        bs,
        temperature=[0.0, 1.0, 0.7, 1.3] * 4,
        top_k=[0, 0, 50, 0] * 4,
        top_p=[1.0, 0.9, 1.0, 0.95] * 4,
        seed=list(range(bs)),
    )
    s = dataclasses.replace(s, **{f: getattr(s, f).cuda() for f in ("temperature", "top_k",
                                                                    "top_p", "seed")})  # fmt: skip
    positions = torch.arange(block, device="cuda").expand(bs, block) + 640
    step = torch.arange(bs, device="cuda")
    flags = torch.tensor([False, True] * 8, device="cuda")
    full = sample_tokens(logits, s, positions, step, exclude_id=vocab - 1, gumbel_fp64=flags)
    for r in (0, 1, 2, 3, 15):
        one = dataclasses.replace(
            s, **{f: getattr(s, f)[r : r + 1] for f in ("temperature", "top_k", "top_p", "seed")}
        )
        alone = sample_tokens(logits[r : r + 1], one, positions[r : r + 1], step[r : r + 1],
                              exclude_id=vocab - 1, gumbel_fp64=flags[r : r + 1])  # fmt: skip
        assert torch.equal(alone.x0[0], full.x0[r])
        assert torch.equal(alone.confidence[0], full.confidence[r])
        assert torch.equal(alone.logprobs[0], full.logprobs[r])


def test_fixed_order_sum_tree_is_the_documented_one():
    """Halves added pairwise, an odd last entry carried up: for five entries
    ((x0 + x2) + (x1 + x3)) + x4, in float32, whatever the batch."""
    x = torch.tensor([[1e8, 1.0, -1e8, 3.0, 0.5], [0.1, 0.2, 0.3, 0.4, 0.5]])
    want = torch.stack([((r[0] + r[2]) + (r[1] + r[3])) + r[4] for r in x])
    assert torch.equal(fixed_order_sum(x), want)
