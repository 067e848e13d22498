"""The project's Triton kernels (DESIGN §8), one module each, each tested by
``tests/kernels/test_<module>.py``:

- ``skinny_gemm``: weight-streaming GEMM for at most 64 tokens, with the residual add +
  RMSNorm and SiLU-and-mul in its epilogues;
- ``wide_gemm``: tile GEMMs with the same epilogues from 512 tokens;
- ``fused_qkv``: the q/k head norms, RoPE and the KV-cache write of a layer in one launch;
- ``triton_extend``: paged attention for ``DLLM_EXTEND`` blocks and ``DECODE``;
- ``stage_kernel``: the device half of loading a replayed step's inputs;
- ``greedy_kernel``: the greedy draw and its confidence in one pass over the logits;
- ``dream_kernel``: Dream's greedy proposal, its probability and its entropy in four launches,
  and its schedule's transfer fraction in one;
- ``rng_kernel``: the counter-based ``position_uniform`` in one launch;
- ``moe_route``: MoE routing (sigmoid group-limited and softmax top-k) in one launch;
- ``fused_moe``: the routed experts as grouped GEMMs (token-expert pairs aligned to expert
  tiles, SiLU-and-mul and the routing weights in the epilogues, a fixed-order per-token sum).

Importing this package imports no Triton (CPU installs have none); each kernel module does, so
it is imported where Triton is installed only, through :func:`kernel_module`. ``settings``
(the environment knobs) and ``hardware`` (SM counts, per-device tables) import no Triton
either.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """The kernel module ``dllm.runner.kernels.<name>``, or None where Triton is missing."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        return None
