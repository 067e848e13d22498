"""What every benchmark script shares: where it leaves its results (``<out>/<name>-<stamp>.md``,
what it printed, and ``<out>/<name>-<stamp>.json``, the numbers and the environment), the
environment it reports, the copy-bandwidth and matmul-rate ceilings, the SM clock, the
timing of a captured CUDA graph and the check for a GPU."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def require_cuda(script: str) -> bool:
    """True on a CUDA machine; else says that ``script`` needs one (the caller exits 2)."""
    if torch.cuda.is_available():
        return True
    path = Path(script).resolve()
    print(f"bench/{path.parent.name}/{path.name} needs a CUDA GPU", file=sys.stderr)
    return False


def environment() -> dict:
    """GPU, SM count, driver, CUDA, torch, Python, the Triton and FlashInfer versions (None
    where not installed), and the runtime's ``DLLM_*`` knobs set in the environment."""
    env = {"gpu": torch.cuda.get_device_name(),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(),
           "knobs": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DLLM_")}}
    for name in ("triton", "flashinfer"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["driver"] = None
    return env


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (median of 10)."""
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**31 / statistics.median(times)


@functools.cache
def _nvidia_smi_id() -> str:
    """nvidia-smi's name for the GPU torch calls device 0 (nvidia-smi numbers GPUs in PCI
    order and ignores ``CUDA_VISIBLE_DEVICES``): the UUID of nvidia-smi's list that matches
    torch's, else index 0."""
    try:
        mine = str(getattr(torch.cuda.get_device_properties(0), "uuid", "") or "").lower()
        listed = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.split()
    except (RuntimeError, AssertionError, OSError, subprocess.CalledProcessError):
        return "0"
    mine = mine.removeprefix("gpu-")
    for uuid in listed:
        if mine and uuid.lower().removeprefix("gpu-") == mine:
            return uuid
    return "0"


class ClockRead:
    """Reads an SM clock (nvidia-smi's ``query``, by default the current clock) in a process
    started now, while the caller keeps the GPU busy: ``finished()`` says whether the answer
    is in (so the sample was taken before that moment), ``mhz()`` waits for it (NaN where it
    cannot be read). nvidia-smi takes some tens of ms or more to answer."""

    def __init__(self, query: str = "clocks.sm"):
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                 "-i", _nvidia_smi_id()],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None

    def finished(self) -> bool:
        return self._proc is None or self._proc.poll() is not None

    def mhz(self) -> float:
        if self._proc is None:
            return float("nan")
        out, _ = self._proc.communicate()
        try:
            return float(out.split()[0])
        except (IndexError, ValueError):
            return float("nan")


def matmul_rates(seconds: float = 3.0, n: int = 8192) -> dict[str, float]:
    """The bf16 rate of ``n``³ matmuls two ways:

    * ``burst``: the first 10 matmuls after 3 warm-ups, from a cool GPU at its boost clock
      (``max_sm_mhz``);
    * ``sustained``: back to back for ``seconds``, the median 10-matmul window of the last
      half, with the SM clock read during that half (``sustained_sm_mhz``). Under a steady
      load the GPU's power cap lowers the SM clock (an H200 went from 1980 MHz to about 1500
      in session 8), and a benchmark's timed steps run in that state.
    """
    lhs = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    rhs = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def window(lhs: torch.Tensor, rhs: torch.Tensor) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            lhs @ rhs
        b.record()
        b.synchronize()
        return 2 * n**3 * 10 / (a.elapsed_time(b) / 1e3)

    max_mhz = ClockRead("clocks.max.sm").mhz()
    for _ in range(3):
        lhs @ rhs
    torch.cuda.synchronize()
    burst = window(lhs, rhs)
    rates, clock = [], None
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if clock is None and time.perf_counter() - t0 > seconds / 2:
            clock = ClockRead()
        rates.append(window(lhs, rhs))
    del lhs, rhs
    torch.cuda.empty_cache()
    return {"burst": burst, "max_sm_mhz": max_mhz,
            "sustained": statistics.median(rates[len(rates) // 2:]),
            "sustained_sm_mhz": clock.mhz() if clock else float("nan")}


def measure_ceilings() -> dict[str, float]:
    """HBM bandwidth (bytes read + written by a copy) and the bf16 matmul rate, sustained
    (``bf16_flops_per_s``) and burst (see ``matmul_rates``)."""
    bw = copy_bandwidth()
    mm = matmul_rates()
    return {"hbm_bytes_per_s": bw, "bf16_flops_per_s": mm["sustained"],
            "bf16_flops_per_s_burst": mm["burst"], "sustained_sm_mhz": mm["sustained_sm_mhz"],
            "max_sm_mhz": mm["max_sm_mhz"]}


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """Median µs of ``replays`` event-timed replays of a captured graph (after one untimed)."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def graph_us(fn, replays: int = 20):
    """``fn()`` run once eagerly (compiles, warms up), captured as a CUDA graph and replayed:
    the median µs of a replay and the captured output (a tensor cloned, as the graph's memory
    goes with it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    us = replay_us(graph, replays)
    if isinstance(out, torch.Tensor):
        out = out.clone()
    del graph
    return us, out


def rotating_us(call, weights: list, n_calls: int, replays: int = 20) -> float:
    """Median µs per call of a graph of ``n_calls`` calls ``call(w)`` taking turns among
    ``weights`` (enough copies that each call reads its weight from HBM, not L2)."""
    us, _ = graph_us(lambda: [call(weights[i % len(weights)]) for i in range(n_calls)],
                     replays)
    return us / n_calls


def refused(label: str, e: Exception) -> None:
    """Print that a case failed to run (out of resources, a compile error) in one line, and go
    on with the next: a benchmark sweep skips what this machine refuses."""
    print(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def write_report(out: str | Path, name: str, markdown: str, payload: dict,
                 when: str | None = None) -> Path:
    """Write both files (``when``: a stamp fixed by the caller, to rewrite one report as rows
    come in); returns the markdown file's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = f"{name}-{when or stamp()}"
    (out / f"{base}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    md = out / f"{base}.md"
    md.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return md


def skinny_rows_option(ap) -> None:
    """``--skinny-max-rows``, the A/B knob of the engine benchmarks (``apply_skinny_rows``)."""
    ap.add_argument("--skinny-max-rows", type=int, default=None,
                    help="A/B: the skinny GEMM's row limit (skinny_gemm.MAX_M; 16 keeps cuBLAS "
                         "past 16 rows, 32 past 32)")


def apply_skinny_rows(rows: int | None) -> None:
    """Caps the rows the skinny GEMM takes (``skinny_gemm.MAX_M``) for this process."""
    if rows is not None:
        from dllm.runner.kernels import skinny_gemm

        skinny_gemm.MAX_M = rows
