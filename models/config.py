"""A checkpoint's ``config.json``, read as plain data.

Models read their hyperparameters from a ``ModelConfig``: attribute access for keys that must be
there (``config.hidden_size``) and typed getters with defaults for keys that vary between
releases (``config.get_int("head_dim", hidden // heads)``). It never changes after loading.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

_MISSING: Any = object()


class ModelConfig(Mapping[str, Any]):
    """Read-only view of a parsed ``config.json``."""

    __slots__ = ("_data", "_source")

    def __init__(self, data: Mapping[str, Any], source: str | None = None):
        object.__setattr__(self, "_data", dict(data))
        object.__setattr__(self, "_source", source or "config")

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read ``path`` (a ``config.json`` or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        return cls(data, str(path))

    # -- mapping protocol -------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        try:
            return self._data[key]
        except KeyError:
            raise AttributeError(f"{self._source} has no key {key!r}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("ModelConfig is read-only")

    def __repr__(self) -> str:
        return f"ModelConfig({self.architecture!r}, {len(self._data)} keys)"

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)

    # -- typed getters ------------------------------------------------------------------------
    def _value(self, key: str, default: Any) -> Any:
        value = self._data.get(key)
        if value is None:  # absent, or JSON null: both mean "use the default"
            if default is _MISSING:
                raise KeyError(f"{self._source} has no value for {key!r}")
            return default
        return value

    def get_int(self, key: str, default: int = _MISSING) -> int:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise TypeError(f"{self._source}: {key!r} must be an integer, got {value!r}")
        return int(value)

    def get_float(self, key: str, default: float = _MISSING) -> float:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{self._source}: {key!r} must be a number, got {value!r}")
        return float(value)

    def get_bool(self, key: str, default: bool = _MISSING) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise TypeError(f"{self._source}: {key!r} must be true or false, got {value!r}")
        return value

    def get_str(self, key: str, default: str = _MISSING) -> str:
        value = self._value(key, default)
        if not isinstance(value, str):
            raise TypeError(f"{self._source}: {key!r} must be a string, got {value!r}")
        return value

    def get_list(self, key: str, default: list[Any] = _MISSING) -> list[Any]:
        value = self._value(key, default)
        if not isinstance(value, list):
            raise TypeError(f"{self._source}: {key!r} must be a list, got {value!r}")
        return list(value)

    def get_dict(self, key: str, default: dict[str, Any] = _MISSING) -> dict[str, Any]:
        value = self._value(key, default)
        if not isinstance(value, dict):
            raise TypeError(f"{self._source}: {key!r} must be an object, got {value!r}")
        return dict(value)

    def first_int(self, *keys: str, default: int = _MISSING) -> int:
        """The first of ``keys`` that has a value (for keys renamed between releases)."""
        for key in keys:
            if self._data.get(key) is not None:
                return self.get_int(key)
        if default is _MISSING:
            raise KeyError(f"{self._source} has none of {list(keys)}")
        return default

    # -- common derived values ------------------------------------------------------------
    @property
    def architecture(self) -> str:
        archs = self._data.get("architectures") or []
        if not archs or not isinstance(archs[0], str):
            raise ValueError(f"{self._source} has no 'architectures' list")
        return archs[0]

    @property
    def source(self) -> str:
        return self._source
