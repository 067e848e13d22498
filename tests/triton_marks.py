"""What the Triton kernel tests share: they are GPU tests (marker ``gpu``), and with
``TRITON_INTERPRET=1`` they also run on the CPU under Triton's interpreter (without the
marker: the conftest skips ``gpu`` tests where CUDA is missing)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
MARKS = ([] if INTERPRET else [pytest.mark.gpu]) + [
    pytest.mark.skipif(not HAVE_TRITON or not (torch.cuda.is_available() or INTERPRET),
                       reason="needs triton and a CUDA device (or TRITON_INTERPRET=1)"),
]
DEV = "cpu" if INTERPRET else "cuda"
