from __future__ import annotations

import gc
import os

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


_PAGE = os.sysconf("SC_PAGE_SIZE")
COLLECT_ABOVE_BYTES = 2 * 2**30


@pytest.fixture(autouse=True)
def _free_dead_engines():
    """An engine lives in reference cycles (its scheduler's callbacks hold it), so one a test
    dropped is freed only by the cyclic collector, which counts Python objects, not the
    gigabytes of KV cache they hold: collect after a test once the process is large, so the
    suite's memory stays that of the engines still in use."""
    yield
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * _PAGE
    if rss > COLLECT_ABOVE_BYTES:
        gc.collect()
