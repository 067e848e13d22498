from __future__ import annotations

import pytest
import torch

from dllm.testing import make_tiny_checkpoint


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sdar_dir(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("SDARForCausalLM", tmp_path_factory.mktemp("sdar"), seed=0))


def pytest_configure(config):
    # The test models are tiny: intra-op threads only add contention (and on a busy
    # two-core machine make each forward ~100x slower).
    torch.set_num_threads(1)
