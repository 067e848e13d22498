"""Reference vectors for LLaDA2.0 / LLaDA2.1 (``LLaDA2MoeModelLM``) from the official code.

Run from the repository root under a transformers-4.57 environment (the LLaDA2.1 model file
imports ``transformers.utils.TransformersKwargs``; dFactory's file runs there too)::

    /work/refenv-llada2/bin/python scripts/refvectors/llada2.py --ref-root /work/refsrc

(``/work/refenv-llada2``: ``python3.11 -m venv``, then ``pip install torch==2.13.0``, then
``pip install transformers==4.57.6 safetensors tokenizers``.)

What runs, from ``<ref-root>``:

* ``inclusionAI+dFactory/models/llada2_moe/`` (commit in its ``COMMIT`` file; the LLaDA2.0
  model file, identical to the LLaDA2.0-mini model hub's): ``LLaDA2MoeModelLM.generate``, the
  static schedule (``block_length // steps`` per step, capped by the masks left), ``threshold``
  (all masked positions strictly above it if at least the step's quota are, else the top
  quota), ``minimal_topk``, ``eos_early_stop``.
* ``LLaDA2.1-mini-hub/`` (the LLaDA2.1-mini model hub's ``modeling_llada2_moe.py``; where it
  comes from: its ``SOURCE`` file): ``LLaDA2MoeModelLM.generate`` with token editing
  (``threshold``, ``editing_threshold``, ``max_post_steps``, ``num_to_transfer``).

Each generator runs on its own file's model class, built from the factory's tiny checkpoint
(``from_pretrained``: config from its ``config.json``, weights strictly, float32, CPU,
``eval()``, ``attn_implementation`` left to transformers: ``sdpa``).

Adaptations, all at this script's boundary, each recorded in the vectors (``adaptations``):

* ``veomni`` (dFactory's training framework, a submodule not checked out) is imported by the
  dFactory model file at module level: stand-ins for ``veomni.ops`` (the fused MoE kernel
  raises if called: with ``model_type`` ``llada2_moe`` the file takes its own per-expert
  ``moe_infer`` path), ``veomni.distributed.parallel_state``, ``veomni.utils.logging`` and
  ``is_liger_kernel_available`` (False: the file's own RMSNorm, RoPE and SiLU-MLP).
* ``mask_float32`` (dFactory): ``generate`` builds its block mask as a bfloat16 tensor of 0 and
  -inf, which SDPA rejects next to float32 queries (the code runs only in bfloat16). The mask
  is cast to float32 on its way into ``forward``: 0 and -inf are exact in both types, so the
  attention is the same.
* ``greedy_sampler`` (dFactory, vectors ``llada2_gen_*``): dFactory's
  ``_sample_with_temperature_topk_topp`` never takes the argmax: at ``temperature=0`` it draws
  with ``torch.multinomial`` from the temperature-1 softmax (the LLaDA2.X maintainers' word:
  inclusionAI/LLaDA2.X issue #6, fixed in the LLaDA2.1 hub file). These vectors replace that
  method by the LLaDA2.1 hub file's own (``temperature == 0``: argmax, confidence the plain
  float32 softmax), so the schedule and threshold rules are tested at temperature 0. The
  vectors ``llada2_topk1_*`` run dFactory's sampler as published, greedy through ``top_k=1``
  (the kept token has probability 1, so the draw is the argmax and every confidence is 1.0).
* ``block_mask_additive`` (LLaDA2.1 hub, vectors ``llada2_edit_*``): the 2.1 ``generate``
  builds its block mask as a bfloat16 tensor of 1 (may attend) and 0 (may not) and hands it to
  SDPA, which adds a float mask to the scores: every position then attends to every later
  block too (a future block shifts block 0's logits by up to ~25 on the tiny model). The mask
  is turned into the additive 0 / -inf mask of the 2.0 code and of training on its way into
  ``forward``, so the editing rules are tested on block-causal attention.

Checkpoint: the factory's tiny ``LLaDA2MoeModelLM``, seed 0, no overrides. ``mask_id`` is the
tiny tokenizer's ``mask_token`` (the released config has no mask id), ``eos_id`` its
``eos_token``, except in the ``*_eos_*`` cases: the tiny model never emits its EOS, so they pass
``eos_id`` = the id of ``</tool_call>``, a special token it does emit. Prompts are random ids
(fixed seed) below the first added token; the EOS cases use the first prompt (searched from a
fixed seed) whose output holds that id after at least four tokens, not at a block start.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch  # noqa: E402  (common puts the repository on sys.path first)
import transformers  # noqa: E402
from common import build_checkpoint, commit_of, parse_args, run_recorded, write_vector
from transformers import AutoTokenizer  # noqa: E402

DFACTORY = "inclusionAI+dFactory"
HUB21 = "LLaDA2.1-mini-hub"
GEN_REF = ("inclusionAI/dFactory models/llada2_moe/modeling_llada2_moe.py::"
           "LLaDA2MoeModelLM.generate")
# The same loop with the LLaDA2.1 hub file's sampler (adaptation ``greedy_sampler``).
GEN21_REF = GEN_REF + " + LLaDA2.1-mini hub _sample_with_temperature_topk_topp"
EDIT_REF = ("inclusionAI/LLaDA2.1-mini (model hub) modeling_llada2_moe.py::"
            "LLaDA2MoeModelLM.generate")
ARCH = "LLaDA2MoeModelLM"


# ---- stand-ins ---------------------------------------------------------------------------------


class _RankLogger(logging.LoggerAdapter):
    def info_rank0(self, *a: Any, **k: Any) -> None:
        self.info(*a, **k)

    def warning_rank0(self, *a: Any, **k: Any) -> None:
        self.warning(*a, **k)


def _fused_moe_unavailable(*_a: Any, **_k: Any) -> None:
    raise RuntimeError("veomni fused MoE stand-in called: the reference took the fused path")


def install_stubs() -> None:
    def module(name: str, **attrs: Any) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m

    logger = types.SimpleNamespace(
        get_logger=lambda name=None: _RankLogger(logging.getLogger(name), {}))
    module("veomni")
    module("veomni.ops", causallm_loss_function=None, fused_moe_forward=_fused_moe_unavailable)
    module("veomni.distributed")
    module("veomni.distributed.parallel_state",
           get_parallel_state=lambda: types.SimpleNamespace(ep_enabled=False))
    module("veomni.utils", logging=logger)
    module("veomni.utils.import_utils", is_liger_kernel_available=lambda: False)


def load_package(name: str, root: Path, modeling: str) -> types.ModuleType:
    """``root`` as package ``name`` (the model files import their config relatively)."""
    pkg = types.ModuleType(name)
    pkg.__path__ = [str(root)]
    sys.modules[name] = pkg
    return importlib.import_module(f"{name}.{modeling}")


# ---- the model and its boundary adaptations ----------------------------------------------------


def load_model(module: types.ModuleType, ckpt: Path) -> torch.nn.Module:
    model, info = module.LLaDA2MoeModelLM.from_pretrained(
        str(ckpt), torch_dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"checkpoint does not load strictly: {bad}"
    assert model.config.model_type == "llada2_moe", model.config.model_type
    return model.eval()


def adapt_mask(model: torch.nn.Module, kind: str) -> None:
    """Wrap the instance's ``forward`` (``generate`` calls ``self.forward``)."""
    inner = type(model).forward.__get__(model)

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any) -> Any:
        if kind == "mask_float32":
            values = set(torch.unique(attention_mask.float()).tolist())
            assert values <= {0.0, float("-inf")}, values
            attention_mask = attention_mask.to(torch.float32)
        elif kind == "block_mask_additive":
            values = set(torch.unique(attention_mask.float()).tolist())
            assert values <= {0.0, 1.0}, values
            attention_mask = torch.zeros(attention_mask.shape).masked_fill(
                attention_mask == 0, float("-inf"))
        return inner(input_ids, attention_mask=attention_mask, **kw)

    model.forward = forward


def use_greedy_sampler(model: torch.nn.Module, hub21: types.ModuleType) -> None:
    fixed = hub21.LLaDA2MoeModelLM._sample_with_temperature_topk_topp
    model._sample_with_temperature_topk_topp = types.MethodType(fixed, model)


# ---- running one case ---------------------------------------------------------------------------


class Runner:
    def __init__(self, args: Any):
        install_stubs()
        self.args = args
        self.dfactory = load_package("ref_dfactory_llada2",
                                     args.ref_root / DFACTORY / "models" / "llada2_moe",
                                     "modeling_llada2_moe")
        self.hub21 = load_package("ref_llada21_hub", args.ref_root / HUB21,
                                  "modeling_llada2_moe")
        self.commits = {GEN_REF: commit_of(args.ref_root / DFACTORY),
                        GEN21_REF: (f"{commit_of(args.ref_root / DFACTORY)} + "
                                    f"{commit_of(args.ref_root / HUB21)}"),
                        EDIT_REF: commit_of(args.ref_root / HUB21)}
        self.ckpt_dir = args.work / "llada2-seed0"
        self.checkpoint = build_checkpoint(ARCH, self.ckpt_dir, seed=0)
        tok = AutoTokenizer.from_pretrained(str(self.ckpt_dir))
        self.mask_id = tok.mask_token_id
        self.eos_id = tok.eos_token_id
        self.first_added = min(tok.added_tokens_decoder)
        # The tiny model never emits its EOS: the EOS cases stop on a special token it does
        # emit (the reference's ``eos_id`` is an argument like any other).
        self.stop_id = tok.convert_tokens_to_ids("</tool_call>")
        self.models: dict[str, torch.nn.Module] = {}
        with open(self.ckpt_dir / "config.json", encoding="utf-8") as f:
            assert "mask_token_id" not in json.load(f)
        torch.manual_seed(0)

    def model(self, variant: str) -> torch.nn.Module:
        if variant not in self.models:
            self.models[variant] = self._model(variant)
        return self.models[variant]

    def _model(self, variant: str) -> torch.nn.Module:
        if variant == "edit":
            model = load_model(self.hub21, self.ckpt_dir)
            adapt_mask(model, "block_mask_additive")
        else:
            model = load_model(self.dfactory, self.ckpt_dir)
            adapt_mask(model, "mask_float32")
            if variant == "gen":
                use_greedy_sampler(model, self.hub21)
        return model

    def prompt(self, length: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.first_added, (length,), generator=g).tolist()

    def run(self, variant: str, prompt: list[int], settings: dict[str, Any]
            ) -> tuple[list[int], Any]:
        model = self.model(variant)
        ids = torch.tensor([prompt])
        out, rec = run_recorded(model.model, lambda: model.generate(inputs=ids, **settings))
        return out[0].tolist(), rec


ADAPTATIONS = {
    "gen": ["veomni stand-ins", "mask_float32", "greedy_sampler"],
    "topk1": ["veomni stand-ins", "mask_float32"],
    "edit": ["block_mask_additive"],
}


def cases(r: Runner) -> list[tuple[str, str, dict[str, Any], Callable[[], list[int]]]]:
    """(name, variant, settings, prompt maker). ``eos_*`` cases search a prompt whose output
    holds the EOS."""
    ids = {"mask_id": r.mask_id, "eos_id": r.eos_id, "temperature": 0.0}
    static = {"threshold": 1.0}  # probabilities are never > 1: the fixed schedule alone
    out: list[tuple[str, str, dict[str, Any], Callable[[], list[int]]]] = []

    def add(name: str, variant: str, length: int, seed: int, **s: Any) -> None:
        out.append((name, variant, {**ids, **s}, lambda: r.prompt(length, seed)))

    # LLaDA2.0 loop, greedy sampler: schedule, threshold, minimal_topk, partial prompt blocks.
    add("llada2_gen_static_b8_s4_g24_p5", "gen", 5, 1, block_length=8, steps=4,
        gen_length=24, **static)
    add("llada2_gen_static_b8_s4_g24_p8", "gen", 8, 2, block_length=8, steps=4,
        gen_length=24, **static)
    add("llada2_gen_static_b8_s3_g16_p13", "gen", 13, 3, block_length=8, steps=3,
        gen_length=16, **static)
    add("llada2_gen_static_b4_s4_g16_p6", "gen", 6, 4, block_length=4, steps=4,
        gen_length=16, **static)
    add("llada2_gen_static_b8_s8_g16_p3", "gen", 3, 5, block_length=8, steps=8,
        gen_length=16, **static)
    add("llada2_gen_static_b16_s5_g32_p20", "gen", 20, 6, block_length=16, steps=5,
        gen_length=32, **static)
    add("llada2_gen_thr05_b8_s8_g24_p5", "gen", 5, 7, block_length=8, steps=8,
        gen_length=24, threshold=0.5)
    add("llada2_gen_thr03_b8_s4_g24_p11", "gen", 11, 8, block_length=8, steps=4,
        gen_length=24, threshold=0.3)
    add("llada2_gen_thr07_b16_s16_g32_p9", "gen", 9, 9, block_length=16, steps=16,
        gen_length=32, threshold=0.7)
    add("llada2_gen_thr095_b8_s8_g16_p16", "gen", 16, 10, block_length=8, steps=8,
        gen_length=16)  # threshold: the default 0.95
    add("llada2_gen_mintopk2_b8_s8_g8_p5", "gen", 5, 11, block_length=8, steps=8,
        gen_length=8, minimal_topk=2, **static)
    # LLaDA2.0 sampler as published, greedy through top_k=1.
    add("llada2_topk1_thr09_b8_s4_g24_p5", "topk1", 5, 12, block_length=8, steps=4,
        gen_length=24, threshold=0.9, top_k=1)
    add("llada2_topk1_thr05_b4_s4_g16_p10", "topk1", 10, 13, block_length=4, steps=4,
        gen_length=16, threshold=0.5, top_k=1)
    # LLaDA2.1 editing.
    add("llada2_edit_t07_e05_post16_b8_g24_p5", "edit", 5, 14, block_length=8, steps=8,
        gen_length=24, threshold=0.7, editing_threshold=0.5, max_post_steps=16)
    add("llada2_edit_t05_e00_post4_b8_g24_p13", "edit", 13, 15, block_length=8, steps=8,
        gen_length=24, threshold=0.5, editing_threshold=0.0, max_post_steps=4)
    add("llada2_edit_t09_e09_post0_b4_g16_p6", "edit", 6, 16, block_length=4, steps=4,
        gen_length=16, threshold=0.9, editing_threshold=0.9, max_post_steps=0)
    add("llada2_edit_t03_e02_post2_b8_g16_p8", "edit", 8, 17, block_length=8, steps=8,
        gen_length=16, threshold=0.3, editing_threshold=0.2, max_post_steps=2)
    add("llada2_edit_defaults_b16_g32_p7", "edit", 7, 18, block_length=16, steps=16,
        gen_length=32)  # threshold 0.95, editing_threshold 0.9, max_post_steps 16
    return out


EOS_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("llada2_gen_eos_stop_thr05_b8_s8_g32", "gen",
     {"block_length": 8, "steps": 8, "gen_length": 32, "threshold": 0.5,
      "eos_early_stop": True}),
    ("llada2_gen_eos_nostop_thr05_b8_s8_g32", "gen",
     {"block_length": 8, "steps": 8, "gen_length": 32, "threshold": 0.5,
      "eos_early_stop": False}),
    ("llada2_gen_eos_stop_static_b4_s2_g32", "gen",
     {"block_length": 4, "steps": 2, "gen_length": 32, "threshold": 1.0,
      "eos_early_stop": True}),
    ("llada2_edit_eos_stop_t07_e05_b8_g32", "edit",
     {"block_length": 8, "steps": 8, "gen_length": 32, "threshold": 0.7,
      "editing_threshold": 0.5, "max_post_steps": 16, "eos_early_stop": True}),
    ("llada2_edit_eos_nostop_t07_e05_b8_g32", "edit",
     {"block_length": 8, "steps": 8, "gen_length": 32, "threshold": 0.7,
      "editing_threshold": 0.5, "max_post_steps": 16, "eos_early_stop": False}),
]


def eos_prompt(r: Runner, variant: str, settings: dict[str, Any], seed: int) -> list[int]:
    """The first prompt (lengths 3..12, seeds from ``seed``) whose output holds the EOS after
    at least 4 other tokens, where the EOS is not the first token of a block."""
    s = {**settings, "eos_early_stop": False}
    for k in range(200):
        prompt = r.prompt(3 + k % 10, seed + k)
        out, _ = r.run(variant, prompt, s)
        if settings["eos_id"] in out[4:]:
            pos = len(prompt) + out.index(settings["eos_id"])
            if pos % s["block_length"]:
                return prompt
    raise RuntimeError(f"no prompt with an EOS for {settings}")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    transformers.logging.set_verbosity_error()
    r = Runner(args)
    todo = [(n, v, s, p) for n, v, s, p in cases(r)]
    for i, (name, variant, s) in enumerate(EOS_CASES):
        full = {"mask_id": r.mask_id, "eos_id": r.stop_id, "temperature": 0.0, **s}
        todo.append((name, variant, full,
                     (lambda v=variant, f=full, k=i: eos_prompt(r, v, f, 1000 + 100 * k))))
    for name, variant, settings, make_prompt in todo:
        if args.only and args.only not in name:
            continue
        prompt = make_prompt()
        out, rec = r.run(variant, prompt, settings)
        # dFactory's early-stop path returns ``x[:, :eos_pos + 1]``: the prompt included.
        with_prompt = (variant != "edit" and bool(settings.get("eos_early_stop"))
                       and out[: len(prompt)] == prompt and out[-1] == settings["eos_id"])
        generated = out[len(prompt):] if with_prompt else out
        assert r.mask_id not in generated, f"{name}: a mask id left in the output"
        reference = {"gen": GEN21_REF, "topk1": GEN_REF, "edit": EDIT_REF}[variant]
        notes = {
            "gen": "dFactory's generate loop with the LLaDA2.1 hub file's temperature-0 sampler",
            "topk1": "dFactory's generate as published; greedy through top_k=1 (every "
                     "confidence 1.0)",
            "edit": "LLaDA2.1 hub generate; its 0/1 block mask made additive (0/-inf)",
        }[variant]
        path = write_vector(
            args.out, name, reference=reference, reference_commit=r.commits[reference],
            checkpoint=r.checkpoint, settings=settings, prompts=[prompt], outputs=[out],
            num_forwards=rec.count, forward_inputs=rec.inputs, notes=notes,
            extra={"adaptations": ADAPTATIONS[variant],
                   "returned_with_prompt": bool(with_prompt)})
        print(f"{path.name}: prompt {len(prompt)}, generated {generated}, "
              f"{rec.count} forwards{' (returned with the prompt)' if with_prompt else ''}")


if __name__ == "__main__":
    main()
