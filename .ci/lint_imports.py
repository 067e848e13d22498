"""Check the import contracts of ``[tool.importlinter]`` in pyproject.toml (``lint-imports``).

The root folders install as one namespace, ``dllm``, through setuptools ``package-dir``; an
editable install maps them with an import hook, which import-linter's graph builder does not
follow (it reads a package's files from the one directory the package is in, so it would see
``dllm/`` without ``runner/``, ``models/`` and ``server/``). So this lays the ``.py`` files out
in a scratch directory as a regular install does and runs ``lint-imports`` there.

    python .ci/lint_imports.py [REPO]    # REPO: the repository root (default: this one)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter's own TOML reader
    import tomli as tomllib


def lay_out(repo: Path, dest: Path) -> None:
    """Copy each folder of ``package-dir`` to where the install puts its package."""
    with open(repo / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        for src in (repo / folder).rglob("*.py"):
            dst = dest.joinpath(*package.split("."), src.relative_to(repo / folder))
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)


def main(argv: list[str]) -> int:
    repo = Path(argv[0] if argv else Path(__file__).resolve().parents[1]).resolve()
    # The one installed beside this Python first, so an unactivated venv works too.
    lint_imports = shutil.which("lint-imports", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if lint_imports is None:
        print("lint-imports is not installed (pip install -e '.[dev]')", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tree:
        lay_out(repo, Path(tree))
        return subprocess.run([lint_imports, "--no-cache", "--no-logo",
                               str(repo / "pyproject.toml")], cwd=tree).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
