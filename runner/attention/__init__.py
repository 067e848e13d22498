"""Attention backends (DESIGN §8). FlashInfer is imported lazily; the CPU path never does."""

from __future__ import annotations

import importlib.util

import torch

from dllm.runner.attention.base import AttentionBackend
from dllm.runner.attention.sdpa import SDPABackend


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def triton_available() -> bool:
    """Whether the project's Triton kernels can run (CUDA builds of torch bring Triton)."""
    return importlib.util.find_spec("triton") is not None


# FlashInfer's kernels run half precision only.
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype) -> str:
    if name == "auto":
        return ("flashinfer" if device.type == "cuda" and dtype in FLASHINFER_DTYPES
                and flashinfer_available() else "sdpa")
    return name


def make_backend(name: str, device: torch.device, page_size: int,
                 dtype: torch.dtype) -> AttentionBackend:
    """``auto`` picks FlashInfer on CUDA for float16 / bfloat16 when it is installed, else
    SDPA."""
    name = resolve_backend_name(name, device, dtype)
    if name == "sdpa":
        return SDPABackend()
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"attention_backend='flashinfer' runs float16 and bfloat16 only, "
                             f"not {str(dtype).removeprefix('torch.')}: choose another dtype or "
                             "attention_backend 'sdpa'")
        if not flashinfer_available():
            raise ValueError("attention_backend='flashinfer' needs the 'gpu' extra "
                             "(pip install 'dllm[gpu]')")
        from dllm.runner.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(device, page_size)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, sdpa or flashinfer")
