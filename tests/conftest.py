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


@pytest.fixture(scope="session", autouse=True)
def _refvector_checkpoints(tmp_path_factory) -> None:
    """Where ``tests/refvector_replay.py`` builds the reference vectors' checkpoints."""
    from tests.refvector_replay import set_checkpoint_root

    set_checkpoint_root(tmp_path_factory.mktemp("refvector-checkpoints"))
