"""``dllm.runner.kernels.stage_kernel``: the one-launch carry gather and cache-slot lookup of a
batch of uniform rows equals the registry's torch path exactly, and ``InputRegistry.load``
takes it on CUDA (the same views as on the CPU).

GPU tests (marker ``gpu``). With ``TRITON_INTERPRET=1`` the kernel test also runs on the CPU
under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from dllm.runner.forward_batch import AttentionMask, ForwardMode, LogitsMode, ScheduledBatch
from dllm.runner.input_registry import InputRegistry
from tests.triton_marks import DEV, INTERPRET, MARKS

pytestmark = MARKS


@pytest.mark.parametrize("width,bs", [(4, 3), (1, 5), (32, 2), (5, 1)])
@pytest.mark.parametrize("column_view", [False, True])
def test_stage_rows_equals_torch(width, bs, column_view):
    from dllm.runner.kernels.stage_kernel import stage_rows

    g = torch.Generator().manual_seed(width * 10 + bs)
    table = torch.randperm(8 * 256, generator=g).view(8, 256)
    req = torch.randint(0, 8, (bs,), generator=g)
    pos = torch.randint(0, 256, (bs * width,), generator=g)
    ids = torch.randint(0, 1000, (bs * width + 3,), generator=g)
    carry = torch.randint(0, 1000, (6, width + 2), generator=g)
    carry = carry[:, 1 : width + 1] if column_view else carry[:, :width].contiguous()
    rows = torch.tensor([-1, 2, 5, 0, -1][:bs])
    want_ids = ids.clone()
    view = want_ids[: bs * width].view(bs, width)
    view.copy_(torch.where((rows >= 0)[:, None], carry[rows.clamp(min=0)], view))
    want_loc = table[req.repeat_interleave(width), pos]
    loc = torch.full((bs * width + 3,), -7, dtype=torch.int64)
    args = [t.to(DEV) for t in (ids, pos, req, table, loc, carry, rows)]
    stage_rows(bs, width, *args)
    assert torch.equal(args[0].cpu(), want_ids)
    assert torch.equal(args[4][: bs * width].cpu(), want_loc)
    assert (args[4][bs * width :] == -7).all()  # nothing past the rows written


@pytest.mark.skipif(INTERPRET, reason="the registry takes the kernel on CUDA only")
def test_registry_load_on_cuda_equals_cpu():
    """A carried batch of whole blocks loads to the same values on CUDA (one Triton launch)
    as on the CPU (the torch path)."""
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(4 * 64, generator=g).view(4, 64)
    carry = torch.randint(0, 100, (3, 4), generator=g)
    outs = []
    for dev in ("cpu", "cuda"):
        batch = ScheduledBatch(ForwardMode.DLLM_EXTEND, attention_mask=AttentionMask.BLOCK_CAUSAL,
                               block_size=4, logits_mode=LogitsMode.ALL)
        for i, (r, p) in enumerate([(1, 8), (3, 20), (2, 0)]):
            batch.add_row(f"r{i}", r, [11, 12, 13, 14], p)
        batch.carry = carry.to(dev)
        batch.row_inputs["carry_row"] = [2, -1, 0]
        reg = InputRegistry(4, 16, torch.device(dev))
        fb = reg.load(batch, table.to(dev), padded_bs=4, padded_tokens=16)
        outs.append({k: getattr(fb, k).cpu() for k in ("input_ids", "positions",
                                                       "out_cache_loc", "req_pool_indices")})
    for k in outs[0]:
        assert torch.equal(outs[0][k], outs[1][k]), k
    assert outs[1]["input_ids"][:4].tolist() == carry[2].tolist()
    assert outs[1]["input_ids"][4:8].tolist() == [11, 12, 13, 14]
