"""What the kernels take from the device they run on: its SM count and compute capability,
each read once per device (a CUDA device named without an index: the current device when first
asked), and the lookup of per-device tuning tables.

A tuning table (the skinny GEMM's tiles, say) is keyed by compute capability. Every table
was measured on one device, the reference below: a device whose capability has no entry of its
own takes the reference's (as every device did before the tables were keyed), and so do CPU
tensors under Triton's interpreter, which have no device to ask.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    capability: tuple[int, int]
    num_sms: int


# The device the tables were measured on (bench/NOTES.md); its SM count serves only where no
# CUDA device answers.
REFERENCE = DeviceSpec("NVIDIA H200", (9, 0), 132)


def _cuda(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a CUDA device with its index, or None if it is not one."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


@functools.cache
def _properties(device: torch.device):
    return torch.cuda.get_device_properties(device)


# Cached per argument as well: the GEMMs ask on every launch (eager steps pay for Python).
@functools.cache
def num_sms(device: torch.device | str | None) -> int:
    """Streaming multiprocessors of a CUDA device (the reference's for anything else)."""
    cuda = _cuda(device)
    return REFERENCE.num_sms if cuda is None else _properties(cuda).multi_processor_count


@functools.cache
def capability(device: torch.device | str | None) -> tuple[int, int]:
    """Compute capability of a CUDA device (the reference's for anything else)."""
    cuda = _cuda(device)
    if cuda is None:
        return REFERENCE.capability
    p = _properties(cuda)
    return (p.major, p.minor)


def tuned(table: Mapping[tuple[int, int], T], device: torch.device | str | None) -> T:
    """``table``'s entry for ``device``'s compute capability, else the reference's."""
    entry = table.get(capability(device))
    return entry if entry is not None else table[REFERENCE.capability]
