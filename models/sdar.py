"""SDAR / TraDo (``SDARForCausalLM``): the Qwen3 network trained for block diffusion.

Nothing in the network differs from Qwen3; inside a block attention is bidirectional, which is
the batch's ``BLOCK_CAUSAL`` mask, chosen by the runner."""

from __future__ import annotations

from dllm.models.qwen3 import Qwen3ForCausalLM


class SDARForCausalLM(Qwen3ForCausalLM):
    pass
