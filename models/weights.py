"""Checkpoint tensor names → model parameter names, as data.

Each model class lists ``WeightRule``s. The first rule whose ``pattern`` fully matches a
checkpoint name decides: ``target`` (a ``re.Match.expand`` template) names the parameter, or
``None`` skips the tensor; ``stack`` names the pattern group that indexes the leading axis of a
stacked parameter (per-expert tensors → one ``[E, ...]`` tensor). A name no rule matches maps to
itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class WeightRule:
    pattern: str
    target: str | None
    stack: str | None = None

    @cached_property
    def regex(self) -> re.Pattern[str]:
        return re.compile(self.pattern)


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: parameter ``name``, and ``index`` on the stacked axis."""

    name: str
    index: int | None = None


def resolve_weight(rules: tuple[WeightRule, ...], checkpoint_name: str) -> WeightTarget | None:
    """The target of ``checkpoint_name``, or ``None`` when a rule says to skip it."""
    for rule in rules:
        m = rule.regex.fullmatch(checkpoint_name)
        if m is None:
            continue
        if rule.target is None:
            return None
        index = int(m.group(rule.stack)) if rule.stack is not None else None
        return WeightTarget(m.expand(rule.target), index)
    return WeightTarget(checkpoint_name)


# Rules shared by the HF-named families.
SKIP_ROTARY = WeightRule(r".*\.rotary_emb\.inv_freq", None)
SKIP_TIED_HEAD = WeightRule(r"lm_head\.weight", None)

# ``model.layers.{l}.mlp.experts.{e}.{proj}.weight`` → ``model.layers.{l}.mlp.experts.{proj}[e]``
STACK_EXPERTS = WeightRule(
    r"model\.layers\.(?P<l>\d+)\.mlp\.experts\.(?P<e>\d+)\."
    r"(?P<p>gate_proj|up_proj|down_proj)\.weight",
    r"model.layers.\g<l>.mlp.experts.\g<p>",
    stack="e",
)
