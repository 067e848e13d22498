"""The environment knobs of the layer ops, typed and read once (DESIGN §12: small frozen
configs, no sprawl of flags).

Four switches stay, each turning off a fused path for a plain one that computes the same function
with the reference's rounding or control flow (a correctness fallback and a bisection aid, not a
speed choice):

- ``DLLM_MOE_GROUPED`` (``moe_grouped``, default on): MoE experts through the static-shape
  grouped GEMMs where the device and dtypes allow (``layer_ops.grouped_moe_enabled``); off, the
  per-expert loop, which reads the routing on the host and so runs eagerly (LLaDA2.0-mini eager
  on an H200: 140 ms a step at batch 1 and 1036 ms at batch 32 with the loop, 29 and 36 grouped;
  bench/NOTES.md, session 8).
- ``DLLM_FUSED_MOE`` (``fused_moe``, default on): MoE routing (the sigmoid group-limited top-k
  of LLaDA2 and Nemotron-H, the softmax top-k of the others) in one launch of
  ``dllm.runner.kernels.moe_route``, and where the grouped path is on the routed experts
  through ``dllm.runner.kernels.fused_moe`` (the pairs aligned to expert tiles, gate/up with
  SiLU-and-mul, down with the routing weights, and the per-token sum: five launches); off,
  the torch routers and ``StackedExperts.forward_grouped`` (``grouped_mm``), which round
  between their steps as the reference does.
- ``DLLM_FUSE_RESIDUAL`` (``fuse_residual``, default on): the residual add + RMSNorm in the
  skinny and wide GEMMs' epilogues; off, separate add + RMSNorm kernels, which round as the
  reference does (session 5 told a rounding flip from a bug with it).
- ``DLLM_FLA_SCAN`` (``fla_scan``, default on): the Mamba2 scan of long rows through fla-core's
  chunked kernel where fla-core is installed (``dllm.runner.kernels.ssm_scan``); off, the reference
  chunked scan in torch, which keeps float32 dots (fla's take TF32).

Values: ``1``/``true``/``on``/``yes`` or ``0``/``false``/``off``/``no`` (any case); unset or
empty keeps the default; anything else is an error. The knobs of the paths measured slower are
gone, their winners kept as the kernels' constants (bench/NOTES.md): ``DLLM_PDL`` (programmatic
dependent launch, sessions 5 and 6), ``DLLM_SKINNY_TRIGGER`` and ``DLLM_SKINNY_PREFETCH_MB``
(where and how much under PDL, session 6), ``DLLM_SKINNY_EVICT`` (the weights' L2 policy,
session 6), ``DLLM_WIDE_SILU_STAGES`` (the wide gate/up pipeline, session 8) and
``DLLM_WIDE_MIN_TOKENS`` (the wide GEMMs' row threshold, session 7).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def parse_switch(name: str, value: str | None, default: bool) -> bool:
    """The boolean of environment variable ``name`` set to ``value`` (None: unset)."""
    if value is None or not value.strip():
        return default
    v = value.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"{name}={value!r}: expected one of {', '.join(_ON + _OFF)}")


@dataclass(frozen=True)
class KernelSettings:
    moe_grouped: bool = True  # DLLM_MOE_GROUPED
    fused_moe: bool = True  # DLLM_FUSED_MOE
    fuse_residual: bool = True  # DLLM_FUSE_RESIDUAL
    fla_scan: bool = True  # DLLM_FLA_SCAN

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelSettings:
        """The settings from ``environ`` (default ``os.environ``); raises ``ValueError`` on a
        value that is not a switch."""
        env = os.environ if environ is None else environ
        return cls(**{f.name: parse_switch(env_name(f.name), env.get(env_name(f.name)),
                                           f.default)
                      for f in fields(cls)})


def env_name(field: str) -> str:
    """The environment variable of a ``KernelSettings`` field."""
    return f"DLLM_{field.upper()}"
