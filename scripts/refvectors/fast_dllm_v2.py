"""Reference vectors for Fast-dLLM v2 (``Fast_dLLM_QwenForCausalLM``) from the official code.

Run from the repository root under a transformers-4.53.1 environment (the version in the
released ``config.json``; the model file needs ``layer_type_validation``, new in 4.53)::

    /work/refenv-fd2/bin/python scripts/refvectors/fast_dllm_v2.py --ref-root /work/refsrc

(``/work/refenv-fd2``: ``python3.11 -m venv``, then ``pip install torch==2.13.0``, then
``pip install transformers==4.53.1 safetensors tokenizers einops``.)

What runs, unmodified, from ``<ref-root>``:

* ``Fast_dLLM_v2_7B-hub/`` (the model hub's ``modeling.py`` and ``configuration.py`` of
  Efficient-Large-Model/Fast_dLLM_v2_7B; where they come from: its ``SOURCE`` file): the model,
  and ``Fast_dLLM_QwenForCausalLM.generate`` (the model card's generator: blocks of
  ``block_size``, sub-blocks of ``small_block_size`` decoded in order, in each every masked
  position above ``threshold`` plus the most confident one, the block-level KV cache, the
  commit forward that caches a finished block and reads the next block's first token, stop as
  soon as ``stop_token`` has no mask before it).
* ``NVlabs+Fast-dLLM-v2/v2/generation_functions.py`` (NVlabs/Fast-dLLM ``v2/``, commit in its
  ``COMMIT`` file): ``Fast_dLLM_QwenForCausalLM.batch_sample``, bound to the model as
  ``v2/eval.py`` binds it (``types.MethodType``), called as eval.py calls it for a batch of
  one (``min_len`` = ``seq_len`` = the prompt length). It finishes a block before stopping and
  pads after the first ``stop_token``.

The model: ``from_pretrained`` on the factory's tiny checkpoint (config from its
``config.json``, weights strictly, float32, CPU, ``eval()``; attention is the file's own SDPA
call with its boolean block mask). No stand-ins are needed. ``use_block_cache=False`` (the
default of both): the sub-block cache is an approximation with no dllm counterpart.

Checkpoint: the factory's tiny ``Fast_dLLM_QwenForCausalLM``, seed 0, no overrides.
``mask_id`` is the tiny tokenizer's ``|<MASK>|``; ``stop_token`` its ``eos_token``
(``<|im_end|>``), except in the ``*_nostop_*`` cases, which pass the id of ``<|quad_start|>``
(a special token the model never emits) to get full-length outputs. Prompts are random ids
(fixed seed) below the first added token. Prompts of exactly one block are avoided: both
generators then run the first block without the prompt (no prefill when the prompt length
is not greater than ``block_size``, and the forward covers only the last ``block_size``
tokens, all masks); see the report.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import torch  # noqa: E402  (common puts the repository on sys.path first)
import transformers  # noqa: E402
from common import build_checkpoint, commit_of, parse_args, run_recorded, write_vector
from transformers import AutoTokenizer  # noqa: E402

HUB = "Fast_dLLM_v2_7B-hub"
NV = "NVlabs+Fast-dLLM-v2"
GEN_REF = "Efficient-Large-Model/Fast_dLLM_v2_7B (model hub) modeling.py::" \
          "Fast_dLLM_QwenForCausalLM.generate"
BATCH_REF = "NVlabs/Fast-dLLM v2/generation_functions.py::Fast_dLLM_QwenForCausalLM.batch_sample"
ARCH = "Fast_dLLM_QwenForCausalLM"


def load_hub(root: Path) -> types.ModuleType:
    """``modeling.py`` imports ``configuration`` as a top-level module."""
    sys.path.insert(0, str(root))
    try:
        import modeling  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(root))
    return modeling


def load_generation_functions(root: Path) -> types.ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "ref_fast_dllm_v2_generation_functions", root / "v2" / "generation_functions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # transformers' @auto_docstring looks its source file up
    spec.loader.exec_module(module)
    return module


class Runner:
    def __init__(self, args: Any):
        self.args = args
        self.modeling = load_hub(args.ref_root / HUB)
        self.gen_functions = load_generation_functions(args.ref_root / NV)
        self.commits = {GEN_REF: commit_of(args.ref_root / HUB),
                        BATCH_REF: commit_of(args.ref_root / NV)}
        self.ckpt_dir = args.work / "fast_dllm_v2-seed0"
        self.checkpoint = build_checkpoint(ARCH, self.ckpt_dir, seed=0)
        self.tok = AutoTokenizer.from_pretrained(str(self.ckpt_dir))
        self.mask_id = self.tok.convert_tokens_to_ids("|<MASK>|")
        self.eos_id = self.tok.eos_token_id
        self.never_id = self.tok.convert_tokens_to_ids("<|quad_start|>")
        self.first_added = min(self.tok.added_tokens_decoder)
        model, info = self.modeling.Fast_dLLM_QwenForCausalLM.from_pretrained(
            str(self.ckpt_dir), torch_dtype=torch.float32, output_loading_info=True)
        bad = {k: v for k, v in info.items() if v}
        assert not bad, f"checkpoint does not load strictly: {bad}"
        self.model = model.eval()
        self.model.mdm_sample = types.MethodType(
            self.gen_functions.Fast_dLLM_QwenForCausalLM.batch_sample, self.model)

    def prompt(self, length: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.first_added, (length,), generator=g).tolist()

    def run(self, reference: str, prompt: list[int], settings: dict[str, Any]
            ) -> tuple[list[int], Any]:
        ids = torch.tensor([prompt])
        if reference == GEN_REF:
            def call() -> Any:
                return self.model.generate(ids, tokenizer=self.tok, **settings)
        else:
            def call() -> Any:
                return self.model.mdm_sample(
                    ids, tokenizer=self.tok, min_len=len(prompt),
                    seq_len=torch.tensor([len(prompt)]), **settings)[0]
        out, rec = run_recorded(self.model.model, call)
        out = out[0] if out.dim() == 2 else out
        return out.tolist(), rec


def cases(r: Runner) -> list[tuple[str, str, int, int, dict[str, Any]]]:
    """(name, reference, prompt length, prompt seed, settings)."""
    base = {"mask_id": r.mask_id, "temperature": 0.0, "use_block_cache": False}
    stop = {**base, "stop_token": r.eos_id}
    nostop = {**base, "stop_token": r.never_id}
    g, b = GEN_REF, BATCH_REF
    return [
        ("fast_dllm_v2_gen_b8_sb4_t09_n16_p5", g, 5, 1,
         {**stop, "block_size": 8, "small_block_size": 4, "threshold": 0.9,
          "max_new_tokens": 16}),
        ("fast_dllm_v2_gen_nostop_b8_sb4_t09_n24_p5", g, 5, 1,
         {**nostop, "block_size": 8, "small_block_size": 4, "threshold": 0.9,
          "max_new_tokens": 24}),
        ("fast_dllm_v2_gen_nostop_b8_sb8_t07_n24_p10", g, 10, 2,
         {**nostop, "block_size": 8, "small_block_size": 8, "threshold": 0.7,
          "max_new_tokens": 24}),
        ("fast_dllm_v2_gen_nostop_b8_sb2_t1_n16_p16", g, 16, 3,
         {**nostop, "block_size": 8, "small_block_size": 2, "threshold": 1,
          "max_new_tokens": 16}),
        ("fast_dllm_v2_gen_nostop_b16_sb4_t05_n32_p7", g, 7, 4,
         {**nostop, "block_size": 16, "small_block_size": 4, "threshold": 0.5,
          "max_new_tokens": 32}),
        ("fast_dllm_v2_gen_nostop_b32_sb8_t09_n32_p20", g, 20, 5,
         {**nostop, "block_size": 32, "small_block_size": 8, "threshold": 0.9,
          "max_new_tokens": 32}),
        ("fast_dllm_v2_gen_b16_sb8_t05_n32_p21", g, 21, 6,
         {**stop, "block_size": 16, "small_block_size": 8, "threshold": 0.5,
          "max_new_tokens": 32}),
        ("fast_dllm_v2_batch_b8_sb4_t09_n16_p5", b, 5, 1,
         {**stop, "block_size": 8, "small_block_size": 4, "threshold": 0.9,
          "max_new_tokens": 16}),
        ("fast_dllm_v2_batch_nostop_b8_sb4_t09_n24_p5", b, 5, 1,
         {**nostop, "block_size": 8, "small_block_size": 4, "threshold": 0.9,
          "max_new_tokens": 24}),
        ("fast_dllm_v2_batch_nostop_b8_sb2_t08_n24_p12", b, 12, 7,
         {**nostop, "block_size": 8, "small_block_size": 2, "threshold": 0.8,
          "max_new_tokens": 24}),
        ("fast_dllm_v2_batch_nostop_b8_sb8_t095_n16_p24", b, 24, 8,
         {**nostop, "block_size": 8, "small_block_size": 8, "threshold": 0.95,
          "max_new_tokens": 16}),
        ("fast_dllm_v2_batch_nostop_b16_sb4_t06_n32_p9", b, 9, 9,
         {**nostop, "block_size": 16, "small_block_size": 4, "threshold": 0.6,
          "max_new_tokens": 32}),
        ("fast_dllm_v2_batch_b16_sb8_t05_n32_p21", b, 21, 6,
         {**stop, "block_size": 16, "small_block_size": 8, "threshold": 0.5,
          "max_new_tokens": 32}),
    ]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    r = Runner(args)
    for name, reference, length, seed, settings in cases(r):
        if args.only and args.only not in name:
            continue
        assert length != settings["block_size"], "one-block prompts skip the prompt"
        prompt = r.prompt(length, seed)
        out, rec = r.run(reference, prompt, settings)
        assert out[:length] == prompt
        generated = out[length:]
        assert r.mask_id not in generated, f"{name}: a mask id left in the output"
        path = write_vector(
            args.out, name, reference=reference, reference_commit=r.commits[reference],
            checkpoint=r.checkpoint, settings=settings, prompts=[prompt], outputs=[out],
            num_forwards=rec.count, forward_inputs=rec.inputs,
            notes="outputs: the whole sequence as returned (prompt included; batch_sample "
                  "pads after the stop token with the tokenizer's pad id)")
        print(f"{path.name}: prompt {length}, generated {generated}, {rec.count} forwards")


if __name__ == "__main__":
    main()
