"""The import direction of DESIGN §1 (server -> dllm -> runner -> models) as CI checks it:
``.ci/lint_imports.py`` runs import-linter on the ``[tool.importlinter]`` contract of
pyproject.toml. The tree keeps it; an upward import breaks it, one inside a function too, and
so does a new module of dllm/ that the contract does not place."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("dllm", "runner", "models", "server")


def lint(repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / ".ci" / "lint_imports.py"), str(repo)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the repository's Python files and pyproject.toml, to break."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=lambda d, names: [
            n for n in names if n == "__pycache__" or (Path(d, n).is_file()
                                                       and not n.endswith(".py"))])
    return tmp_path


def test_the_tree_keeps_the_contract():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 1 kept, 0 broken." in out.stdout


@pytest.mark.parametrize("path, code, broken", [
    ("dllm/config.py", "\n\ndef _probe():\n    from dllm.server import protocol\n",
     ["dllm.config is not allowed to import dllm.server:", "dllm.config -> dllm.server.protocol"]),
    ("runner/probe.py", "from dllm import config\n",
     ["dllm.runner is not allowed to import dllm.config:", "dllm.runner.probe -> dllm.config"]),
    ("models/probe.py", "import dllm.runner\n",
     ["dllm.models is not allowed to import dllm.runner:", "dllm.models.probe -> dllm.runner"]),
    ("models/probe.py", "from dllm.config import EngineConfig\n",
     ["dllm.models is not allowed to import dllm.config:", "dllm.models.probe -> dllm.config"]),
    ("dllm/probe.py", "", ["The following modules are not listed as layers:", "- dllm.probe"]),
])
def test_an_upward_import_breaks_the_contract(repo, path, code, broken):
    with open(repo / path, "a", encoding="utf-8") as f:
        f.write(code)
    out = lint(repo)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Contracts: 0 kept, 1 broken." in out.stdout
    for line in broken:
        assert line in out.stdout
