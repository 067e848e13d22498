"""Reference vectors of the LLaDA family (``LLaDAModelLM``, ``LLaDAMoEModelLM``) from the official
generators, for ``tests/test_refvectors_llada.py``.

Run from the repository root under the reference environment with transformers 4.49.0 (the version
Fast-dLLM's ``requirements.txt`` pins) and ``einops`` (imported by Fast-dLLM's model code)::

    /work/refenv449/bin/python scripts/refvectors/llada.py --ref-root /work/refsrc

``--ref-root`` holds (plain work trees, never modified; nothing of them is copied here):

* ``ML-GSAI+LLaDA/generate.py``: ``generate`` (fixed quota, ``cfg_scale``, batches).
* ``NVlabs+Fast-dLLM/llada/``: ``generate.py`` (``generate``, ``generate_with_prefix_cache``,
  ``generate_with_dual_cache``, with and without ``threshold``) and ``model/`` (the official LLaDA
  modeling code with Fast-dLLM's KV-cache additions: the model of every LLaDA vector).
* ``NVlabs+Fast-dLLM@f6b35ec/llada/generate.py``: a newer ``generate.py`` of the same repository
  (commit f6b35ec, the only one with ``factor``/``get_transfer_index_dynamic``; see its
  ``PROVENANCE``), run on the same model code.
* ``LLaDA-MoE-hub-copy/``: ``modeling_lladamoe.py`` and ``configuration_lladamoe.py`` of
  inclusionAI/LLaDA-MoE-7B-A1B (published on the model hub only; a public verbatim copy, see its
  ``PROVENANCE``). LLaDA-MoE is decoded with ML-GSAI's ``generate``, as its model card does.

The official model classes are imported from those files by path, built from the tiny checkpoint's
``config.json`` and loaded with ``load_state_dict(strict=True)`` from its safetensors (the factory
writes the released tensor names), float32, CPU, ``eval()``. No stand-ins are needed: the LLaDA code
imports ``flash_attn`` only when ``flash_attention`` is true (the released config and the factory
say false), and its ``torch.compile``-d attention runs on CPU as it is (bitwise equal to eager
there). Greedy (``temperature=0``) everywhere: sampled vectors would need the reference's
``torch.rand`` stream, which dllm does not reproduce.

Checkpoint overrides: ``layer_norm_type "rms"`` and ``n_kv_heads == n_heads`` (MHA), the values of
the released LLaDA-8B-Instruct config (the factory wrote ``"rms_norm"``, which the official code
rejects, and 2 KV heads); once the factory carries them they are no-ops. ``mask_id`` is the
checkpoint's ``mask_token_id`` from ``config.json`` (LLaDA), or its tokenizer's mask token
(LLaDA-MoE, whose config has none).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections.abc import Callable
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

LLADA_OVERRIDES: dict[str, Any] = {"layer_norm_type": "rms", "n_kv_heads": 4}  # n_heads is 4
MOE_OVERRIDES: dict[str, Any] = {}
# Checkpoint seeds: seed 2's tiny LLaDA decodes the most varied tokens of seeds 0-5 (a random
# model's LM head favours a few ids; with seed 0 one id fills whole canvases).
LLADA_SEED, MOE_SEED = 2, 0

GSAI = "ML-GSAI/LLaDA generate.py::generate"
FAST = "NVlabs/Fast-dLLM llada/generate.py::"


def _load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _package(name: str, folder: Path) -> None:
    pkg = types.ModuleType(name)
    pkg.__path__ = [str(folder)]
    sys.modules[name] = pkg


class References:
    """The official modules, imported from the checkouts by path."""

    def __init__(self, root: Path):
        self.gsai_dir = root / "ML-GSAI+LLaDA"
        self.fast_dir = root / "NVlabs+Fast-dLLM"
        self.fast_new_dir = root / "NVlabs+Fast-dLLM@f6b35ec"
        self.moe_dir = root / "LLaDA-MoE-hub-copy"
        llada = self.fast_dir / "llada"
        # Fast-dLLM's generate.py imports ``model.modeling_llada`` (its folder on sys.path).
        sys.path.insert(0, str(llada))
        import model.configuration_llada as llada_config  # type: ignore[import-not-found]
        import model.modeling_llada as llada_model  # type: ignore[import-not-found]

        self.llada_config, self.llada_model = llada_config, llada_model
        self.gsai = _load_module("ref_gsai_generate", self.gsai_dir / "generate.py")
        self.fast = _load_module("ref_fast_generate", llada / "generate.py")
        # The newer generate.py imports ``.model.modeling_llada``: the same model package.
        _package("ref_fast_new", self.fast_new_dir / "llada")
        sys.modules["ref_fast_new.model"] = sys.modules["model"]
        sys.modules["ref_fast_new.model.modeling_llada"] = llada_model
        self.fast_new = _load_module("ref_fast_new.generate",
                                     self.fast_new_dir / "llada" / "generate.py")
        _package("ref_lladamoe", self.moe_dir)
        self.moe_config = _load_module("ref_lladamoe.configuration_lladamoe",
                                       self.moe_dir / "configuration_lladamoe.py")
        self.moe_model = _load_module("ref_lladamoe.modeling_lladamoe",
                                      self.moe_dir / "modeling_lladamoe.py")

    def commits(self) -> dict[str, str]:
        return {"gsai": commit_of(self.gsai_dir), "fast": commit_of(self.fast_dir),
                "fast_new": commit_of(self.fast_new_dir), "moe": commit_of(self.moe_dir)}


def _strict_load(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    model.load_state_dict(tensors, strict=True)
    return model.float().eval()


def load_llada(refs: References, path: Path) -> torch.nn.Module:
    config = refs.llada_config.LLaDAConfig.from_pretrained(str(path))
    return _strict_load(refs.llada_model.LLaDAModelLM(config), path)


def load_moe(refs: References, path: Path) -> torch.nn.Module:
    config = refs.moe_config.LLaDAConfig.from_pretrained(str(path))
    model = refs.moe_model.LLaDAMoEModelLM(config)
    # transformers 4.49 picks SDPA for a model that supports it (as from_pretrained does).
    assert config._attn_implementation == "sdpa", config._attn_implementation
    return _strict_load(model, path)


def checkpoint_facts(path: Path) -> tuple[int, int]:
    """``(mask_id, first added id)``: the mask id (config.json, else the tokenizer's mask
    token) and the end of the tokenizer's ordinary id range (added tokens come after it)."""
    config = json.loads((path / "config.json").read_text())
    tok = json.loads((path / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    mask = config.get("mask_token_id")
    if mask is None:
        names = []
        for file in ("special_tokens_map.json", "tokenizer_config.json"):
            entry = json.loads((path / file).read_text()).get("mask_token")
            names.append(entry.get("content") if isinstance(entry, dict) else entry)
        names += ["<|mask|>", "<|mdm_mask|>"]
        mask = next(added[n] for n in names if n in added)
    return int(mask), min(added.values())


def make_prompts(seed: int, lengths: list[int], high: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, high, (n,), generator=gen).tolist() for n in lengths]


def mask_argmax_hook(model: torch.nn.Module, mask_id: int) -> tuple[list[int], Callable]:
    """Counts masked input positions whose logits' argmax is the mask id (the reference may
    propose it; dllm never does): a diagnostic stored with the vector."""
    hits = [0]

    def hook(_m: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        logits = out.logits if hasattr(out, "logits") else out[0]
        hits[0] += int(((logits.argmax(-1) == mask_id) & (ids == mask_id)).sum())

    return hits, model.register_forward_hook(hook, with_kwargs=True)


def run_case(out_dir: Path, name: str, *, reference: str, commit: str, checkpoint: dict,
             model: torch.nn.Module, fn: Callable, prompts: list[list[int]],
             settings: dict[str, Any], call: dict[str, Any], mask_id: int,
             notes: str = "") -> None:
    """Run ``fn(model, prompt_tensor, **call)`` and write the vector. ``settings`` are the
    reference's own argument names and values as recorded; ``call`` what is passed."""
    prompt = torch.tensor(prompts, dtype=torch.long)
    torch.manual_seed(0)
    hits, handle = mask_argmax_hook(model, mask_id)
    try:
        result, rec = run_recorded(model, lambda: fn(model, prompt, **call))
    finally:
        handle.remove()
    x, nfe = (result, None) if isinstance(result, torch.Tensor) else result
    outputs = x.tolist()
    if nfe is not None:
        assert nfe == rec.count, (name, nfe, rec.count)
    gen = [row[len(p):] for row, p in zip(outputs, prompts, strict=True)]
    extra: dict[str, Any] = {"mask_argmax_positions": hits[0]}
    if nfe is not None:
        extra["nfe"] = int(nfe)
    path = write_vector(out_dir, name, reference=reference, reference_commit=commit,
                        checkpoint=checkpoint, settings=settings, prompts=prompts,
                        outputs=outputs, num_forwards=rec.count, forward_inputs=rec.inputs,
                        notes=notes, extra=extra)
    distinct = [len(set(g)) for g in gen]
    print(f"{path.name}: forwards {rec.count}, distinct generated ids per row {distinct}, "
          f"mask-argmax positions {hits[0]}, masks left {[g.count(mask_id) for g in gen]}")


def gsai_cases() -> list[dict[str, Any]]:
    """ML-GSAI ``generate``: (name, prompt seed, prompt lengths, settings)."""
    base = {"temperature": 0.0, "cfg_scale": 0.0, "remasking": "low_confidence",
            "logits_eos_inf": False, "confidence_eos_eot_inf": False}
    cases = [
        ("gsai_g16_b16_s16", 100, [7], {"steps": 16, "gen_length": 16, "block_length": 16}),
        ("gsai_g16_b8_s8", 101, [5], {"steps": 8, "gen_length": 16, "block_length": 8}),
        ("gsai_g24_b8_s9", 102, [12], {"steps": 9, "gen_length": 24, "block_length": 8}),
        ("gsai_g32_b32_s12", 103, [9], {"steps": 12, "gen_length": 32, "block_length": 32}),
        # 8 steps per block of 4 masks: steps 4..7 of each block transfer nothing.
        ("gsai_g8_b4_s16_zero_steps", 104, [6], {"steps": 16, "gen_length": 8,
                                                 "block_length": 4}),
        ("gsai_g16_b8_s8_batch2", 105, [6, 6], {"steps": 8, "gen_length": 16,
                                                "block_length": 8}),
        ("gsai_g16_b8_s16_batch2", 106, [10, 10], {"steps": 16, "gen_length": 16,
                                                   "block_length": 8}),
        # cfg_scale > 0 needs an attention_mask: without one the reference raises
        # UnboundLocalError (``attention_mask_`` is only set when a mask is given).
        ("gsai_cfg1_g16_b8_s8", 107, [8], {"steps": 8, "gen_length": 16, "block_length": 8,
                                           "cfg_scale": 1.0, "attention_mask": "ones"}),
        ("gsai_cfg05_g16_b16_s16", 108, [11], {"steps": 16, "gen_length": 16,
                                               "block_length": 16, "cfg_scale": 0.5,
                                               "attention_mask": "ones"}),
        # Prompts found (of seeds 1000-1034) where ranking by the softmax without the mask
        # token's probability picks other positions than the reference's full softmax.
        ("gsai_g32_b32_s16_rank", 1027, [9], {"steps": 16, "gen_length": 32,
                                              "block_length": 32}),
        ("gsai_g24_b8_s12_rank", 1033, [6], {"steps": 12, "gen_length": 24,
                                             "block_length": 8}),
    ]
    return [{"name": n, "seed": seed, "lengths": lens, "settings": {**base, **s}}
            for n, seed, lens, s in cases]


def fast_cases() -> list[dict[str, Any]]:
    """Fast-dLLM (checkout, or f6b35ec where ``newer``): one list of specs (name, prompt
    seed, prompt lengths, settings, newer), each run through the three generators."""
    base = {"temperature": 0.0, "remasking": "low_confidence"}
    specs = [
        ("fast_{}_g16_b8_s8", 200, [7], {"steps": 8, "gen_length": 16, "block_length": 8,
                                         "threshold": None}, False),
        ("fast_{}_g24_b8_s24", 201, [10], {"steps": 24, "gen_length": 24, "block_length": 8,
                                           "threshold": None}, False),
        ("fast_{}_g32_b8_t09", 202, [9], {"steps": 32, "gen_length": 32, "block_length": 8,
                                          "threshold": 0.9}, False),
        ("fast_{}_g32_b16_t07", 203, [6], {"steps": 32, "gen_length": 32, "block_length": 16,
                                           "threshold": 0.7}, False),
        # A threshold low enough that a block's first (full) forward resolves the block: the
        # checkout's cached generators then run one more forward on the finished block.
        ("fast_{}_g16_b4_t005", 204, [8], {"steps": 16, "gen_length": 16, "block_length": 4,
                                           "threshold": 0.05}, False),
        ("fastf6b_{}_g32_b8_f1", 205, [8], {"steps": 32, "gen_length": 32, "block_length": 8,
                                            "threshold": None, "factor": 1.0}, True),
        ("fastf6b_{}_g32_b16_f2", 206, [12], {"steps": 32, "gen_length": 32,
                                              "block_length": 16, "threshold": None,
                                              "factor": 2.0}, True),
        ("fastf6b_{}_g32_b8_t09", 207, [9], {"steps": 32, "gen_length": 32, "block_length": 8,
                                             "threshold": 0.9, "factor": None}, True),
        # A prompt where the dual cache with factor 2 takes one more step than a softmax
        # without the mask token's probability would (second confidence 0.2988 with it,
        # 0.3784 without, against the bound 1 - 2/3).
        ("fastf6b_{}_g32_b16_f2_p219", 219, [12], {"steps": 32, "gen_length": 32,
                                                   "block_length": 16, "threshold": None,
                                                   "factor": 2.0}, True),
        # One step per block (the checkout's cached generators raise IndexError there).
        ("fastf6b_{}_g16_b8_s2", 208, [5], {"steps": 2, "gen_length": 16, "block_length": 8,
                                            "threshold": None, "factor": None}, True),
    ]
    out = []
    for fn, short in (("generate", "none"), ("generate_with_prefix_cache", "prefix"),
                      ("generate_with_dual_cache", "dual")):
        out += [{"name": n.format(short), "function": fn, "seed": seed, "lengths": lens,
                 "settings": {**base, **s}, "newer": newer}
                for n, seed, lens, s, newer in specs]
    return out


def moe_cases() -> list[dict[str, Any]]:
    base = {"temperature": 0.0, "cfg_scale": 0.0, "remasking": "low_confidence",
            "logits_eos_inf": False, "confidence_eos_eot_inf": False}
    cases = [
        ("moe_gsai_g16_b8_s8", 300, [6], {"steps": 8, "gen_length": 16, "block_length": 8}),
        ("moe_gsai_g24_b24_s12", 301, [9], {"steps": 12, "gen_length": 24,
                                            "block_length": 24}),
        ("moe_gsai_cfg1_g16_b8_s16", 302, [7], {"steps": 16, "gen_length": 16,
                                                "block_length": 8, "cfg_scale": 1.0,
                                                "attention_mask": "ones"}),
    ]
    return [{"name": n, "seed": seed, "lengths": lens, "settings": {**base, **s}}
            for n, seed, lens, s in cases]


def gsai_call(settings: dict[str, Any], prompts: list[list[int]], mask_id: int
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(recorded settings, call kwargs) of ML-GSAI ``generate``."""
    call = {k: v for k, v in settings.items() if k != "attention_mask"}
    recorded = dict(settings)
    if settings.get("attention_mask") == "ones":
        mask = [[1] * len(p) for p in prompts]
        call["attention_mask"] = torch.tensor(mask, dtype=torch.long)
        recorded["attention_mask"] = mask
    else:
        recorded["attention_mask"] = None
    call["mask_id"] = recorded["mask_id"] = mask_id
    return recorded, call


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    refs = References(args.ref_root)
    commits = refs.commits()

    ck_llada = args.work / "llada"
    llada_ckpt = build_checkpoint("LLaDAModelLM", ck_llada, LLADA_SEED, **LLADA_OVERRIDES)
    mask_id, high = checkpoint_facts(ck_llada)
    llada = load_llada(refs, ck_llada)

    def wanted(name: str) -> bool:
        return args.only is None or args.only in name

    for case in gsai_cases():
        if not wanted(case["name"]):
            continue
        prompts = make_prompts(case["seed"], case["lengths"], high)  # a batch: equal lengths
        recorded, call = gsai_call(case["settings"], prompts, mask_id)
        run_case(args.out, f"llada_{case['name']}", reference=GSAI, commit=commits["gsai"],
                 checkpoint=llada_ckpt, model=llada, fn=refs.gsai.generate, prompts=prompts,
                 settings=recorded, call=call, mask_id=mask_id)

    for case in fast_cases():
        if not wanted(case["name"]):
            continue
        prompts = make_prompts(case["seed"], case["lengths"], high)
        module = refs.fast_new if case["newer"] else refs.fast
        settings = {**case["settings"], "mask_id": mask_id}
        run_case(args.out, f"llada_{case['name']}", reference=FAST + case["function"],
                 commit=commits["fast_new" if case["newer"] else "fast"],
                 checkpoint=llada_ckpt, model=llada, fn=getattr(module, case["function"]),
                 prompts=prompts, settings=settings, call=settings, mask_id=mask_id,
                 notes="generate.py of commit f6b35ec (the newest stored), model code of the "
                       "checkout" if case["newer"] else "")

    ck_moe = args.work / "lladamoe"
    moe_ckpt = build_checkpoint("LLaDAMoEModelLM", ck_moe, MOE_SEED, **MOE_OVERRIDES)
    moe_mask, moe_high = checkpoint_facts(ck_moe)
    moe = None
    for case in moe_cases():
        if not wanted(case["name"]):
            continue
        if moe is None:
            moe = load_moe(refs, ck_moe)
        prompts = make_prompts(case["seed"], case["lengths"], moe_high)
        recorded, call = gsai_call(case["settings"], prompts, moe_mask)
        run_case(args.out, f"llada_{case['name']}", reference=GSAI, commit=commits["gsai"],
                 checkpoint=moe_ckpt, model=moe, fn=refs.gsai.generate, prompts=prompts,
                 settings=recorded, call=call, mask_id=moe_mask,
                 notes=f"model: modeling_lladamoe.py (LLaDA-MoE hub code, public copy at "
                       f"InfiniTensor/InfiniLM {commits['moe']})")


if __name__ == "__main__":
    main()
