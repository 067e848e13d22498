"""``dllm.runner.kernels.dream_kernel``: Dream's greedy proposal, its probability and its
negative entropy from the logits, against the reference path (``dream_probs``, ``argmax``,
``vocab_parallel.neg_entropy``) and against float64; each row's bits independent of the
batch; and Dream's algorithms take it on CUDA with the reference's tokens.

GPU tests (marker ``gpu``). With ``TRITON_INTERPRET=1`` they also run on the CPU under Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch

from dllm.algorithms import dream, get_algorithm, vocab_parallel
from dllm.algorithms.base import DenoiseInput, SamplingTensors
from tests.triton_marks import DEV, INTERPRET, MARKS

pytestmark = MARKS

DREAM_V = 152064  # Dream's (Qwen2.5's padded) vocabulary: 16 slices of 9504, ragged chunks


def greedy(bs: int, dev) -> SamplingTensors:
    z = torch.zeros(bs, device=dev)
    return SamplingTensors(z, z.long(), z + 1, z.long(), may_sample=False, may_filter=False,
                           may_filter_any=False)


def logits_case(vocab: int, dev) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(vocab)
    x = (torch.randn(3, 4, vocab, generator=g, device=dev) * 3).bfloat16()
    x[0, 0, 5] = 40.0  # a confidence of 1 - tiny, an entropy near 0
    x[0, 1] = 1.0  # all tied: the first id, p = 1 / V, the largest entropy
    x[1, 0, vocab // 3] = x[1, 0, vocab - 2] = 30.0  # a tie across slices: the lower id
    x[1, 1, -1] = 30.0  # the last id
    x[2, 2, : vocab // 2] = float("-inf")  # half the vocabulary impossible
    return x


def reference(x: torch.Tensor):
    probs = dream.dream_probs(x, greedy(x.shape[0], x.device))
    x0 = probs.argmax(dim=-1)
    return x0, vocab_parallel.prob_of(probs, x0), vocab_parallel.neg_entropy(probs)


def float64_values(x: torch.Tensor):
    p = torch.softmax(x.double(), dim=-1)
    return p.max(dim=-1).values, (p * torch.log(p + 1e-10)).sum(dim=-1)


@pytest.mark.parametrize("vocab", [DREAM_V, 151936, 1000])
def test_kernel_matches_the_reference_path(vocab):
    from dllm.runner.kernels import dream_kernel

    x = logits_case(vocab, DEV)
    assert dream_kernel.supports(x)
    x0, top, negent = dream_kernel.dream_greedy(x, entropy=True)
    ref_x0, ref_top, ref_negent = reference(x)
    assert x0.dtype == torch.int64 and torch.equal(x0, ref_x0)
    assert x0[0, 0].item() == 5 and x0[0, 1].item() == 0
    assert x0[1, 0].item() == vocab // 3 and x0[1, 1].item() == vocab - 1
    assert x0[2, 2].item() >= vocab // 2
    torch.testing.assert_close(top, ref_top, rtol=1e-5, atol=0)
    # a peaked row's entropy is about log(p(x0)) with p(x0) near 1, whose float32 rounding
    # is absolute: a few ulp of 1.0 (1.2e-7)
    torch.testing.assert_close(negent, ref_negent, rtol=1e-5, atol=5e-7)
    # and against float64 (the reference's own rounding is float32's)
    exact_top, exact_negent = float64_values(x)
    torch.testing.assert_close(top.double(), exact_top, rtol=1e-6, atol=0)
    torch.testing.assert_close(negent.double(), exact_negent, rtol=1e-6, atol=5e-7)
    # the all-tied row's s is V exactly (order-free): p(x0) is float32's 1 / V bit for bit
    assert top[0, 1] == torch.tensor(1.0) / torch.tensor(float(vocab))
    assert -1e-6 < negent[0, 0].item() <= 0


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's inf - inf
def test_rows_without_a_finite_softmax_give_id_0_and_nan():
    """A NaN or +inf logit, or no finite one: every reference probability is NaN, its argmax
    the first (id 0); never an id outside the vocabulary."""
    from dllm.runner.kernels import dream_kernel

    x = logits_case(DREAM_V, DEV)[:1].clone()
    x[0, 0, 1234] = float("nan")
    x[0, 1, 777] = float("inf")
    x[0, 2] = float("-inf")
    x0, top, negent = dream_kernel.dream_greedy(x, entropy=True)
    ref_x0, ref_top, ref_negent = reference(x)
    assert torch.equal(x0, ref_x0) and x0[0, :3].tolist() == [0, 0, 0]
    assert top[0, :3].isnan().all() and negent[0, :3].isnan().all()
    assert ref_top[0, :3].isnan().all() and ref_negent[0, :3].isnan().all()
    assert torch.isfinite(top[0, 3]) and x0[0, 3] == ref_x0[0, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_rows_and_other_dtypes(dtype):
    from dllm.runner.kernels import dream_kernel

    vocab = 5000
    g = torch.Generator(device=DEV).manual_seed(3)
    wide = (torch.randn(2, 3, vocab + 37, generator=g, device=DEV) * 3).to(dtype)
    x = wide[..., :vocab]  # a row stride of vocab + 37
    assert dream_kernel.supports(x) and not x.is_contiguous()
    x0, top, negent = dream_kernel.dream_greedy(x, entropy=True)
    ref_x0, ref_top, ref_negent = reference(x.contiguous())
    assert torch.equal(x0, ref_x0)
    torch.testing.assert_close(top, ref_top, rtol=1e-5, atol=0)
    torch.testing.assert_close(negent, ref_negent, rtol=1e-5, atol=5e-7)


def test_rows_are_independent_of_the_batch_and_entropy_is_optional():
    from dllm.runner.kernels import dream_kernel

    x = logits_case(DREAM_V, DEV)
    x0, top, negent = dream_kernel.dream_greedy(x, entropy=True)
    for r in range(x.shape[0]):
        a0, atop, aneg = dream_kernel.dream_greedy(x[r:r + 1].clone(), entropy=True)
        assert torch.equal(a0[0], x0[r]) and torch.equal(atop[0], top[r])
        assert torch.equal(aneg[0], negent[r])
    b0, btop, bneg = dream_kernel.dream_greedy(x, entropy=False)
    assert bneg is None and torch.equal(b0, x0) and torch.equal(btop, top)
    again = dream_kernel.dream_greedy(x, entropy=True)
    assert torch.equal(again[2], negent)
    empty = dream_kernel.dream_greedy(x[:0], entropy=True)
    assert empty[0].shape == (0, 4) and empty[2].shape == (0, 4)


def step_input(algo, logits: torch.Tensor, mask_id: int, config: dict) -> DenoiseInput:
    bs, block, _ = logits.shape
    dev = logits.device
    g = torch.Generator().manual_seed(block)
    tokens = torch.randint(0, mask_id, (bs, block), generator=g)
    tokens[torch.rand(bs, block, generator=g) < 0.7] = mask_id
    tokens = tokens.to(dev)
    return DenoiseInput(
        logits=logits, tokens=tokens, editable=torch.ones_like(tokens, dtype=torch.bool),
        mask_id=mask_id, step=torch.tensor([0, 1, 2][:bs], device=dev),
        num_initial_masks=torch.full((bs,), block, device=dev),
        positions=torch.arange(block, device=dev).expand(bs, block), sampling=greedy(bs, dev),
        config=algo.stack_configs([algo.validate(config, block)] * bs, dev),
        state=algo.init_state(bs, dev))


@pytest.mark.skipif(INTERPRET, reason="the dispatch in dream._greedy_kernel is CUDA-only")
@pytest.mark.parametrize("name,config", [("entropy", {"steps": 4}),
                                         ("maskgit_plus", {"steps": 4}),
                                         ("origin", {"steps": 4}),
                                         ("confidence_threshold", {"steps": 2,
                                                                   "threshold": 0.5})])
def test_dream_algorithms_take_the_kernel_on_cuda(name, config):
    """The CUDA step (the kernel) against the CPU step (the reference path) on the same
    bfloat16 logits: the same tokens, confidences within float32 rounding."""
    algo = get_algorithm(name)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 8, DREAM_V, generator=g) * 2).bfloat16()
    mask_id = DREAM_V - 100  # a token like any other: the reference may propose it
    cuda = step_input(algo, logits.cuda(), mask_id, config)
    assert dream._greedy_kernel(cuda, entropy=name == "entropy") is not None
    got = algo.step(cuda)
    want = algo.step(step_input(algo, logits, mask_id, config))
    assert torch.equal(got.tokens.cpu(), want.tokens)
    assert torch.equal(got.done.cpu(), want.done)
    conf = got.confidence() if callable(got.confidence) else got.confidence
    ref = want.confidence() if callable(want.confidence) else want.confidence
    torch.testing.assert_close(conf.cpu(), ref, rtol=1e-5, atol=5e-7)


def test_schedule_kernel_equals_the_torch_schedule_bit_for_bit():
    """``dream_schedule`` against ``transfer_fraction``'s torch path for every step of every
    schedule up to 96 steps and a few long ones (and past each schedule's end)."""
    from dllm.runner.kernels import dream_kernel

    pairs = [(i, n) for n in [*range(1, 97), 255, 256, 1000, 1024] for i in range(n + 2)]
    step = torch.tensor([i for i, _ in pairs])
    steps = torch.tensor([n for _, n in pairs], dtype=torch.int32)  # either int width loads

    bs = len(pairs)
    tokens = torch.zeros(bs, 1, dtype=torch.int64)
    x = DenoiseInput(logits=torch.zeros(bs, 1, 2), tokens=tokens, editable=tokens == 0,
                     mask_id=1, step=step, num_initial_masks=steps, positions=tokens,
                     sampling=greedy(bs, "cpu"), config={"steps": steps}, state={})
    want_frac, want_last = dream.transfer_fraction(x)  # on the CPU: the torch path
    frac, last = dream_kernel.dream_schedule(step.to(DEV), steps.to(DEV), dream._SPAN,
                                             dream._END)
    assert frac.dtype == torch.float32 and last.dtype == torch.bool
    assert torch.equal(frac.cpu(), want_frac) and torch.equal(last.cpu(), want_last)
    assert (frac[step.to(DEV) >= steps.to(DEV)] == 0).all()
