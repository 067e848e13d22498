"""The install maps the root folders into one ``dllm`` namespace, importable from anywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_import_namespace_from_any_directory(tmp_path):
    code = ("import dllm, dllm.runner, dllm.models, dllm.server, dllm.testing; "
            "print(dllm.runner.__name__, dllm.models.__name__, dllm.server.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["dllm.runner", "dllm.models", "dllm.server"]


def test_import_direction_models_and_runner_stay_low():
    """``models`` imports nothing above it; ``runner`` never imports ``server`` (DESIGN §1)."""
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for folder, banned in (("models", ("dllm.runner", "dllm.server", "dllm.engine",
                                       "dllm.scheduler", "dllm.llm")),
                           ("runner", ("dllm.server", "dllm.engine", "dllm.scheduler"))):
        for path in (root / folder).rglob("*.py"):
            lines = path.read_text().splitlines()
            in_type_checking = False
            for line in lines:
                if line.startswith("if TYPE_CHECKING"):
                    in_type_checking = True
                    continue
                if in_type_checking and line and not line.startswith(" "):
                    in_type_checking = False
                stripped = line.strip()
                if (stripped.startswith(("import ", "from ")) and not in_type_checking
                        and any(stripped.split()[1].startswith(b) for b in banned)):
                    offenders.append(f"{path.relative_to(root)}: {stripped}")
    assert offenders == []
