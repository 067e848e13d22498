"""Whole requests, dllm beside the official generator at the same shape and settings (issue 24,
item 3): prefill included, tokens per second as a user sees them. Four families:

* ``--family sdar``: JetAstra/SDAR's ``generate.py::block_diffusion_generate`` (the README's
  generator) with its own ``modeling_sdar.py``; shapes ``sdar-8b``, ``sdar-4b``, ``tiny``.
* ``--family llada``: NVlabs/Fast-dLLM's ``llada/generate.py`` (``generate``,
  ``generate_with_prefix_cache``, ``generate_with_dual_cache`` by ``--cache-mode exact``,
  ``prefix``, ``dual``) with its ``llada/model``; dllm with the same ``cache_mode``; shapes
  ``llada-8b`` (the released LLaDA-8B-Instruct config's sizes) and ``tiny``.
* ``--family dream``: Dream's ``diffusion_generate`` as Fast-dLLM ships it
  (``dream/model/generation_utils.py``, ``--cache-mode exact``: the whole canvas recomputed
  every step) and Fast-dLLM's block cache (``generation_utils_block.py``, ``prefix``:
  ``dual_cache=False``, ``dual``: ``dual_cache=True``), on ``dream/model``'s ``DreamModel``,
  loaded as ``scripts/refvectors/dream.py`` loads them; shapes ``dream-7b`` (the released
  Dream-v0-Instruct-7B config's sizes) and ``tiny``. Algorithm: ``alg="entropy"`` (Dream's
  README setting; the block cache ranks by negative entropy whatever ``alg`` says), dllm's
  ``entropy`` with the same ``cache_mode``: its step count is fixed (``int(n·(1 − s/t))``
  tokens a step, all that are left on the last, from mask counts alone), so the forwards do
  not depend on the random weights: ``steps`` forwards for ``exact``, ``steps / blocks`` a
  block for the caches. At ``--steps`` = ``--block`` that is one token a step on average.
  ``exact`` has no blocks (the canvas is one, as in Dream); its ``steps`` is the same total.
  Fast-dLLM's ``confidence_threshold`` is not used: its forward count follows the
  confidences (extra steps below the threshold).
* ``--family llada2``: inclusionAI/dFactory's ``LLaDA2MoeModelLM.generate``
  (``models/llada2_moe``, loaded as ``scripts/refvectors/llada2.py`` does, with its ``veomni``
  stand-ins; ``model_type`` ``llada2_moe``: the file's own per-expert ``moe_infer``); shapes
  ``llada2-mini`` (LLaDA2.0-mini's released config sizes, as ``offline.py``'s SHAPES) and
  ``tiny``. ``threshold=1.0`` (no probability is above it: the static schedule,
  ``block // steps`` a step), ``temperature=0.0`` (its published sampler then draws with
  ``torch.multinomial`` from the softmax: LLaDA2.X issue #6), ``eos_id=-1`` (it would stop
  after a block holding EOS even without ``eos_early_stop``); dllm ``low_confidence_static``.

``--steps`` is the steps of one block in every family (default: ``--block``, one token a
step); the LLaDA and Dream generators take the total, ``steps · gen_len / block``.
``--cache-mode`` takes a comma list (``dual,prefix,exact``): one engine and one reference
model serve every mode in one process; ``--mode-batches exact:1`` gives a mode its own batch
sizes (a batch of 8 recomputing whole canvases costs about 8 batch-1 calls on either side).

Run it under the reference's environment (the one its reference-vector script uses:
transformers 4.52.x for SDAR, 4.49.0 for Fast-dLLM's LLaDA and Dream, 4.57.x for dFactory),
from this repository's root (``bench/engine/ref_env.sh`` makes ``.refsrc`` and the wheels the
GPU machine needs)::

    /work/refenv452/bin/python bench/engine/side_by_side.py --ref-root .refsrc \\
        --shape sdar-8b --batch-size 1,8 --device cuda        # an H200
    /work/refenv449/bin/python bench/engine/side_by_side.py --ref-root .refsrc \\
        --family dream --shape dream-7b --cache-mode dual,prefix,exact --block 32 --device cuda
    /work/refenv452/bin/python bench/engine/side_by_side.py --ref-root .refsrc \\
        --shape tiny --batch-size 1,8 --device cpu            # the plumbing, on a CPU

Both sides: random weights (dllm's ``load_format="dummy"``, the reference's own initialisation;
the timing does not depend on them; ``tiny``: the factory's weights at those sizes, loaded by
both, so the first request's generated ids are compared too, for LLaDA and Dream), the same
dtype, ``--batch-size`` prompts of ``--prompt-len`` random ids (never the mask id) submitted at
once, ``--gen-len`` new tokens each with no stop, greedy (SDAR's official greedy setting is
top-k 1; Fast-dLLM's ``temperature=0``). One warm-up call first, then ``--repeats`` timed calls
(the median is reported). The official generators take one prompt at a time (their canvas is
``[1, L]``; so does Dream's dual cache, whose K/V write indexes every row's block at once): a
batch of B is its B prompts one after another, and the reference's warm-up is one prompt.
Dream's ``generation_utils.py`` and its prefix cache take ``[B, L]``: they run the batch in one
call. ``--ref-batch-size`` limits the batches the reference runs (a one-prompt-at-a-time batch
of B costs B batch-1 calls by construction), ``--ref-warmup-gen`` shortens its warm-up (not for
``llada``: its attention is ``torch.compile``-d, and a new length would compile inside the timed
calls). SDAR's reference needs ``flash_attn``, which is not installed here: its two calls are
stood in for exactly as in ``scripts/refvectors/sdar.py`` (RMSNorm in float32,
``flash_attn_func(causal=False)`` as ``scaled_dot_product_attention``; on CUDA that runs
FlashAttention's own kernel inside torch), so the reference is measured with torch's SDPA in
flash-attn's place. The two sides run one after the other in this process, dllm's engine shut
down before the reference model is built (both would not fit beside dllm's KV pool).

Prints a table and writes ``bench/results/side-by-side-<stamp>.{md,json}``, rewritten after
every row (a run cut short by a timeout keeps the rows it has).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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

_START = time.perf_counter()


def progress(message: str) -> None:
    """A line on stdout with the seconds since the script started (where a slow side spends
    its time: model build, compilation, warm-up, timed calls)."""
    print(f"[{time.perf_counter() - _START:7.1f} s] {message}", flush=True)

# CPU-sized shapes for trying the script out.
TINY = {"sdar": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     vocab_size=2048, tie_word_embeddings=False, block_size=4,
                     max_position_embeddings=32768),
        "llada": dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, mlp_hidden_size=768,
                      vocab_size=2048, embedding_size=2048),
        "dream": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=2048),
        "llada2": dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, vocab_size=2048, num_experts=16, num_experts_per_tok=4,
                       n_group=4, topk_group=2)}
CONFIGS = ROOT / "tests" / "data" / "configs"
# shape -> (family, the released config.json, the size keys taken from it)
RELEASED = {
    "llada-8b": ("llada", CONFIGS / "GSAI-ML__LLaDA-8B-Instruct" / "config.json",
                 ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size",
                  "vocab_size", "embedding_size")),
    "dream-7b": ("dream", CONFIGS / "Dream-org__Dream-v0-Instruct-7B" / "config.json",
                 ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "rope_theta", "tie_word_embeddings")),
    "llada2-mini": ("llada2", CONFIGS / "inclusionAI__LLaDA2.0-mini-preview" / "config.json",
                    ("hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "vocab_size", "num_experts", "num_experts_per_tok",
                     "num_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
                     "rotary_dim", "partial_rotary_factor", "routed_scaling_factor")),
}
ARCH = {"sdar": "SDARForCausalLM", "llada": "LLaDAModelLM", "dream": "DreamModel",
        "llada2": "LLaDA2MoeModelLM"}
FAST = "NVlabs+Fast-dLLM"
REFERENCE = {"sdar": "JetAstra/SDAR `block_diffusion_generate`",
             "llada": "NVlabs/Fast-dLLM llada `generate*`",
             "dream": "Dream `diffusion_generate` / Fast-dLLM's Dream block cache",
             "llada2": "inclusionAI/dFactory `LLaDA2MoeModelLM.generate`"}
ALGORITHM = {"sdar": "low_confidence_static, greedy", "llada": "low_confidence_static, greedy",
             "dream": "Dream `entropy`, greedy",
             "llada2": "low_confidence_static (reference: threshold 1.0, its own sampler)"}

# Why the generated ids of two families are not compared (the forwards and the time are).
UNCOMPARED = {"sdar": "at top-k 1 every confidence of the reference is 1.0, so it ranks ties "
                      "(dllm runs the argmax with the real probabilities)",
              "llada2": "the reference's sampler draws them"}


def checkpoint(family: str, shape: str, root: Path) -> str:
    """A checkpoint directory of ``shape``: config and the factory's tokenizer; weights only
    for ``tiny`` (the factory's, at those sizes: both sides load them)."""
    from bench.engine.offline import SHAPES, checkpoint_dir

    if family == "sdar" and shape != "tiny":
        if not SHAPES[shape][0].startswith("SDAR"):
            raise SystemExit(f"--shape {shape}: not an SDAR shape")
        return checkpoint_dir(shape, root)
    from dllm.testing import make_tiny_checkpoint

    if shape == "tiny":
        return str(make_tiny_checkpoint(ARCH[family], root / shape, **TINY[family]))
    if RELEASED.get(shape, ("",))[0] == family:
        released = json.loads(RELEASED[shape][1].read_text())
        sizes = {k: released[k] for k in RELEASED[shape][2]}
    else:
        shapes = ", ".join(["tiny"] + [s for s, r in RELEASED.items() if r[0] == family])
        raise SystemExit(f"--shape {shape}: no such {family} shape ({shapes})")
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


def prompts(batch: int, length: int, vocab: int, seed: int, mask_id: int) -> list[list[int]]:
    """Random ids; the mask id is replaced by the next id (the references would decode it)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    return ids.masked_fill(ids == mask_id, (mask_id + 1) % vocab).tolist()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters created in ``dtype`` (what ``from_pretrained(torch_dtype=...)`` does)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def has_weights(path: str) -> bool:
    return any(Path(path).glob("*.safetensors"))


def load_weights(model: torch.nn.Module, path: str) -> None:
    """The checkpoint's weights, strictly, where it has them (``tiny``); else the reference
    keeps its own random initialisation."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    if state:
        model.load_state_dict(state, strict=True)


def placed(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """The reference model in the run's dtype on the run's device, in eval mode, checked: a
    model class may build its modules elsewhere whatever the device context says (Fast-dLLM's
    ``LLaDAModelLM`` always builds on the CPU; its README moves it with ``.to(device)``), and
    a generator allocates its canvas on ``model.device``, so a model left on the CPU would be
    timed on the CPU without an error."""
    model = model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    want = torch.device(args.device).type
    where = {t.device.type for t in [*model.parameters(), *model.buffers()]
             if t.is_floating_point()}
    if where != {want}:
        raise SystemExit(f"the reference model's tensors are on {sorted(where)}, not {want}")
    return model


def total_steps(args: argparse.Namespace) -> int:
    return args.steps * (args.gen_len // args.block)


def dllm_settings(args: argparse.Namespace, mode: str | None) -> dict:
    if args.family in ("sdar", "llada2"):
        return {"algorithm": "low_confidence_static", "steps_per_block": args.steps}
    if args.family == "llada":  # Fast-dLLM's fixed quota (tests/test_refvectors_llada)
        return {"algorithm": "low_confidence_static", "block_size": args.block,
                "steps": total_steps(args), "gumbel_fp64": True, "cache_mode": mode}
    # Dream (tests/test_refvectors_dream: full_rule, block_rule)
    return {"algorithm": "entropy", "alg_temp": 0.0, "steps": total_steps(args),
            "cache_mode": mode, "block_size": args.gen_len if mode == "exact" else args.block}


class Report:
    """The table, rewritten to disk after every row."""

    def __init__(self, args: argparse.Namespace, modes: list, facts: dict):
        self.args, self.modes, self.facts = args, modes, facts  # modes: [None] if none
        self.rows: list[dict] = []
        self.when = stamp()

    def add(self, rows: list[dict]) -> None:
        self.rows += rows
        self.write(final=False)

    def text(self) -> str:
        a = self.args
        modes = self.modes != [None]
        lines = [f"# Whole requests: dllm beside {REFERENCE[a.family]} ({a.shape}, {a.dtype}, "
                 f"{a.device})", "",
                 f"P{a.prompt_len} G{a.gen_len}, block {a.block}, {a.steps} steps a block "
                 f"({ALGORITHM[a.family]}), {self.weights}; median of {a.repeats}", "",
                 ("| mode " if modes else "") + "| batch | dllm s | reference s | dllm tok/s | "
                 "reference tok/s | speed-up | forwards/request dllm / reference |",
                 ("|---" if modes else "") + "|---|---|---|---|---|---|---|"]

        def get(side, mode, b):
            return next((r for r in self.rows if r["side"] == side and r["mode"] == mode
                         and r["batch"] == b), None)

        for mode in self.modes:
            for b in self.batches:
                d, r = get("dllm", mode, b), get("reference", mode, b)
                if d is None and r is None:
                    continue
                cells = [mode] if modes else []
                cells.append(str(b))
                for x in (d, r):
                    cells.append(f"{x['seconds']:.3f}" if x else "—")
                for x in (d, r):
                    cells.append(f"{x['tokens'] / x['seconds']:.1f}" if x else "—")
                cells.append(f"{r['seconds'] / d['seconds']:.2f}×" if d and r else "—")
                cells.append(" / ".join(f"{x['forwards_per_request']:.0f}" if x else "—"
                                        for x in (d, r)))
                lines.append("| " + " | ".join(cells) + " |")
        pairs = [(d, r) for d in self.rows if d["side"] == "dllm" for r in self.rows
                 if r["side"] == "reference" and (r["mode"], r["batch"]) == (d["mode"], d["batch"])]
        if pairs and self.facts["shared_weights"] and a.family in UNCOMPARED:
            lines += ["", f"Generated ids not compared: {UNCOMPARED[a.family]}."]
        elif pairs and self.facts["shared_weights"]:
            same = sum(d["first_output"] == r["first_output"] for d, r in pairs)
            lines += ["", f"The first request's generated ids equal the reference's in {same} "
                      f"of {len(pairs)} rows (the same weights on both sides: in float32 all "
                      "should; bfloat16 roundings differ between the two)."]
        return "\n".join(lines)

    @property
    def weights(self) -> str:
        return ("the factory's random weights on both sides" if self.facts["shared_weights"]
                else "random weights, each side its own")

    @property
    def batches(self) -> list[int]:
        return sorted({r["batch"] for r in self.rows})

    def write(self, final: bool = True) -> Path:
        import transformers

        payload = {"args": {k: str(v) for k, v in vars(self.args).items()}, "rows": self.rows,
                   "facts": self.facts, "when": self.when, "complete": final,
                   "versions": {"torch": torch.__version__,
                                "transformers": transformers.__version__}}
        return write_report(self.args.out, "side-by-side", self.text(), payload, self.when)


def run_dllm(path: str, plan: dict, prompt_for: Callable, report: Report,
             args: argparse.Namespace) -> None:
    """``plan``: mode (None where the family has none) -> batch sizes."""
    from dllm import LLM, SamplingParams

    llm = LLM(path, device=args.device, dtype=args.dtype,
              load_format="safetensors" if has_weights(path) else "dummy",
              max_running_requests=max(max(bs) for bs in plan.values()), block_size=args.block)
    report.facts["dllm_mask_id"] = llm.engine.mask_token_id
    for mode, batches in plan.items():
        params = SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True, temperature=0.0,
                                dllm=dllm_settings(args, mode))
        for b in batches:
            ps = prompt_for(b)
            llm.generate(ps, params)  # warm-up (and CUDA-graph capture)
            progress(f"dllm {mode} batch {b}: warmed up")
            got: list = []
            times = timed(lambda ps=ps, got=got, params=params: got.append(
                llm.generate(ps, params)), args.repeats, args.device)
            outs = got[-1]
            progress(f"dllm {mode} batch {b}: {statistics.median(times):.3f} s")
            report.add([{"side": "dllm", "mode": mode, "batch": b,
                         "seconds": statistics.median(times), "all_seconds": times,
                         "forwards_per_request": sum(o.num_forward_passes for o in outs) / b,
                         "tokens": sum(len(o.token_ids) for o in outs),
                         "first_output": list(outs[0].token_ids)}])
    llm.engine.shutdown()


def _timed_reference(counted: torch.nn.Module, gen_for: Callable, batches: list[int],
                     prompt_for: Callable, report: Report, args: argparse.Namespace,
                     mode: str | None = None, batched: bool = False) -> None:
    """Time ``gen_for(ids, gen_len)()`` (a callable per batch of prompt ids returning the
    generated ids) with a forward counter on ``counted``; ``batched``: one call takes the
    whole batch (else the batch is its prompts one after another)."""
    if args.ref_profile is not None:
        profile_reference(counted, gen_for, prompt_for, args, mode)
        return
    calls = {"n": 0}

    def count(_m, _a):
        calls["n"] += 1

    handle = counted.register_forward_pre_hook(count)
    try:
        for b in batches:
            ids = torch.tensor(prompt_for(b), device=args.device)
            gen = gen_for(ids, args.gen_len)
            # Warm-up: one prompt (a generator of one prompt at a time runs a batch at the same
            # [1, L] shapes, so the first prompt warms every kernel the others use).
            progress(f"reference {mode} batch {b}: warming up")
            gen_for(ids[:1], args.ref_warmup_gen or args.gen_len)()
            progress(f"reference {mode} batch {b}: warmed up ({calls['n']} forwards)")
            calls["n"] = 0
            out: list = []
            times = timed(lambda gen=gen, out=out: out.append(gen()), args.repeats, args.device)
            progress(f"reference {mode} batch {b}: {statistics.median(times):.3f} s")
            report.add([{"side": "reference", "mode": mode, "batch": b,
                         "seconds": statistics.median(times), "all_seconds": times,
                         "forwards_per_request": calls["n"] / args.repeats / (1 if batched else b),
                         "calls_per_batch": 1 if batched else b, "tokens": out[-1].numel(),
                         "first_output": out[-1][0].tolist()}])
    finally:
        handle.remove()


class _Profiled(Exception):
    """Raised from the forward hook once the profiled forwards have run."""


def profile_reference(counted: torch.nn.Module, gen_for: Callable, prompt_for: Callable,
                      args: argparse.Namespace, mode: str | None) -> None:
    """``--ref-profile N``: one prompt of the reference; forwards 1..N run unprofiled (the
    first compiles), each forward's wall time printed; forwards N+1..N+5 under
    ``torch.profiler`` (CPU and CUDA), whose op tables are printed; then the request is cut
    short (no timing)."""
    from torch.profiler import ProfilerActivity, profile

    first, count = args.ref_profile, 5
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda")
                                     else [])
    prof = profile(activities=acts)
    state = {"n": 0, "t": None, "started": False, "done": False}

    def hook(_m, _a):
        sync(args.device)
        now = time.perf_counter()
        if state["t"] is not None:
            progress(f"reference {mode} forward {state['n']}: {now - state['t']:.4f} s")
        if state["n"] == first:
            prof.start()
            state["started"] = True
        elif state["n"] == first + count:
            state["done"] = True
            raise _Profiled
        state["n"] += 1
        state["t"] = time.perf_counter()

    handle = counted.register_forward_pre_hook(hook)
    ids = torch.tensor(prompt_for(1), device=args.device)
    try:
        gen_for(ids, args.gen_len)()
    except _Profiled:
        pass
    finally:
        handle.remove()
        if state["started"]:
            prof.stop()
    if not state["done"]:
        progress(f"reference {mode}: the request ended before forward {first + count}")
        return
    for key in ("self_cuda_time_total", "self_cpu_time_total") if len(acts) > 1 else (
            "self_cpu_time_total",):
        print(f"--- reference {mode}: forwards {first + 1}-{first + count}, by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=30))


def one_by_one(ids: torch.Tensor, call: Callable) -> torch.Tensor:
    """``call(row)`` for each prompt (the generators' canvas is [1, L]), generated ids only."""
    with torch.no_grad():
        return torch.cat([call(row)[:, row.shape[1]:] for row in ids.split(1)])


def run_llada_reference(path: str, plan: dict, prompt_for: Callable, report: Report,
                        args: argparse.Namespace) -> None:
    # As scripts/refvectors/llada.py's References loads Fast-dLLM's LLaDA (its generate.py
    # imports ``model.modeling_llada`` with its folder on sys.path).
    from llada import _load_module

    folder = args.ref_root / FAST / "llada"
    sys.path.insert(0, str(folder))
    import model.configuration_llada as llada_config  # type: ignore[import-not-found]
    import model.modeling_llada as llada_model  # type: ignore[import-not-found]

    fast = _load_module("ref_fast_generate", folder / "generate.py")
    config = llada_config.LLaDAConfig.from_pretrained(path)
    config.init_device = args.device
    # built in the run's dtype, as from_pretrained(torch_dtype=...) builds it (not float32
    # then cast: half the memory and the initialisation time of an 8B model)
    with torch.device(args.device), default_dtype(getattr(torch, args.dtype)):
        model = llada_model.LLaDAModelLM(config)
    load_weights(model, path)
    model = placed(model, args)
    progress("reference model built")
    for mode, batches in plan.items():
        fn = {"exact": fast.generate, "prefix": fast.generate_with_prefix_cache,
              "dual": fast.generate_with_dual_cache}[mode]

        def gen_for(ids, gen_len, fn=fn):
            def call(row):
                out = fn(model, row, steps=args.steps * (gen_len // args.block),
                         gen_length=gen_len, block_length=args.block, temperature=0.0,
                         remasking="low_confidence", mask_id=config.mask_token_id,
                         threshold=None)
                # (x, forwards) in this checkout's cached generators, x alone in others
                return out[0] if isinstance(out, tuple) else out
            return lambda: one_by_one(ids, call)

        _timed_reference(model, gen_for, batches, prompt_for, report, args, mode)


def run_dream_reference(path: str, plan: dict, prompt_for: Callable, report: Report,
                        args: argparse.Namespace) -> None:
    import dream as ref  # scripts/refvectors/dream.py: the package import, the mixin switch

    ref.import_official(args.ref_root / FAST / "dream" / "model")
    modeling = importlib.import_module(f"{ref.PACKAGE}.modeling_dream")
    generation = importlib.import_module(f"{ref.PACKAGE}.generation_utils")
    config = modeling.DreamConfig.from_pretrained(path)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device), default_dtype(dtype):
        model = modeling.DreamModel(config)
    load_weights(model, path)
    model.generation_config = generation.DreamGenerationConfig.from_pretrained(path)
    model = placed(model, args)
    report.facts["reference_attn_implementation"] = model.config._attn_implementation
    # Explicit, as Fast-dLLM's eval.py passes them (tests/test_refvectors_dream.py).
    greedy = {"temperature": 0.0, "top_p": None, "top_k": None, "alg_temp": 0.0}
    for mode, batches in plan.items():
        ref.use_generator(model, "generation_utils" if mode == "exact"
                          else "generation_utils_block")
        block = {} if mode == "exact" else {"block_length": args.block,
                                            "dual_cache": mode == "dual"}

        def gen_for(ids, gen_len, block=block, mode=mode):
            def call(rows):
                with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):  # its prints
                    out = model.diffusion_generate(
                        rows, max_new_tokens=gen_len, steps=args.steps * (gen_len // args.block),
                        alg="entropy", **greedy, **block)
                out = getattr(out, "sequences", out)
                return out[:, rows.shape[1]:]
            if mode == "dual":  # the dual cache's K/V write takes one row
                return lambda: torch.cat([call(row) for row in ids.split(1)])
            return lambda: call(ids)

        _timed_reference(model, gen_for, batches, prompt_for, report, args, mode,
                         batched=mode != "dual")


def run_llada2_reference(path: str, plan: dict, mask_id: int, prompt_for: Callable,
                         report: Report, args: argparse.Namespace) -> None:
    import llada2 as ref  # scripts/refvectors/llada2.py: the veomni stand-ins, the loader

    ref.install_stubs()
    module = ref.load_package("ref_dfactory_llada2",
                              args.ref_root / ref.DFACTORY / "models" / "llada2_moe",
                              "modeling_llada2_moe")
    config = module.LLaDA2MoeConfig.from_pretrained(path)
    assert config.model_type == "llada2_moe", config.model_type  # not veomni's fused MoE
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device), default_dtype(dtype):
        model = module.LLaDA2MoeModelLM(config)
    load_weights(model, path)
    model = placed(model, args)
    report.facts["reference_attn_implementation"] = model.config._attn_implementation
    if dtype == torch.float32:  # its block mask is bfloat16, which SDPA rejects beside float32
        ref.adapt_mask(model, "mask_float32")

    def gen_for(ids, gen_len):
        def call(row):
            out = model.generate(inputs=row, temperature=0.0, block_length=args.block,
                                 steps=args.steps, gen_length=gen_len, threshold=1.0,
                                 eos_early_stop=False, eos_id=-1, mask_id=mask_id)
            return torch.cat([row, out], dim=1)  # it returns the generated ids alone
        return lambda: one_by_one(ids, call)

    # ``generate`` calls ``self.forward`` (no hooks): count the inner model's calls.
    _timed_reference(model.model, gen_for, plan[None], prompt_for, report, args)


def run_sdar_reference(path: str, plan: dict, prompt_for: Callable, report: Report,
                       args: argparse.Namespace) -> None:
    from sdar import Official

    off = Official(args.ref_root / "JetAstra+SDAR")
    config = off.configuration.SDARConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = off.modeling.SDARForCausalLM(config)
    load_weights(model, path)
    model = placed(model, args)
    mask_id = config.mask_token_id if getattr(config, "mask_token_id", None) is not None \
        else config.vocab_size - 1

    def gen_for(ids, gen_len):
        def call(row):
            return off.generate.block_diffusion_generate(
                model, prompt={"input_ids": row, "attention_mask": torch.ones_like(row)},
                mask_id=mask_id, gen_length=gen_len, block_length=args.block,
                denoising_steps=args.steps, temperature=1.0, top_k=1, top_p=1.0,
                remasking_strategy="low_confidence_static", confidence_threshold=0.85,
                eb_threshold=None, stopping_criteria_idx=None)
        return lambda: one_by_one(ids, call)

    _timed_reference(model, gen_for, plan[None], prompt_for, report, args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref-root", type=Path, required=True,
                   help="folder holding the reference sources (<owner>+<repo>/, e.g. .refsrc)")
    p.add_argument("--family", choices=tuple(ARCH), default="sdar")
    p.add_argument("--shape", default="tiny", help="sdar: sdar-8b, sdar-4b (offline.py's); "
                   "llada: llada-8b; dream: dream-7b; llada2: llada2-mini; any: tiny")
    p.add_argument("--cache-mode", default="dual",
                   help="llada, dream: comma list of exact, prefix, dual")
    p.add_argument("--batch-size", default="1,8")
    p.add_argument("--mode-batches", nargs="*", default=[], metavar="MODE:LIST",
                   help="llada, dream: a mode's own batch sizes, e.g. exact:1 (both sides)")
    p.add_argument("--ref-batch-size", default=None,
                   help="the batches the reference runs (default: --batch-size)")
    p.add_argument("--sides", default="dllm,reference")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--block", type=int, default=None, help="default: 4 (sdar), 32 (others)")
    p.add_argument("--steps", type=int, default=None,
                   help="denoising steps a block (default: --block, one token a step)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ref-warmup-gen", type=int, default=None,
                   help="the reference warm-up's gen length (default: --gen-len)")
    p.add_argument("--ref-profile", type=int, default=None, metavar="N",
                   help="instead of timing the reference: one prompt, its first N forwards "
                        "timed one by one, the next 5 under torch.profiler (tables printed)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.block = args.block or (4 if args.family == "sdar" else 32)
    args.steps = args.steps or args.block
    if args.gen_len % args.block:
        raise SystemExit("--gen-len must be a multiple of --block")
    modes = [None]
    if args.family in ("llada", "dream"):
        modes = args.cache_mode.split(",")
        if not set(modes) <= {"exact", "prefix", "dual"}:
            raise SystemExit(f"--cache-mode {args.cache_mode}: exact, prefix, dual")
    if args.family == "llada" and args.ref_warmup_gen not in (None, args.gen_len):
        raise SystemExit("--ref-warmup-gen: not for llada (its compiled attention)")
    plan = {m: [int(x) for x in args.batch_size.split(",")] for m in modes}
    for item in args.mode_batches:
        mode, _, sizes = item.partition(":")
        if mode not in plan:
            raise SystemExit(f"--mode-batches {item}: {mode} is not in --cache-mode")
        plan[mode] = [int(x) for x in sizes.split(",")]
    ref_batches = [int(x) for x in (args.ref_batch_size or args.batch_size).split(",")]
    ref_plan = {m: [b for b in bs if b in ref_batches] for m, bs in plan.items()}
    sides = args.sides.split(",")
    from llada import checkpoint_facts  # config's mask_token_id, else the tokenizer's mask

    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.family, args.shape, Path(tmp))
        mask_id, _ = checkpoint_facts(Path(path))
        vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        report = Report(args, modes, {"mask_id": mask_id, "vocab_size": vocab,
                                      "shared_weights": has_weights(path)})

        def prompt_for(b: int) -> list[list[int]]:
            return prompts(b, args.prompt_len, vocab, args.seed, mask_id)

        if "dllm" in sides:
            run_dllm(path, plan, prompt_for, report, args)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        if "reference" in sides:
            if args.family == "llada":
                run_llada_reference(path, ref_plan, prompt_for, report, args)
            elif args.family == "dream":
                run_dream_reference(path, ref_plan, prompt_for, report, args)
            elif args.family == "llada2":
                run_llada2_reference(path, ref_plan, mask_id, prompt_for, report, args)
            else:
                run_sdar_reference(path, ref_plan, prompt_for, report, args)
    print(report.text())
    print("wrote", report.write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
