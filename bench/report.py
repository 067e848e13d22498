"""Where every benchmark script leaves its results: ``<out>/<name>-<stamp>.md`` (what it
printed) and ``<out>/<name>-<stamp>.json`` (the numbers and the environment)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def write_report(out: str | Path, name: str, markdown: str, payload: dict,
                 when: str | None = None) -> Path:
    """Write both files (``when``: a stamp fixed by the caller, to rewrite one report as rows
    come in); returns the markdown file's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = f"{name}-{when or stamp()}"
    (out / f"{base}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    md = out / f"{base}.md"
    md.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return md
