"""Dream (``DreamModel``): the Qwen2 network (q/k/v biases) trained as a full-attention
diffusion model. Logits are shifted by one (the runner shifts them; registry ``logits_shift``)."""

from __future__ import annotations

from dllm.models.qwen2 import Qwen2ForCausalLM


class DreamModel(Qwen2ForCausalLM):
    pass
