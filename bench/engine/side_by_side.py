"""Whole requests, dllm beside the official generator at the same shape and settings (issue 24,
item 3): prefill included, tokens per second as a user sees them. Two families so far:

* ``--family sdar``: JetAstra/SDAR's ``generate.py::block_diffusion_generate`` (the README's
  generator) with its own ``modeling_sdar.py``; shapes ``sdar-8b``, ``sdar-4b``, ``tiny``.
* ``--family llada``: NVlabs/Fast-dLLM's ``llada/generate.py`` (``generate``,
  ``generate_with_prefix_cache``, ``generate_with_dual_cache`` by ``--cache-mode exact``,
  ``prefix``, ``dual``) with its ``llada/model``; dllm with the same ``cache_mode``; shapes
  ``llada-8b`` (the released LLaDA-8B-Instruct config's sizes) and ``tiny``.

Run it under the reference's environment (the one its reference-vector script uses:
transformers 4.52.x for SDAR, 4.49.0 for Fast-dLLM), from this repository's root::

    /work/refenv452/bin/python bench/engine/side_by_side.py --ref-root /work/refsrc \\
        --shape sdar-8b --batch-size 1,8 --device cuda        # an H200
    /work/refenv449/bin/python bench/engine/side_by_side.py --ref-root /work/refsrc \\
        --family llada --shape llada-8b --cache-mode dual --block 32 --steps 32 --device cuda
    /work/refenv452/bin/python bench/engine/side_by_side.py --ref-root /work/refsrc \\
        --shape tiny --batch-size 1,8 --device cpu            # the plumbing, on a CPU

Both sides: random weights (dllm's ``load_format="dummy"``, the reference's own initialisation;
the timing does not depend on them), the same dtype, ``--batch-size`` prompts of
``--prompt-len`` random ids submitted at once, ``--gen-len`` new tokens each with no stop,
block ``--block``, ``--steps`` denoising steps a block (``low_confidence_static``, greedy:
SDAR's official greedy setting is top-k 1; Fast-dLLM's ``temperature=0``, ``steps`` its total
over the blocks), one warm-up call first (the official generators take one prompt at a time,
their canvas is ``[1, L]``: a batch of B is its B prompts one after another), then ``--repeats`` timed calls (the
median is reported; the reference's warm-up is one prompt: it runs a batch prompt by prompt). SDAR's reference needs ``flash_attn``, which is not installed here: its
two calls are stood in for exactly as in ``scripts/refvectors/sdar.py`` (RMSNorm in float32,
``flash_attn_func(causal=False)`` as ``scaled_dot_product_attention``; on CUDA that runs
FlashAttention's own kernel inside torch), so the reference is measured with torch's SDPA in
flash-attn's place. The two sides run one after the other in this process, dllm's engine shut
down before the reference model is built (both would not fit beside dllm's KV pool).

Prints a table and writes ``bench/results/side-by-side-<stamp>.{md,json}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "refvectors")]
try:  # dllm installed (pip install -e .), or this source tree as it is
    import dllm.models  # noqa: F401
except ModuleNotFoundError:  # the tree maps dllm.models and dllm.runner to models/, runner/
    import dllm

    dllm.__path__.append(str(ROOT))

from bench.report import stamp, write_report  # noqa: E402

# CPU-sized shapes for trying the script out.
TINY = {"sdar": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     vocab_size=2048, tie_word_embeddings=False, block_size=4,
                     max_position_embeddings=32768),
        "llada": dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, mlp_hidden_size=768,
                      vocab_size=2048, embedding_size=2048)}
LLADA_8B = ROOT / "tests" / "data" / "configs" / "GSAI-ML__LLaDA-8B-Instruct" / "config.json"
ARCH = {"sdar": "SDARForCausalLM", "llada": "LLaDAModelLM"}


def checkpoint(family: str, shape: str, root: Path) -> str:
    """A checkpoint directory without weights (config, the factory's tokenizer) of ``shape``."""
    import json

    from bench.engine.offline import SHAPES, checkpoint_dir

    if family == "sdar" and shape != "tiny":
        if not SHAPES[shape][0].startswith("SDAR"):
            raise SystemExit(f"--shape {shape}: not an SDAR shape")
        return checkpoint_dir(shape, root)
    from dllm.testing import make_tiny_checkpoint

    if shape == "tiny":
        sizes = TINY[family]
    elif family == "llada" and shape == "llada-8b":
        released = json.loads(LLADA_8B.read_text())
        sizes = {k: released[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads",
                                          "mlp_hidden_size", "vocab_size", "embedding_size")}
    else:
        raise SystemExit(f"--shape {shape}: no such {family} shape (tiny, llada-8b)")
    path = root / shape
    make_tiny_checkpoint(ARCH[family], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(sizes)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").unlink()
    return str(path)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, repeats: int, device: str) -> list[float]:
    out = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def run_dllm(path: str, batches: list[int], args: argparse.Namespace) -> list[dict]:
    from dllm import LLM, SamplingParams

    llm = LLM(path, device=args.device, dtype=args.dtype, load_format="dummy",
              max_running_requests=max(batches), block_size=args.block)
    if args.family == "sdar":
        dllm = {"algorithm": "low_confidence_static", "steps_per_block": args.steps}
    else:  # Fast-dLLM's fixed quota: `steps` over the whole answer (tests/test_refvectors_llada)
        dllm = {"algorithm": "low_confidence_static", "block_size": args.block,
                "steps": args.steps * (args.gen_len // args.block), "gumbel_fp64": True,
                "cache_mode": args.cache_mode}
    params = SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True, temperature=0.0,
                            dllm=dllm)
    vocab = llm.engine.info.vocab_size
    rows = []
    for b in batches:
        ps = prompts(b, args.prompt_len, vocab, args.seed)
        llm.generate(ps, params)  # warm-up (and CUDA-graph capture)
        got: list = []
        times = timed(lambda ps=ps, got=got: got.append(llm.generate(ps, params)), args.repeats,
                      args.device)
        outs = got[-1]
        forwards = sum(o.num_forward_passes for o in outs) / b
        rows.append({"side": "dllm", "batch": b, "seconds": statistics.median(times),
                     "all_seconds": times, "forwards_per_request": forwards,
                     "tokens": sum(len(o.token_ids) for o in outs)})
    llm.engine.shutdown()
    return rows


def _timed_reference(model: torch.nn.Module, gen_for, batches: list[int], vocab: int,
                     args: argparse.Namespace) -> list[dict]:
    """Time ``gen_for(ids)`` (a callable per batch of prompt ids) with a forward counter."""
    calls = {"n": 0}

    def count(_m, _a):
        calls["n"] += 1

    handle = model.register_forward_pre_hook(count)
    rows = []
    for b in batches:
        ids = torch.tensor(prompts(b, args.prompt_len, vocab, args.seed), device=args.device)
        gen = gen_for(ids)
        # Warm-up: one prompt (the generators run a batch one prompt after another at the same
        # [1, L] shapes, so the first prompt warms every kernel the others use).
        gen_for(ids[:1])()
        calls["n"] = 0
        out: list = []
        times = timed(lambda gen=gen, out=out: out.append(gen()), args.repeats, args.device)
        rows.append({"side": "reference", "batch": b, "seconds": statistics.median(times),
                     "all_seconds": times,
                     "forwards_per_request": calls["n"] / args.repeats / b,
                     "tokens": b * (out[-1].shape[1] - args.prompt_len)})
    handle.remove()
    return rows


def run_llada_reference(path: str, batches: list[int], args: argparse.Namespace) -> list[dict]:
    from llada import References

    refs = References(args.ref_root)
    config = refs.llada_config.LLaDAConfig.from_pretrained(path)
    config.init_device = args.device
    with torch.device(args.device):
        model = refs.llada_model.LLaDAModelLM(config).to(getattr(torch, args.dtype)).eval()
    fn = {"exact": refs.fast.generate, "prefix": refs.fast.generate_with_prefix_cache,
          "dual": refs.fast.generate_with_dual_cache}[args.cache_mode]

    def gen_for(ids):
        def gen():
            outs = []  # one prompt a call (the generators' canvas is [1, L])
            with torch.no_grad():
                for row in ids.split(1):
                    out = fn(model, row, steps=args.steps * (args.gen_len // args.block),
                             gen_length=args.gen_len, block_length=args.block,
                             temperature=0.0, remasking="low_confidence",
                             mask_id=config.mask_token_id, threshold=None)
                    # (x, forwards) in this checkout's cached generators, x alone in others
                    outs.append(out[0] if isinstance(out, tuple) else out)
            return torch.cat(outs)
        return gen

    return _timed_reference(model, gen_for, batches, config.vocab_size, args)


def run_reference(path: str, batches: list[int], args: argparse.Namespace) -> list[dict]:
    if args.family == "llada":
        return run_llada_reference(path, batches, args)
    from sdar import Official

    off = Official(args.ref_root / "JetAstra+SDAR")
    config = off.configuration.SDARConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = off.modeling.SDARForCausalLM(config).to(dtype).eval()
    mask_id = config.mask_token_id if getattr(config, "mask_token_id", None) is not None \
        else config.vocab_size - 1

    def gen_for(ids):
        def gen():
            # The generator takes one prompt (its canvas is [1, L]): a batch is its prompts
            # one after another, as a user of the official code runs them.
            outs = []
            with torch.no_grad():
                for row in ids.split(1):
                    outs.append(off.generate.block_diffusion_generate(
                        model, prompt={"input_ids": row, "attention_mask": torch.ones_like(row)},
                        mask_id=mask_id, gen_length=args.gen_len, block_length=args.block,
                        denoising_steps=args.steps, temperature=1.0, top_k=1, top_p=1.0,
                        remasking_strategy="low_confidence_static", confidence_threshold=0.85,
                        eb_threshold=None, stopping_criteria_idx=None))
            return torch.cat(outs)
        return gen

    return _timed_reference(model, gen_for, batches, config.vocab_size, args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref-root", type=Path, required=True,
                   help="folder holding the reference checkouts (JetAstra+SDAR)")
    p.add_argument("--family", choices=("sdar", "llada"), default="sdar")
    p.add_argument("--shape", default="tiny", help="sdar: sdar-8b, sdar-4b (offline.py's) or "
                   "tiny; llada: llada-8b or tiny")
    p.add_argument("--cache-mode", choices=("exact", "prefix", "dual"), default="dual",
                   help="llada: Fast-dLLM's generator and dllm's cache_mode")
    p.add_argument("--batch-size", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="denoising steps a block")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    batches = [int(x) for x in args.batch_size.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.family, args.shape, Path(tmp))
        rows = run_dllm(path, batches, args)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        rows += run_reference(path, batches, args)
    ref = ("JetAstra/SDAR `block_diffusion_generate`" if args.family == "sdar" else
           f"NVlabs/Fast-dLLM llada ({args.cache_mode})")
    lines = [f"# Whole requests: dllm beside {ref} ({args.shape}, {args.dtype}, {args.device})",
             "",
             f"P{args.prompt_len} G{args.gen_len}, block {args.block}, {args.steps} steps a "
             f"block (low_confidence_static, greedy), random weights; median of "
             f"{args.repeats}", "",
             "| batch | dllm s | reference s | dllm tok/s | reference tok/s | speed-up | "
             "forwards/request dllm / reference |", "|---|---|---|---|---|---|---|"]
    for b in batches:
        d = next(r for r in rows if r["side"] == "dllm" and r["batch"] == b)
        r = next(r for r in rows if r["side"] == "reference" and r["batch"] == b)
        lines.append(f"| {b} | {d['seconds']:.3f} | {r['seconds']:.3f} | "
                     f"{d['tokens'] / d['seconds']:.1f} | {r['tokens'] / r['seconds']:.1f} | "
                     f"{r['seconds'] / d['seconds']:.2f}× | {d['forwards_per_request']:.0f} / "
                     f"{r['forwards_per_request']:.0f} |")
    text = "\n".join(lines)
    print(text)
    print("wrote", write_report(args.out, "side-by-side", text, {"args": {
        k: str(v) for k, v in vars(args).items()}, "rows": rows, "when": stamp()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
