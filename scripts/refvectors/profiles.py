"""Writes ``tests/data/refvectors/weights_profiles.json``: for the checkpoint of every vector
(``*.json`` there; the hybrids' ``make_tiny_hybrid_checkpoint`` layouts too), its weights'
profile (``dllm.testing.factory.weights_profile``), keyed by the ``weights_sha256`` the vector
records. The replay (``tests/refvector_replay.check_factory_weights``) accepts a checkpoint
whose bytes differ from the recorded digest only if its profile matches: the factory's laws
round their last bits differently on other CPUs and math libraries, its tokens do not change.

    python scripts/refvectors/profiles.py

Run it after re-making vectors, on any machine (the profile is the same everywhere to ~1e-6).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from dllm.testing.factory import (
    make_tiny_checkpoint,
    make_tiny_hybrid_checkpoint,
    weights_profile,
)

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "refvectors"


def main() -> int:
    specs: dict[str, dict] = {}
    for path in sorted(DATA.glob("*.json")):
        if path.name == "weights_profiles.json":
            continue
        c = json.loads(path.read_text(encoding="utf-8"))["checkpoint"]
        specs.setdefault(c["weights_sha256"], c)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (digest, c) in enumerate(sorted(specs.items())):
            where = Path(tmp) / str(i)
            if "layout" in c:
                make_tiny_hybrid_checkpoint(c["layout"], where, seed=c["seed"], **c["overrides"])
            else:
                make_tiny_checkpoint(c["architecture"], where, seed=c["seed"], **c["overrides"])
            out[digest] = weights_profile(where)
    target = DATA / "weights_profiles.json"
    target.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{len(out)} checkpoints profiled: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
