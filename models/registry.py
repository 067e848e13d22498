"""The explicit architecture registry: ``architectures[0]`` of ``config.json`` → model class and
the serving facts of that family (DESIGN §4). Dispatch never looks at ``model_type``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from dllm.models.bamba import BambaForCausalLM
from dllm.models.dream import DreamModel
from dllm.models.fast_dllm import Fast_dLLM_QwenForCausalLM
from dllm.models.granite_hybrid import GraniteMoeHybridForCausalLM
from dllm.models.llada import LLaDAModelLM
from dllm.models.llada2 import LLaDA2MoeModelLM
from dllm.models.llada_moe import LLaDAMoEModelLM
from dllm.models.llama import LlamaForCausalLM
from dllm.models.mamba2_lm import Mamba2ForCausalLM
from dllm.models.nemotron_h import NemotronHForCausalLM
from dllm.models.qwen2 import Qwen2ForCausalLM
from dllm.models.qwen3 import Qwen3ForCausalLM
from dllm.models.sdar import SDARForCausalLM
from dllm.models.sdar_moe import SDARMoeForCausalLM

BLOCK_DIFFUSION_GRANITE_HYBRID = "GraniteMoeHybridForBlockDiffusion"

ModelKind = Literal["block_diffusion", "full_diffusion", "causal_lm"]
AttentionKind = Literal["block_causal", "full", "causal"]


@dataclass(frozen=True)
class ArchitectureSpec:
    """What the engine needs to know about one architecture besides its network.

    ``default_mask_id``/``default_block_size`` are the last resort of the resolution order of
    DESIGN §4 (engine argument → ``config.json`` → tokenizer → default). ``block_size_keys`` are
    the ``config.json`` keys that may carry the block size, in order. ``logits_shift`` is 1 when
    the logits that predict position ``p`` come out at position ``p - 1`` (AR-initialised models:
    the runner shifts them, the model never does), else 0. ``default_sub_block_size`` is
    Fast-dLLM v2's sub-block. ``mask_token_strings`` are the mask tokens the tokenizer lookup
    tries. ``turn_end_tokens`` end a generation besides the checkpoint's EOS ids: the token
    that closes an assistant turn in the family's chat template, which the released
    ``generation_config.json`` does not always list (LLaDA's ``<|eot_id|>``, LLaDA2's
    ``<|role_end|>``). ``default_algorithm`` and ``algorithm_config`` (key, value pairs) are
    the family's reference decoder, used when neither the engine nor
    ``generation_config.json`` names one. ``canvas_block_size``: a full-attention family's
    block when neither the request, the engine nor ``config.json`` sets one (None: the whole
    canvas). ``recurrent_state``: the network has Mamba2 layers, whose per-request state lives
    in the runner's state pool (the hybrid models, DESIGN §6)."""

    name: str
    model_cls: type[nn.Module]
    kind: ModelKind
    attention: AttentionKind
    default_mask_id: int | None = None
    default_block_size: int | None = None
    logits_shift: int = 0
    default_sub_block_size: int | None = None
    mask_token_strings: tuple[str, ...] = ()
    block_size_keys: tuple[str, ...] = ("block_size",)
    turn_end_tokens: tuple[str, ...] = ()
    default_algorithm: str | None = None
    algorithm_config: tuple[tuple[str, object], ...] = ()
    canvas_block_size: int | None = None
    recurrent_state: bool = False

    @property
    def is_diffusion(self) -> bool:
        return self.kind != "causal_lm"


# LLaDA's generate: fixed quota, float64 Gumbel noise (``gumbel_fp64``), every scheduled step
# of a block run, zero-token steps included (``all_steps``), blocks of 32 (its demo and
# evaluation setting).
_LLADA_DECODER: dict = {
    "default_algorithm": "low_confidence_static",
    "algorithm_config": (("gumbel_fp64", True), ("all_steps", True)),
    "canvas_block_size": 32,
}

_SPECS = (
    ArchitectureSpec("SDARForCausalLM", SDARForCausalLM, "block_diffusion", "block_causal",
                     default_mask_id=151669, default_block_size=4,
                     mask_token_strings=("<|MASK|>",), turn_end_tokens=("<|im_end|>",),
                     default_algorithm="low_confidence_dynamic"),
    ArchitectureSpec("SDARMoeForCausalLM", SDARMoeForCausalLM, "block_diffusion", "block_causal",
                     default_mask_id=151669, default_block_size=4,
                     mask_token_strings=("<|MASK|>",), turn_end_tokens=("<|im_end|>",),
                     default_algorithm="low_confidence_dynamic"),
    ArchitectureSpec("LLaDA2MoeModelLM", LLaDA2MoeModelLM, "block_diffusion", "block_causal",
                     default_mask_id=156895, default_block_size=32,
                     mask_token_strings=("<|mask|>",), turn_end_tokens=("<|role_end|>",),
                     default_algorithm="low_confidence_dynamic"),
    ArchitectureSpec("Fast_dLLM_QwenForCausalLM", Fast_dLLM_QwenForCausalLM, "block_diffusion",
                     "block_causal", default_mask_id=151665, default_block_size=32,
                     logits_shift=1, default_sub_block_size=8,
                     mask_token_strings=("|<MASK>|",), block_size_keys=("bd_size", "block_size"),
                     turn_end_tokens=("<|im_end|>",), default_algorithm="hierarchical"),
    ArchitectureSpec("LLaDAModelLM", LLaDAModelLM, "full_diffusion", "full",
                     default_mask_id=126336, mask_token_strings=("<|mdm_mask|>",),
                     turn_end_tokens=("<|eot_id|>",), **_LLADA_DECODER),
    ArchitectureSpec("LLaDAMoEModelLM", LLaDAMoEModelLM, "full_diffusion", "full",
                     default_mask_id=156895, mask_token_strings=("<|mask|>",),
                     turn_end_tokens=("<|role_end|>",), **_LLADA_DECODER),
    ArchitectureSpec("DreamModel", DreamModel, "full_diffusion", "full",
                     default_mask_id=151666, logits_shift=1, mask_token_strings=("<|mask|>",),
                     turn_end_tokens=("<|im_end|>",), default_algorithm="entropy"),
    ArchitectureSpec("Qwen3ForCausalLM", Qwen3ForCausalLM, "causal_lm", "causal", logits_shift=1),
    ArchitectureSpec("Qwen2ForCausalLM", Qwen2ForCausalLM, "causal_lm", "causal", logits_shift=1),
    ArchitectureSpec("LlamaForCausalLM", LlamaForCausalLM, "causal_lm", "causal", logits_shift=1),
    # Hybrid Mamba2 + attention (and pure Mamba2), autoregressive over the state pool.
    ArchitectureSpec("GraniteMoeHybridForCausalLM", GraniteMoeHybridForCausalLM, "causal_lm",
                     "causal", logits_shift=1, recurrent_state=True),
    # A Granite-H network trained for block diffusion (no such model is released: dllm's own
    # ``builtin-hybrid`` is one). ``config.json`` is a GraniteMoeHybrid config (same keys,
    # same tensor names) whose ``architectures[0]`` is this name, plus ``mask_token_id`` and
    # ``block_size``; blocks are block-causal for attention and causal inside the SSM.
    ArchitectureSpec(BLOCK_DIFFUSION_GRANITE_HYBRID, GraniteMoeHybridForCausalLM,
                     "block_diffusion", "block_causal", default_block_size=8,
                     mask_token_strings=("<|MASK|>",), turn_end_tokens=("<|im_end|>",),
                     default_algorithm="low_confidence_dynamic", recurrent_state=True),
    ArchitectureSpec("BambaForCausalLM", BambaForCausalLM, "causal_lm", "causal",
                     logits_shift=1, recurrent_state=True),
    ArchitectureSpec("NemotronHForCausalLM", NemotronHForCausalLM, "causal_lm", "causal",
                     logits_shift=1, recurrent_state=True),
    ArchitectureSpec("Mamba2ForCausalLM", Mamba2ForCausalLM, "causal_lm", "causal",
                     logits_shift=1, recurrent_state=True),
)

ARCHITECTURES: dict[str, ArchitectureSpec] = {spec.name: spec for spec in _SPECS}


def get_architecture(name: str) -> ArchitectureSpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
