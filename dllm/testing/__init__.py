"""Test support: tiny checkpoints (``make_tiny_checkpoint``) and direct model runs
(``dllm.testing.harness``)."""

from dllm.testing.factory import make_tiny_checkpoint, supported_architectures

__all__ = ["make_tiny_checkpoint", "supported_architectures"]
