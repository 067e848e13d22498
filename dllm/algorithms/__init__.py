"""Unmasking algorithms: the registry.

Each algorithm is a pure tensor step (see :mod:`dllm.algorithms.base`); requests pick one
by name and may override its keys through the ``dllm`` field of the request.
"""

from __future__ import annotations

from dllm.algorithms.base import (
    KNOWN_KEYS,
    DenoiseInput,
    DenoiseOutput,
    SamplingTensors,
    UnmaskingAlgorithm,
)
from dllm.algorithms.dream import (
    DreamConfidenceThreshold,
    DreamEntropy,
    DreamMaskGitPlus,
    DreamOrigin,
    DreamTopkMargin,
)
from dllm.algorithms.entropy_bounded import EntropyBounded
from dllm.algorithms.hierarchical import Hierarchical
from dllm.algorithms.joint_threshold import JointThreshold
from dllm.algorithms.low_confidence import LowConfidenceDynamic, LowConfidenceStatic, Sequential
from dllm.algorithms.sampling import SampleOutput, sample_tokens
from dllm.algorithms.threshold import Factor, Threshold

ALGORITHMS: dict[str, type[UnmaskingAlgorithm]] = {
    cls.name: cls
    for cls in (
        LowConfidenceStatic,
        LowConfidenceDynamic,
        Sequential,
        Threshold,
        JointThreshold,
        EntropyBounded,
        DreamOrigin,
        DreamMaskGitPlus,
        DreamTopkMargin,
        DreamEntropy,
        DreamConfidenceThreshold,
        Factor,
        Hierarchical,
    )
}


def get_algorithm(name: str) -> UnmaskingAlgorithm:
    """A fresh instance of the algorithm registered as ``name``."""
    try:
        return ALGORITHMS[name]()
    except KeyError:
        raise ValueError(
            f"unknown unmasking algorithm {name!r}; available: {sorted(ALGORITHMS)}"
        ) from None


__all__ = [
    "ALGORITHMS",
    "KNOWN_KEYS",
    "DenoiseInput",
    "DenoiseOutput",
    "SampleOutput",
    "SamplingTensors",
    "UnmaskingAlgorithm",
    "get_algorithm",
    "sample_tokens",
]
