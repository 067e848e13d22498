"""Reference vectors for SDAR / TraDo (``SDARForCausalLM``) from the official JetAstra/SDAR code.

Run from the repository root under the transformers-4.52.4 reference environment (the version
in SDAR's released ``config.json``)::

    /work/refenv452/bin/python scripts/refvectors/sdar.py --ref-root /work/refsrc

(``einops`` must be installed there: ``/work/refenv452/bin/pip install einops``.)

What runs, unmodified, from ``<ref-root>/JetAstra+SDAR`` (commit in its ``COMMIT`` file):

* ``generate.py::block_diffusion_generate`` (the README's generator), every remasking
  strategy that runs: ``low_confidence_static``, ``low_confidence_dynamic``, ``sequential``.
  ``entropy_bounded`` raises ``UnboundLocalError`` at its first step (``transfer_index`` is
  assigned in the other branches only); the script tries it and reports the error, and
  writes no vector for it.
* ``evaluation/opencompass/opencompass/models/huggingface_bd3.py::block_diffusion_generate``
  (the evaluation wrapper's generator, ``remasking='low_confidence'``; ``threshold < 1``
  is its dynamic rule, ``threshold >= 1`` its static one).
* The model is ``training/model/SDAR-4B-Chat/modeling_sdar.py`` (identical to the 8B file)
  with its ``configuration_sdar.py``, on the factory's tiny checkpoint: config from the
  checkpoint's ``config.json``, weights loaded strictly, float32, CPU, ``eval()``.

Greedy decoding. Both generators always draw with ``torch.multinomial``; the official
greedy setting is the evaluation config's (``evaluation/opencompass/configs/eval_sdar_hf.py``:
``temperature=1.0, top_k=1, top_p=1.0``): top-k 1 leaves one token with probability 1, so
the draw is the argmax. The two files differ in the confidence they rank: the wrapper
gathers it from the tempered, unfiltered softmax (``ori_probs``), so it ranks the real
probabilities; ``generate.py`` gathers it from the filtered distribution, so under top-k 1
every position's confidence is exactly 1.0 and the low-confidence rules rank ties (the order
``torch.topk`` returns on CPU). That is what the official code does greedily; the vectors
record it as it is. (A tiny temperature instead of top-k 1 saturates the same way.)

Stand-ins at this script's boundary (``sys.modules``), none of them inside the reference's
logic:

* ``flash_attn``: ``modeling_sdar.py`` imports ``flash_attn.ops.triton.layer_norm.rms_norm_fn``
  unconditionally (every RMSNorm) and calls ``flash_attn_func`` on its inference path whenever
  the attention mask is all ones (every denoise and store forward, and a one-block prefill).
  The stand-ins: RMSNorm in float32 (the file's own commented-out formula) and
  ``flash_attn_func(causal=False)`` as ``torch.nn.functional.scaled_dot_product_attention``
  with GQA. Attention otherwise is the file's own SDPA branch with the boolean block mask
  (prefill of two or more blocks). ``attn_implementation`` plays no part in the file's
  inference path (the flex path is ``self.training`` only).
* ``fused_linear_diffusion_cross_entropy`` (imported relatively by the model file; needs
  triton): a module whose loss class raises; it is used in training only.
* ``mmengine.device`` and the ``opencompass`` modules ``huggingface_bd3.py`` imports at module
  level: minimal placeholders for its model-wrapper class (registry decorator, base classes,
  logger); ``block_diffusion_generate`` uses none of them.

``liger_kernel`` is absent, so the model file takes its own plain SiLU-MLP branch.

Checkpoint: the factory's tiny ``SDARForCausalLM``, seed 0. The released config's values that
the model file or the generators read (``tie_word_embeddings=False``: an ``lm_head.weight``;
``mask_token_id`` = the tiny tokenizer's ``mask_token``; ``block_size=4``; ``use_cache=False``;
``fuse_cross_entropy=True``, read by the model's forward) are passed as overrides where the
factory does not already write them (recorded in each vector). ``mask_id`` is the tiny
tokenizer's mask token; prompts are random ids (fixed seed) below the first added token.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import build_checkpoint, commit_of, parse_args, run_recorded, write_vector
from safetensors.torch import load_file

from dllm.testing.factory import make_tiny_checkpoint  # importable once common has run

REPO_DIR = "JetAstra+SDAR"
GEN_REF = "JetAstra/SDAR generate.py::block_diffusion_generate"
EVAL_REF = ("JetAstra/SDAR evaluation/opencompass/opencompass/models/huggingface_bd3.py"
            "::block_diffusion_generate")
ARCH = "SDARForCausalLM"
SEED = 0
PROMPT_SEED = 1234
STOP_AT = 9  # the stop cases stop on the id the reference emits here (see main)


# ---------------------------------------------------------------------------------------------
# Stand-ins for GPU-only / heavy imports (module docstring)
# ---------------------------------------------------------------------------------------------


def _rms_norm_fn(x, weight, bias=None, residual=None, eps=1e-6, **_ignored):
    if residual is not None:
        raise NotImplementedError("stand-in: residual fusion is not used by modeling_sdar.py")
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if bias is None else out + bias


def _flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_ignored):
    """flash-attn layout ``[b, l, h, d]``; non-causal only (what modeling_sdar.py asks)."""
    if causal or dropout_p:
        raise NotImplementedError("stand-in: only causal=False, dropout 0")
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=False, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def _unavailable(*_a, **_k):
    raise NotImplementedError("stand-in: not used on the inference path")


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    # A spec without a distribution behind it: transformers' availability probes
    # (find_spec, then the installed version) answer "not installed".
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def install_stubs() -> None:
    _module("flash_attn", flash_attn_func=_flash_attn_func, flash_attn_varlen_func=_unavailable)
    _module("flash_attn.ops")
    _module("flash_attn.ops.triton")
    _module("flash_attn.ops.triton.layer_norm", rms_norm_fn=_rms_norm_fn)
    _module("flash_attn.bert_padding", index_first_axis=_unavailable, pad_input=_unavailable,
            unpad_input=_unavailable)

    class _Registry:
        def register_module(self, *a, **k):
            return (lambda cls: cls) if not a or not isinstance(a[0], type) else a[0]

    class _Base:
        def __init__(self, *a, **k):
            pass

    _module("mmengine")
    _module("mmengine.device", is_npu_available=lambda: False)
    _module("opencompass")
    _module("opencompass.models")
    _module("opencompass.models.base", BaseModel=_Base, LMTemplateParser=_Base)
    _module("opencompass.models.base_api", APITemplateParser=_Base)
    _module("opencompass.registry", MODELS=_Registry())
    _module("opencompass.utils")
    _module("opencompass.utils.logging", get_logger=lambda *a, **k: None)
    _module("opencompass.utils.prompt", PromptList=list)


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Official:
    """The reference's modules, imported by path."""

    def __init__(self, root: Path):
        install_stubs()
        model_dir = root / "training" / "model" / "SDAR-4B-Chat"
        pkg = types.ModuleType("sdar_official")
        pkg.__path__ = [str(model_dir)]
        sys.modules["sdar_official"] = pkg

        class _TrainingOnlyLoss:
            def __init__(self, *a, **k):
                raise NotImplementedError("stand-in: the fused training loss needs triton")

        _module("sdar_official.fused_linear_diffusion_cross_entropy",
                FusedLinearDiffusionCrossEntropyLoss=_TrainingOnlyLoss)
        self.configuration = _load("sdar_official.configuration_sdar",
                                   model_dir / "configuration_sdar.py")
        self.modeling = _load("sdar_official.modeling_sdar", model_dir / "modeling_sdar.py")
        self.generate = _load("sdar_generate", root / "generate.py")
        self.bd3 = _load("sdar_huggingface_bd3", root / "evaluation" / "opencompass" /
                         "opencompass" / "models" / "huggingface_bd3.py")

    def model(self, ckpt: Path) -> torch.nn.Module:
        config = self.configuration.SDARConfig.from_pretrained(str(ckpt))
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = self.modeling.SDARForCausalLM(config)
        state = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            state.update(load_file(str(f)))
        model.load_state_dict(state, strict=True)
        return model.to(torch.float32).eval()


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


def prompts_for(lengths: list[int], seed: int, high: int) -> list[list[int]]:
    """Random ids below ``high`` (the tokenizer's ordinary ids), one prompt per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, high, (n,), generator=g).tolist() for n in lengths]


GREEDY = {"temperature": 1.0, "top_k": 1, "top_p": 1.0}


def _gen(strategy: str, block: int, steps: int, gen: int, **extra: Any) -> dict[str, Any]:
    return {"gen_length": gen, "block_length": block, "denoising_steps": steps, **GREEDY,
            "remasking_strategy": strategy, "confidence_threshold": 0.85, "eb_threshold": None,
            "stopping_criteria_idx": None, **extra}


def _eval(block: int, steps: int, gen: int, threshold: float, **extra: Any) -> dict[str, Any]:
    return {"gen_length": gen, "block_length": block, "denoising_steps": steps, **GREEDY,
            "remasking": "low_confidence", "threshold": threshold, "stopping_criteria_idx": [],
            **extra}


# (name, reference, the reference's settings but mask_id, prompt lengths)
CASES: list[tuple[str, str, dict[str, Any], list[int]]] = [
    # the evaluation wrapper: the official greedy evaluation setting and variations
    ("eval_static_b4_s4", EVAL_REF, _eval(4, 4, 16, 1.0), [8, 6, 3, 13]),
    ("eval_static_b4_s2", EVAL_REF, _eval(4, 2, 16, 1.0), [8, 5, 7]),
    ("eval_static_b8_s4", EVAL_REF, _eval(8, 4, 24, 1.0), [16, 13, 6, 11]),
    ("eval_static_b8_s2", EVAL_REF, _eval(8, 2, 16, 1.0), [8, 10, 3]),
    ("eval_static_b8_s8", EVAL_REF, _eval(8, 8, 16, 1.0), [9, 16, 4]),
    ("eval_dynamic_b4_s4_t095", EVAL_REF, _eval(4, 4, 16, 0.95), [8, 6, 3, 13]),
    ("eval_dynamic_b4_s4_t05", EVAL_REF, _eval(4, 4, 20, 0.5), [8, 6, 9]),
    ("eval_dynamic_b8_s4_t03", EVAL_REF, _eval(8, 4, 24, 0.3), [16, 13, 6]),
    ("eval_dynamic_b8_s8_t02", EVAL_REF, _eval(8, 8, 24, 0.2), [8, 11, 5]),
    ("eval_static_b4_s4_temp07", EVAL_REF, _eval(4, 4, 16, 1.0, temperature=0.7), [8, 6]),
    ("eval_stop_b4_s4", EVAL_REF, _eval(4, 4, 32, 0.9, stopping_criteria_idx=["emitted", "eos"]),
     [8, 7, 5]),
    # generate.py (README): greedy = top-k 1, every confidence 1.0 (module docstring). Its
    # static rule, and its dynamic rule whenever fewer positions than the quota pass the
    # threshold, then pick among exact ties in torch.topk's unspecified CPU order (and may
    # write over unmasked positions): no rule reproduces those, so they have no vectors. A
    # threshold below 1 takes every masked position at once, which is reproducible.
    ("gen_dynamic_b4_s4", GEN_REF, _gen("low_confidence_dynamic", 4, 4, 16), [8, 6, 3]),
    ("gen_sequential_b4_s4", GEN_REF, _gen("sequential", 4, 4, 16), [8, 6, 3]),
    ("gen_sequential_b4_s2", GEN_REF, _gen("sequential", 4, 2, 16), [8, 5, 7]),
    ("gen_sequential_b8_s4", GEN_REF, _gen("sequential", 8, 4, 24), [16, 13, 6]),
    ("gen_sequential_b8_s3", GEN_REF, _gen("sequential", 8, 3, 16), [8, 11]),
    ("gen_stop_sequential_b4_s4", GEN_REF,
     _gen("sequential", 4, 4, 32, stopping_criteria_idx=["emitted", "eos"]),
     [8, 7, 5]),
    ("gen_entropy_bounded_b4_s4", GEN_REF,
     _gen("entropy_bounded", 4, 4, 16, eb_threshold=0.35), [8, 6]),
]


def overwrites(inputs: list, store_flags: list[bool], prompt_len: int, block: int,
               mask_id: int) -> list[list[int]]:
    """``[position, old, new]`` wherever a denoise step changed a token that was not a mask
    (a prompt token of the block or an earlier step's token), read off consecutive forward
    inputs of one block (a block's forwards end with its store forward)."""
    out = []
    k = 1 if prompt_len >= block else 0  # after the prefill
    start = prompt_len // block * block
    while k < len(inputs):
        if store_flags[k]:
            start, k = start + block, k + 1
            continue
        prev, nxt = inputs[k][0], inputs[k + 1][0]
        out += [[start + i, a, c] for i, (a, c) in enumerate(zip(prev, nxt, strict=True))
                if a != mask_id and a != c]
        k += 1
    return out


def run_case(off: Official, model: torch.nn.Module, reference: str, settings: dict[str, Any],
             prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
    ids = torch.tensor([prompt], dtype=torch.long)
    store_flags: list[bool] = []

    def flag(_m, _a, kwargs):
        store_flags.append(bool(kwargs.get("store_kv", False)))

    handle = model.register_forward_pre_hook(flag, with_kwargs=True)
    try:
        if reference == GEN_REF:
            fn = lambda: off.generate.block_diffusion_generate(  # noqa: E731
                model, prompt={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                **settings)
        else:
            fn = lambda: off.bd3.block_diffusion_generate(  # noqa: E731
                model, None, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                **settings)
        torch.manual_seed(SEED)
        out, rec = run_recorded(model, fn)
    finally:
        handle.remove()
    x = out[0].tolist()
    b = settings["block_length"]
    prefill = 1 if len(prompt) >= b else 0
    stores = sum(store_flags) - prefill
    facts = {
        "forwards": {"prefill": prefill, "denoise": len(store_flags) - sum(store_flags),
                     "store": stores},
        "forward_inputs": rec.inputs,
        "overwrites": overwrites(rec.inputs, store_flags, len(prompt), b, settings["mask_id"]),
        # masks inside the blocks it decoded (after a stop, the canvas is left masked)
        "masks_left_at": [i - len(prompt)
                          for i in range(len(prompt), (len(prompt) // b + stores) * b)
                          if x[i] == settings["mask_id"]],
    }
    return x, facts


def tiny_facts(probe: Path) -> dict[str, Any]:
    """Ids of the factory's tiny SDAR tokenizer: the mask token (its ``mask_token``), the
    generation config's eos ids (the wrapper class's stop words), the first added token (the
    ordinary ids, bytes and word merges, lie below it), and the factory's config."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(probe / "tokenizer.json"))
    tok_config = json.loads((probe / "tokenizer_config.json").read_text())
    eos = json.loads((probe / "generation_config.json").read_text())["eos_token_id"]
    return {"mask_id": tok.token_to_id(tok_config["mask_token"]),
            "eos_ids": eos if isinstance(eos, list) else [eos],
            "ordinary": min(tok.get_added_tokens_decoder()),
            "config": json.loads((probe / "config.json").read_text())}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    root = args.ref_root / REPO_DIR
    off = Official(root)
    commit = commit_of(root)
    work = args.work / "sdar"

    make_tiny_checkpoint(ARCH, work / "probe", seed=SEED)
    facts = tiny_facts(work / "probe")
    mask_id = facts["mask_id"]
    # The released config's values that the model file and the generators read; only those
    # the factory does not already write are overrides.
    needed = {"tie_word_embeddings": False, "mask_token_id": mask_id, "block_size": 4,
              "use_cache": False, "fuse_cross_entropy": True}
    overrides = {k: v for k, v in needed.items() if facts["config"].get(k, object()) != v}
    ckpt_dir = work / "ckpt"
    checkpoint = build_checkpoint(ARCH, ckpt_dir, seed=SEED, **overrides)
    model = off.model(ckpt_dir)

    for n, (name, reference, base, lengths) in enumerate(CASES):
        if args.only and args.only not in name:
            continue
        settings = {"mask_id": mask_id, **base}
        prompts = prompts_for(lengths, PROMPT_SEED + n, facts["ordinary"])
        stops = settings["stopping_criteria_idx"]
        if stops:
            # "emitted": the id the reference itself emits at generated position STOP_AT of
            # the second prompt without stops (so the stop fires); "eos": the generation
            # config's eos ids (what the wrapper class passes: the first id of each stop word)
            plain = {**settings, "stopping_criteria_idx": None if reference == GEN_REF else []}
            x, _ = run_case(off, model, reference, plain, prompts[1])
            emitted = x[len(prompts[1]) + STOP_AT]
            settings["stopping_criteria_idx"] = [
                i for t in stops for i in ([emitted] if t == "emitted" else facts["eos_ids"])]
        outputs, rows = [], []
        try:
            for p in prompts:
                x, row = run_case(off, model, reference, settings, p)
                outputs.append(x)
                rows.append(row)
        except Exception as e:  # noqa: BLE001  (the official code's own failure, reported)
            print(f"{name}: the reference raised {type(e).__name__}: {e}; no vector written")
            continue
        notes = []
        for i, f in enumerate(rows):
            if f["overwrites"]:
                notes.append(f"row {i}: the reference overwrote unmasked tokens "
                             f"([position, old, new]) {f['overwrites']}")
            if f["masks_left_at"]:
                notes.append(f"row {i}: mask ids left at generated positions {f['masks_left_at']}")
        path = write_vector(
            args.out, f"sdar_{name}", reference=reference, reference_commit=commit,
            checkpoint=checkpoint, settings=settings, prompts=prompts, outputs=outputs,
            num_forwards=sum(len(f["forward_inputs"]) for f in rows),
            forward_inputs=[f["forward_inputs"] for f in rows],
            notes="; ".join(notes),
            extra={"row_forwards": [f["forwards"] for f in rows],
                   "overwrites": [f["overwrites"] for f in rows],
                   "seed": SEED, "prompt_seed": PROMPT_SEED + n},
        )
        gen = [x[len(p):] for x, p in zip(outputs, prompts, strict=True)]
        print(f"{path.name}: {path.stat().st_size} B; generated {gen}; "
              f"forwards {[f['forwards'] for f in rows]}" + (f"; {notes}" if notes else ""))


if __name__ == "__main__":
    main()
