"""LLaDA2.1's joint threshold decoding: mask-to-token fills plus token-to-token edits."""

from __future__ import annotations

import torch

from dllm.algorithms.base import DenoiseInput, DenoiseOutput, UnmaskingAlgorithm
from dllm.algorithms.sampling import log_confidence, sample_tokens
from dllm.algorithms.selection import finish, masked_positions, select_top


class JointThreshold(UnmaskingAlgorithm):
    """Mask-to-token (M2T) above ``threshold`` plus token-to-token (T2T) edits above
    ``edit_threshold``, with a bounded edit phase after the block is filled.

    Reference: LLaDA2.1 ``generate`` (``threshold``, ``editing_threshold``,
    ``max_post_steps``, ``num_to_transfer=1``) and SGLang
    ``dllm/algorithm/joint_threshold.py``. Each step, with ``x0``/``conf`` the sampled
    token and its probability:

    * M2T: masked positions with ``conf > threshold``; if none, the most confident one.
    * T2T: positions that are editable (not prompt) and were not masked at the start of
      the step, where ``x0 != token`` and ``conf > edit_threshold``. Edits happen in the
      fill phase too, not only after it.
    * A step that starts with no mask left is a post-fill step and counts against the
      budget (state ``post_edit_steps``). The block is done after a fill step that leaves
      no mask when ``max_post_edit_steps == 0``; otherwise after the first post-fill step
      without an edit, or after the ``max_post_edit_steps``-th post-fill step.

    That is the reference's loop: a step that fills the last mask is always followed by
    one verifying forward (when the budget is at least 1), even if it made no edit.

    Keys: ``threshold`` (default 0.7), ``edit_threshold`` (default 0.5) — LLaDA2.1's
    quality mode — both floats in [0, 1] compared strictly; ``max_post_edit_steps``
    (int >= 0, default 16).

    Confidence: tempered, filtered softmax in float32; the mask token is never proposed.
    Ties for the guaranteed M2T token: lower position first.
    """

    name = "joint_threshold"
    defaults = {"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 16}
    state_keys = ("post_edit_steps",)
    edits = True

    def step(self, x: DenoiseInput) -> DenoiseOutput:
        masked = masked_positions(x)
        had_mask = masked.any(dim=-1)
        budget = x.config["max_post_edit_steps"]
        post_steps = x.state["post_edit_steps"] + (~had_mask).to(torch.int64)
        may_edit = had_mask | (post_steps <= budget)

        sample = sample_tokens(x.logits, x.sampling, x.positions, x.step, exclude_id=x.mask_id)
        conf = sample.confidence
        fill = masked & (conf > x.config["threshold"][:, None])
        fill |= select_top(log_confidence(sample), masked, torch.ones_like(x.step))
        generated = x.editable & (x.tokens != x.mask_id)
        edit = generated & (sample.x0 != x.tokens) & (conf > x.config["edit_threshold"][:, None])
        edit &= may_edit[:, None]

        filled_all = ~(masked & ~fill).any(dim=-1)
        done = torch.where(
            had_mask,
            filled_all & (budget == 0),
            ~edit.any(dim=-1) | (post_steps >= budget),
        )
        return finish(x, sample.x0, fill | edit, masked, done, {"post_edit_steps": post_steps},
                      confidence=conf)
