"""Fast-dLLM v2 (``Fast_dLLM_QwenForCausalLM``): the Qwen2.5 network run block-causally with
sub-blocks; block size in ``bd_size``. Logits are shifted by one (done by the runner)."""

from __future__ import annotations

from dllm.models.qwen2 import Qwen2ForCausalLM


class Fast_dLLM_QwenForCausalLM(Qwen2ForCausalLM):  # noqa: N801 - the checkpoint's class name
    pass
