"""Mamba2's SSM scan through fla-core's chunked kernel for long rows on CUDA (an optional
dependency, like FlashInfer: the ``gpu`` extra installs it; pure Triton).

The scan of ``dllm.models.mamba2`` is, per head, a gated linear attention with a scalar gate:
``chunk_simple_gla`` with queries ``C``, keys ``B`` (both expanded from groups to heads),
values ``dt·x``, log gates ``dt·A`` and scale 1, from the row's state ``h0 [H, P, N]`` (fla's
``state_v_first`` layout, values first), plus ``D·x``. The reference ``ssd_scan`` walks a long
row in chunks of ``chunk_size`` from Python, each chunk several einsums; fla's kernels run the
whole row in a few launches. Rows shorter than ``MIN_TOKENS`` (every denoise step and commit
of block diffusion, decode, the steps CUDA graphs capture) keep the reference. fla's dots take
TF32 for float32 inputs, so its results equal the reference's within TF32 rounding, not
bitwise (``tests/test_gpu.py::test_fla_scan_equals_the_reference_scan``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dllm.models.mamba2 import Mamba2Mixer, per_head
from dllm.models.ops import LayerOps

# Rows of at least this many tokens go through fla (longer than the batched block-diffusion
# rows, ``mamba2.BATCHED_ROW_TOKENS``, which the captured steps run).
MIN_TOKENS = 128


@functools.cache
def fla_available() -> bool:
    """Whether fla-core's ``chunk_simple_gla`` imports (it needs Triton and a GPU)."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: F401
    except Exception:  # ImportError, or Triton failing to find a driver
        return False
    return True


def fla_ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 c: torch.Tensor, d: torch.Tensor, h0: torch.Tensor,
                 group_heads: tuple[int, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ssd_scan``'s function (its arguments but ``chunk_size``, its results) by
    ``chunk_simple_gla``: ``x [R, T, H, P]``, ``dt [R, T, H]`` (discretized), ``a [H]``,
    ``b, c [R, T, G, N]``, ``d [H]``, ``h0 [R, H, P, N]``."""
    from fla.ops.simple_gla import chunk_simple_gla

    heads = x.shape[2]
    x = x.float()
    dt = dt.float()
    b = per_head(b.float(), heads, group_heads, 2).contiguous()
    c = per_head(c.float(), heads, group_heads, 2).contiguous()
    y, h = chunk_simple_gla(c, b, (x * dt[..., None]).contiguous(),
                            g=(dt * a.float()).contiguous(), scale=1.0,
                            initial_state=h0.float().contiguous(), output_final_state=True,
                            state_v_first=True)
    return y.float() + x * d.float()[:, None], h.float()


class FlaScanOps(LayerOps):
    """The reference ops with fla's scan for the long rows of a model's Mamba2 mixers, on
    CUDA where fla-core is installed (``enabled``: ``KernelSettings.fla_scan``, i.e.
    ``DLLM_FLA_SCAN``). ``FlashInferOps`` builds on it; a CUDA model without FlashInfer's
    kernels (float32 weights: FlashInfer runs half precision only) installs it alone."""

    def __init__(self, model: nn.Module, enabled: bool = True, grouped_moe: bool = False):
        super().__init__(grouped_moe=grouped_moe)
        self.fla_scan = (enabled and any(isinstance(m, Mamba2Mixer) for m in model.modules())
                         and fla_available())

    def ssm_scan(self, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 c: torch.Tensor, d: torch.Tensor, h0: torch.Tensor, chunk_size: int,
                 group_heads: tuple[int, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fla_scan and x.is_cuda and x.shape[1] >= MIN_TOKENS:
            return fla_ssd_scan(x, dt, a, b, c, d, h0, group_heads)
        return super().ssm_scan(x, dt, a, b, c, d, h0, chunk_size, group_heads)
