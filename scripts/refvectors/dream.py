"""Reference vectors for the Dream family (``DreamModel``: full attention, logits shifted by one).

Run from the repository root under the reference environment with transformers 4.49.0 (the
version Fast-dLLM's ``requirements.txt`` pins; torch 2.13.0 CPU)::

    /work/refenv449/bin/python scripts/refvectors/dream.py --ref-root /work/refsrc

The oracle is the official code itself, imported by path from the checkout
``<ref-root>/NVlabs+Fast-dLLM/dream/model`` (a package with relative imports, so it is
loaded as a package under a private name): ``modeling_dream.DreamModel`` (whose
``DreamGenerationMixin`` is the one of ``generation_utils.py``) on the tiny checkpoint of
dllm's factory (config from its ``config.json``, safetensors loaded strictly, float32, CPU,
``eval()``), then

* ``generation_utils.py``: Dream's ``diffusion_generate`` (``alg`` ``maskgit_plus``,
  ``topk_margin``, ``entropy``) and Fast-dLLM's ``confidence_threshold``;
* ``generation_utils_block.py``: Fast-dLLM's prefix cache (``dual_cache=False``) and dual
  cache (``dual_cache=True``), installed on the model as Fast-dLLM's ``eval.py`` does
  (``types.MethodType`` over ``diffusion_generate`` and ``_sample``).

The Dream repository (``DreamLM/Dream``) ships no generation code: its ``generation_utils.py``
lives with the checkpoints on the model hub. Fast-dLLM's ``generation_utils.py`` is "modified
from Dream"; its ``origin``/``maskgit_plus``/``topk_margin``/``entropy`` branches are Dream's
(public copies of the hub file carry the same lines); Fast-dLLM adds ``confidence_threshold``
and two ``print`` calls, silenced here.

Skipped: ``alg="origin"`` (the positions it transfers are drawn with ``torch.rand`` even at
temperature 0, so its output is the torch RNG's, which dllm's counter RNG does not replay)
and every ``alg_temp > 0`` case (``torch.multinomial``), likewise.

No GPU-only package is imported: ``modeling_dream`` imports flash-attn helpers only when
``transformers`` reports flash-attn installed, and its layers always use torch SDPA.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    build_checkpoint,
    commit_of,
    parse_args,
    run_recorded,
    write_vector,
)
from safetensors.torch import load_file  # noqa: E402

ARCH = "DreamModel"
SEED = 0
REPO = "NVlabs/Fast-dLLM"
CHECKOUT = "NVlabs+Fast-dLLM"
PACKAGE = "_fastdllm_dream_model"  # private name of the imported official package
FULL = f"{REPO} dream/model/generation_utils.py::DreamGenerationMixin.diffusion_generate"
BLOCK = f"{REPO} dream/model/generation_utils_block.py::DreamGenerationMixin.diffusion_generate"
MAX_FORWARDS = 400  # a guard: Fast-dLLM's threshold loops have no step limit
PROMPT_ATTEMPTS = 30


def import_official(model_dir: Path) -> types.ModuleType:
    """The official ``dream/model`` folder as a package (its files import each other
    relatively)."""
    spec = importlib.util.spec_from_file_location(
        PACKAGE, model_dir / "__init__.py", submodule_search_locations=[str(model_dir)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = pkg
    spec.loader.exec_module(pkg)
    return pkg


def load_model(pkg: types.ModuleType, ckpt: Path) -> torch.nn.Module:
    modeling = importlib.import_module(f"{PACKAGE}.modeling_dream")
    generation = importlib.import_module(f"{PACKAGE}.generation_utils")
    config = modeling.DreamConfig.from_pretrained(str(ckpt))
    model = modeling.DreamModel(config)
    state = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(str(f)))
    model.load_state_dict(state, strict=True)
    # what DreamPreTrainedModel.from_pretrained does after loading the weights
    model.generation_config = generation.DreamGenerationConfig.from_pretrained(str(ckpt))
    return model.to(torch.float32).eval()


def use_generator(model: torch.nn.Module, module_name: str) -> None:
    """Install a generation module's mixin on the model, as Fast-dLLM's ``eval.py`` does."""
    mixin = importlib.import_module(f"{PACKAGE}.{module_name}").DreamGenerationMixin
    model.diffusion_generate = types.MethodType(mixin.diffusion_generate, model)
    model._sample = types.MethodType(mixin._sample, model)


def ordinary_ids(ckpt: Path) -> int:
    """Ids below this are the tokenizer's ordinary tokens (its added tokens come after)."""
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    return min(t["id"] for t in tok["added_tokens"])


def prompt_ids(seed: int, length: int, rows: int, high: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (rows, length), generator=gen).tolist()


# name -> (generator module, prompts (seed, length, rows), settings: the reference's kwargs)
def cases() -> dict[str, tuple[str, tuple[int, int, int], dict[str, Any]]]:
    out: dict[str, tuple[str, tuple[int, int, int], dict[str, Any]]] = {}
    full = "generation_utils"
    block = "generation_utils_block"
    # Sampler settings always explicit, as Fast-dLLM's eval.py passes them: left out, they come
    # from DreamGenerationConfig.from_model_config(model.config), i.e. transformers'
    # PretrainedConfig defaults (temperature 1.0, top_k 50), not from generation_config.json.
    greedy = {"temperature": 0.0, "top_p": None, "top_k": None, "alg_temp": 0.0}
    for alg, seed in (("maskgit_plus", 11), ("topk_margin", 12), ("entropy", 13)):
        # steps == masks, steps < masks, steps > masks (some steps transfer zero tokens)
        for steps in (16, 5, 24):
            out[f"dream_full_{alg}_n16_s{steps}"] = (
                full, (seed, 10, 1), {"max_new_tokens": 16, "steps": steps, "alg": alg, **greedy})
        out[f"dream_full_{alg}_n8_s8"] = (
            full, (seed + 100, 12, 1), {"max_new_tokens": 8, "steps": 8, "alg": alg, **greedy})
        out[f"dream_full_{alg}_n32_s12"] = (
            full, (seed + 200, 6, 1), {"max_new_tokens": 32, "steps": 12, "alg": alg, **greedy})
        out[f"dream_full_{alg}_batch2_n16_s10"] = (
            full, (seed + 300, 8, 2), {"max_new_tokens": 16, "steps": 10, "alg": alg, **greedy})
    # at temperature 0 the filters still shape the distribution the confidence is read from
    for alg, seed in (("maskgit_plus", 14), ("entropy", 15), ("topk_margin", 16)):
        out[f"dream_full_{alg}_topk50_n16_s8"] = (full, (seed, 10, 1), {
            "max_new_tokens": 16, "steps": 8, "alg": alg, **greedy, "top_k": 50})
        out[f"dream_full_{alg}_topk3_n16_s8"] = (full, (seed, 10, 1), {
            "max_new_tokens": 16, "steps": 8, "alg": alg, **greedy, "top_k": 3})
        out[f"dream_full_{alg}_topp0999999_n16_s8"] = (full, (seed, 10, 1), {
            "max_new_tokens": 16, "steps": 8, "alg": alg, **greedy, "top_p": 0.999999})
    for threshold in (0.95, 0.7, 0.5, 0.4):
        for steps, n, seed in ((4, 16, 21), (2, 32, 23)):
            name = f"dream_full_confthr_t{threshold}_n{n}_s{steps}".replace(".", "")
            out[name] = (full, (seed, 8, 1), {"max_new_tokens": n, "steps": steps,
                                               "alg": "confidence_threshold",
                                               "threshold": threshold, **greedy})
    # one token per step: the threshold never matters
    out["dream_full_confthr_t09_n16_s16"] = (full, (22, 8, 1), {
        "max_new_tokens": 16, "steps": 16, "alg": "confidence_threshold", "threshold": 0.9,
        **greedy})
    for dual in (False, True):
        mode = "dual" if dual else "prefix"
        # Fast-dLLM's block path ranks by negative entropy whatever ``alg`` names
        for alg, seed in (("entropy", 31), ("maskgit_plus", 32)):
            for n, block_length, steps in ((16, 8, 8), (32, 8, 16), (16, 16, 16), (16, 8, 24)):
                out[f"dream_{mode}_{alg}_n{n}_b{block_length}_s{steps}"] = (
                    block, (seed, 10, 1),
                    {"max_new_tokens": n, "steps": steps, "alg": alg, **greedy,
                     "block_length": block_length, "dual_cache": dual})
        if not dual:  # the dual cache's K/V write indexes every row's block at once
            out[f"dream_{mode}_entropy_batch2_n16_b8_s8"] = (
                block, (33, 8, 2), {"max_new_tokens": 16, "steps": 8, "alg": "entropy",
                                    **greedy, "block_length": 8, "dual_cache": dual})
        for threshold in (0.95, 0.8, 0.4):
            for n, block_length, seed in ((16, 8, 34), (32, 16, 35)):
                name = f"dream_{mode}_confthr_t{threshold}_n{n}_b{block_length}".replace(".", "")
                out[name] = (block, (seed, 9, 1),
                             {"max_new_tokens": n, "steps": n, "alg": "confidence_threshold",
                              **greedy, "threshold": threshold, "block_length": block_length,
                              "dual_cache": dual})
    return out


class NoProgress(RuntimeError):
    """The reference ran past ``MAX_FORWARDS`` forwards."""


def degenerate(prompts: list[list[int]], outputs: list[list[int]]) -> bool:
    """Fewer than 3 distinct generated ids in a row, or one id in more than 70% of it."""
    for p, o in zip(prompts, outputs, strict=True):
        gen = o[len(p):]
        if len(set(gen)) < 3 or max(gen.count(t) for t in gen) > 0.7 * len(gen):
            return True
    return False


def run_case(model: torch.nn.Module, prompts: list[list[int]],
             settings: dict[str, Any]) -> tuple[list[list[int]], Any]:
    """The official ``diffusion_generate`` on ``prompts`` (one batch), recorded."""
    inputs = torch.tensor(prompts, dtype=torch.long)

    def generate() -> torch.Tensor:
        with contextlib.redirect_stdout(io.StringIO()):  # Fast-dLLM's progress prints
            return model.diffusion_generate(inputs, **settings)

    calls = {"n": 0}

    def guard(_m: torch.nn.Module, _a: tuple) -> None:
        calls["n"] += 1
        if calls["n"] > MAX_FORWARDS:
            raise NoProgress(f"more than {MAX_FORWARDS} forwards")

    handle = model.register_forward_pre_hook(guard)
    try:
        out, rec = run_recorded(model, generate)
    finally:
        handle.remove()
    return out.tolist(), rec


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    checkout = args.ref_root / CHECKOUT
    pkg = import_official(checkout / "dream" / "model")
    ckpt_dir = args.work / "dream"
    checkpoint = build_checkpoint(ARCH, ckpt_dir, seed=SEED)
    model = load_model(pkg, ckpt_dir)
    config = json.loads((ckpt_dir / "config.json").read_text())
    high = ordinary_ids(ckpt_dir)
    commit = commit_of(checkout)
    for name, (module, (seed, length, rows), settings) in cases().items():
        if args.only and args.only not in name:
            continue
        use_generator(model, module)
        # deterministic search for a prompt whose output is not degenerate
        for attempt in range(PROMPT_ATTEMPTS):
            prompts = prompt_ids(seed + 1000 * attempt, length, rows, high)
            try:
                outputs, rec = run_case(model, prompts, settings)
            except NoProgress as e:  # e.g. the mask id as the top token, forever
                print(f"{name}: prompt seed {seed + 1000 * attempt}: {e}; next prompt")
                continue
            if not degenerate(prompts, outputs):
                break
        else:
            raise SystemExit(f"{name}: every prompt tried gives a degenerate output")
        mask_id = config["mask_token_id"]
        left = sum(row[len(p):].count(mask_id) for p, row in zip(prompts, outputs, strict=True))
        notes = (f"official {module}.py on the factory's tiny {ARCH}; mask id {mask_id} from "
                 f"config.json; outputs are the whole canvas (prompt first)")
        if left:
            notes += f"; {left} mask id(s) left in the output"
        path = write_vector(
            args.out, name, reference=FULL if module == "generation_utils" else BLOCK,
            reference_commit=commit, checkpoint=checkpoint, settings=settings, prompts=prompts,
            outputs=outputs, num_forwards=rec.count, forward_inputs=rec.inputs, notes=notes,
            extra={"mask_token_id": mask_id, "transformers_version": _transformers_version()})
        gen = [row[len(p):] for p, row in zip(prompts, outputs, strict=True)]
        print(f"{path.name}: {rec.count} forwards, generated {gen}")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
