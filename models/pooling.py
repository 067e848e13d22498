"""Pooled embeddings: the sentence-transformers pooling rules, read from the checkpoint."""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PoolingType(str, enum.Enum):
    LAST = "last"  # the last token's hidden state (decoder embedders, e.g. Qwen3-Embedding)
    MEAN = "mean"  # the mean over all tokens
    CLS = "cls"  # the first token's hidden state


@dataclass(frozen=True)
class PoolingConfig:
    pooling: PoolingType = PoolingType.LAST
    normalize: bool = False

    @classmethod
    def from_checkpoint(cls, path: str, default: PoolingType = PoolingType.LAST
                        ) -> PoolingConfig:
        """``1_Pooling/config.json`` (or the folder ``modules.json`` names) decides the
        pooling; a ``Normalize`` module in ``modules.json`` turns on L2 normalisation."""
        modules = _read(os.path.join(path, "modules.json")) or []
        pooling_dir = next((m.get("path") for m in modules
                            if str(m.get("type", "")).endswith("Pooling")), "1_Pooling")
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        cfg = _read(os.path.join(path, pooling_dir or "1_Pooling", "config.json")) or {}
        pooling = default
        if cfg.get("pooling_mode_lasttoken"):
            pooling = PoolingType.LAST
        elif cfg.get("pooling_mode_mean_tokens"):
            pooling = PoolingType.MEAN
        elif cfg.get("pooling_mode_cls_token"):
            pooling = PoolingType.CLS
        return cls(pooling, normalize)

    @staticmethod
    def is_sentence_transformers(path: str) -> bool:
        return os.path.isfile(os.path.join(path, "modules.json"))


def _read(path: str):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def finish_embedding(pooled: torch.Tensor, normalize: bool,
                     dimensions: int | None = None) -> torch.Tensor:
    """Matryoshka truncation first, then L2 normalisation (so the short vector is unit)."""
    if dimensions is not None:
        pooled = pooled[..., :dimensions]
    if normalize:
        pooled = F.normalize(pooled.float(), p=2, dim=-1)
    return pooled
