"""Reference vectors for the hybrid Mamba2 + attention architectures from transformers' own
classes (``GraniteMoeHybridForCausalLM``, ``BambaForCausalLM``, ``Mamba2ForCausalLM``).

Run from the repository root under a transformers-4.57 environment with the project's torch
build (``/work/refenv-llada2`` has transformers 4.57.6, torch 2.13.0+cpu, safetensors and
tokenizers; nothing is installed into it)::

    /work/refenv-llada2/bin/python scripts/refvectors/hybrid.py

It builds each tiny checkpoint with dllm's own factory (``make_tiny_hybrid_checkpoint``,
imported from this repository by path; same torch build, so the same weight bytes), loads it
with transformers' class (strictly: no missing or unexpected tensor), float32, CPU, eager
attention, ``eval()``, and writes ``tests/data/refvectors/hybrid_<layout>.json`` with:

* ``generate``: greedy ``model.generate(ids, max_new_tokens=16, do_sample=False)`` per prompt
  (three prompts of 5, 13 and 29 random ids, alone), with EOS disabled so every row runs 16
  steps; and the same prompts batched (left padding, ``attention_mask``), which must give the
  same ids (the script checks it).
* ``logits``: a full no-cache forward (``use_cache=False``) of prompt + generated ids, every
  position, for the 5- and 29-token prompts: float32 little-endian, base64.
* ``mixer`` (layer 0, a Mamba2 mixer): its output for a seeded input of 21 tokens, no cache;
  its output for token 21 after a cached prefill of 20 (the one-token cache path, fed
  ``cache_position`` explicitly: a fresh hybrid cache reports its batch size as its length);
  and the conv/SSM states it leaves after the 20-token prefill.

Traps of transformers 4.57 this script steps around (see ``notes`` in each file): a
multi-token forward after a cached prefill restarts the SSM from zero (Granite, Bamba: only a
``seq_len == 1`` forward reads the cache) or takes the one-token branch on the first token
only (Mamba2: any ``cache_position[0] > 0``); so blocks and chunks are compared against the
full no-cache forward, and decode against ``generate``. The script measures the first trap
and records the difference it makes.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import transformers  # noqa: E402

from dllm.testing.factory import make_tiny_hybrid_checkpoint, weights_digest  # noqa: E402

FORMAT_VERSION = 1
COMMAND = "/work/refenv-llada2/bin/python scripts/refvectors/hybrid.py"
SEED = 0
PROMPT_SEED = 1234
PROMPT_LENS = (5, 13, 29)
LOGIT_PROMPTS = (0, 2)
NEW_TOKENS = 16
MIXER_TOKENS = 21
# (name, layout, config overrides)
CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("granite_h_micro", "granite-h-micro", {}),
    ("granite_h_micro_rope", "granite-h-micro", {"position_embedding_type": "rope"}),
    ("granite_h_tiny", "granite-h-tiny", {}),
    ("bamba", "bamba", {}),
    ("mamba2", "mamba2", {}),
    ("nemotron_h", "nemotron-h", {}),  # not in transformers 4.x: from tests/naive_hybrid.py
)


def b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().to(torch.float32).contiguous().numpy().tobytes()).decode()


def prompts_for(config: dict[str, Any], tokenizer_size_floor: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(0, tokenizer_size_floor, (n,), generator=gen).tolist()
            for n in PROMPT_LENS]


def first_added_id(path: Path) -> int:
    tok = json.loads((path / "tokenizer_config.json").read_text())
    return min(int(k) for k in tok["added_tokens_decoder"])


def load(path: Path) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "mismatched_keys" or
           (k == "mismatched_keys" and v)}
    if bad:
        raise SystemExit(f"{path}: not a strict load: {bad}")
    model.eval()
    model.generation_config.eos_token_id = None  # 16 steps per row, whatever is emitted
    return model


def generate(model: torch.nn.Module, prompts: list[list[int]], pad: int
             ) -> tuple[list[list[int]], list[list[int]]]:
    alone = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad)
        alone.append(out[0, len(p):].tolist())
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=pad)
    batched = [row[width:].tolist() for row in out]
    return alone, batched


def min_margin(model: torch.nn.Module, prompts: list[list[int]], outputs: list[list[int]]
               ) -> float:
    """The smallest gap between the top two logits over every greedy step (no-cache forward
    of the whole row): a near tie would make token-for-token parity fragile."""
    gap = float("inf")
    for p, o in zip(prompts, outputs, strict=True):
        logits = model(torch.tensor([p + o]), use_cache=False).logits[0]
        top = logits[len(p) - 1:len(p) + len(o) - 1].topk(2, dim=-1).values
        gap = min(gap, float((top[:, 0] - top[:, 1]).min()))
    return gap


def mixer_vectors(model: torch.nn.Module, arch: str) -> dict[str, Any]:
    """Layer 0's mixer: no-cache output, the one-token cache path after a cached prefill, the
    states it leaves, and the restart trap."""
    config = model.config
    gen = torch.Generator().manual_seed(SEED + 7)
    x = torch.randn(1, MIXER_TOKENS, config.hidden_size, generator=gen)
    n = MIXER_TOKENS - 1
    if arch == "Mamba2ForCausalLM":
        mixer = model.backbone.layers[0].mixer
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Cache

        def cache():
            return Mamba2Cache(config, 1, dtype=torch.float32)

        def call(h, c, pos):
            return mixer(h, cache_params=c, cache_position=pos)
    else:
        layer = model.model.layers[0]
        mixer = layer.mamba
        if arch == "BambaForCausalLM":
            from transformers.models.bamba.modeling_bamba import (
                HybridMambaAttentionDynamicCache,
            )
        else:
            from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
                HybridMambaAttentionDynamicCache,
            )

        def cache():
            return HybridMambaAttentionDynamicCache(config, 1, dtype=torch.float32)

        def call(h, c, pos):
            return mixer(hidden_states=h, cache_params=c, cache_position=pos)

    with torch.no_grad():
        full = call(x, None, None)[0]
        c = cache()
        call(x[:, :n], c, torch.arange(n))
        if hasattr(c, "has_previous_state"):
            c.has_previous_state = True  # what the model's forward sets after a prefill
        layer_idx = 0
        conv_state = c.conv_states[layer_idx][0].clone()  # [conv_dim, K]: the last K inputs
        ssm_state = c.ssm_states[layer_idx][0].clone()
        step = call(x[:, n:], c, torch.tensor([n]))[0, 0]
        # The trap: two tokens after the cached prefill of n - 1 (Granite/Bamba: from zero).
        c2 = cache()
        call(x[:, :n - 1], c2, torch.arange(n - 1))
        if hasattr(c2, "has_previous_state"):
            c2.has_previous_state = True
        two = call(x[:, n - 1:], c2, torch.arange(n - 1, n + 1))[0]
    return {
        "layer": 0, "tokens": MIXER_TOKENS, "input_seed": SEED + 7,
        "input": b64(x[0]), "output": b64(full), "decode_after_prefill": n,
        "decode_output": b64(step),
        "conv_state_after_prefill": b64(conv_state), "conv_state_shape": list(conv_state.shape),
        "ssm_state_after_prefill": b64(ssm_state), "ssm_state_shape": list(ssm_state.shape),
        "trap_two_tokens_after_prefill_max_abs_diff":
            float((two - full[n - 1:]).abs().max()),
    }


def write_naive(out_dir: Path, name: str, layout: str, path: Path,
                prompts: list[list[int]]) -> None:
    """Nemotron-H has no transformers 4.x class: its vectors are the naive reference's
    (``tests/naive_hybrid.py``, written from the published math, float64): greedy ids by full
    recompute at every step, and the full-forward logits."""
    sys.path.insert(0, str(REPO / "tests"))
    import naive_hybrid

    loaded = naive_hybrid.load(path)
    outputs = [naive_hybrid.naive_greedy(path, p, NEW_TOKENS) for p in prompts]
    logits = []
    for i in LOGIT_PROMPTS:
        ids = prompts[i] + outputs[i]
        out = naive_hybrid.naive_logits(path, ids, loaded=loaded)
        logits.append({"prompt": i, "tokens": ids, "shape": list(out.shape),
                       "float32_b64": b64(out)})
    record = {
        "format": FORMAT_VERSION, "name": f"hybrid_{name}",
        "reference": "tests/naive_hybrid.py (NemotronHForCausalLM from the published math)",
        "reference_commit": "this repository", "command": COMMAND,
        "checkpoint": {"layout": layout, "architecture": "NemotronHForCausalLM", "seed": SEED,
                       "overrides": {}, "weights_sha256": weights_digest(path)},
        "settings": {"max_new_tokens": NEW_TOKENS, "greedy": True, "eos_token_id": None,
                     "dtype": "float64"},
        "prompts": prompts, "outputs": outputs, "logits": logits,
        "notes": "greedy by full recompute; logits stored as float32",
    }
    with open(out_dir / f"hybrid_{name}.json", "w", encoding="utf-8") as f:
        json.dump(record, f, separators=(",", ":"))
        f.write("\n")
    print(f"hybrid_{name}.json: outputs {outputs[0][:6]}... (naive reference)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "refvectors")
    p.add_argument("--work", type=Path, default=Path("/tmp/dllm-refvectors-hybrid"))
    p.add_argument("--only", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for name, layout, overrides in CASES:
        if args.only and args.only not in name:
            continue
        path = make_tiny_hybrid_checkpoint(layout, args.work / name, seed=SEED, **overrides)
        config = json.loads((path / "config.json").read_text())
        arch = config["architectures"][0]
        prompts = prompts_for(config, first_added_id(path))
        if arch == "NemotronHForCausalLM":
            write_naive(args.out, name, layout, path, prompts)
            continue
        model = load(path)
        with torch.no_grad():
            alone, batched = generate(model, prompts, pad=config["pad_token_id"])
            if alone != batched:
                raise SystemExit(f"{name}: batched generate differs from alone")
            margin = min_margin(model, prompts, alone)
            if margin < 1e-3:
                raise SystemExit(f"{name}: a greedy step is a near tie ({margin:.2g})")
            logits = []
            for i in LOGIT_PROMPTS:
                ids = torch.tensor([prompts[i] + alone[i]])
                out = model(ids, use_cache=False).logits[0]
                logits.append({"prompt": i, "tokens": ids[0].tolist(),
                               "shape": list(out.shape), "float32_b64": b64(out)})
        record = {
            "format": FORMAT_VERSION, "name": f"hybrid_{name}",
            "reference": f"huggingface/transformers {transformers.__version__} {arch}",
            "reference_commit": f"transformers=={transformers.__version__}, "
                                f"torch=={torch.__version__}",
            "command": COMMAND + (f" --only {args.only}" if args.only else ""),
            "checkpoint": {"layout": layout, "architecture": arch, "seed": SEED,
                           "overrides": overrides, "weights_sha256": weights_digest(path)},
            "settings": {"max_new_tokens": NEW_TOKENS, "do_sample": False,
                         "eos_token_id": None, "torch_dtype": "float32",
                         "attn_implementation": "eager", "device": "cpu"},
            "prompts": prompts, "outputs": alone, "batched_outputs_equal": True,
            "min_top2_logit_margin": margin,
            "logits": logits, "mixer": mixer_vectors(model, arch),
            "notes": "generate with EOS disabled; batched = left-padded with attention_mask. "
                     "mixer.trap_*: transformers' result for 2 tokens after a cached prefill "
                     "minus the no-cache forward (non-zero: the state restarted).",
        }
        args.out.mkdir(parents=True, exist_ok=True)
        out_path = args.out / f"hybrid_{name}.json"
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(record, f, separators=(",", ":"))
            f.write("\n")
        print(f"{out_path.name}: outputs {alone[0][:6]}..., margin {margin:.3g}, trap diff "
              f"{record['mixer']['trap_two_tokens_after_prefill_max_abs_diff']:.3g}")


if __name__ == "__main__":
    main()
