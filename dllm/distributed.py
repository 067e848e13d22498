"""Tensor- and data-parallel ranks as processes (DESIGN §9): one worker process per rank,
each with a whole ``Engine`` (tokenizer, scheduler, ``ModelRunner`` over its slice of every
layer).

Rank 0 is the caller's process. Every engine call that changes state (``add_request``,
``abort``, ``step``, ``drain``) is broadcast to the other ranks before rank 0 runs it, and
each rank runs the same call on the same state, so every scheduler plans the same batches and
the collectives of every forward line up (SGLang's way: the requests travel, not the batches;
a batch's post-step reads its requests, which every rank then has). The broadcast is one small
object per call over a Gloo group, on CPU and GPU alike; the forward's own collectives use the
default group (Gloo on CPU, NCCL on GPUs).

Under data-parallel attention (``data_parallel_size``) the calls travel the same way, but
each rank applies them to its own share: ``dp_add`` names the rank a request goes to, and a
step runs each rank's own batches, the ranks agreeing before each forward whether any has one
(``any_rank``) and sending rank 0 their requests' progress after it (``gather``), both over
the same Gloo group (``dllm.engine``).

A worker exits when rank 0 sends ``None`` (``RankGroup.shutdown``: ``Engine.shutdown``, and at
interpreter exit) or when rank 0's process disappears (a watchdog thread: no orphans). Rank 0
watches its workers the same way: a worker that dies ends rank 0's process with a one-line
error naming the rank within a second, instead of leaving it blocked in a collective.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# How long a collective may wait before it fails (a peer that hangs without dying).
TIMEOUT = timedelta(minutes=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, world: int, addr: str, device: torch.device) -> Any:
    """Join the default group (NCCL for CUDA ranks, else Gloo) at ``addr`` (HOST:PORT) and
    return a Gloo group for the control messages."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    return dist.new_group(backend="gloo", timeout=TIMEOUT) if backend != "gloo" else None


class RankGroup:
    """The ranks of one engine, as rank 0 or a worker sees them. ``mirror(call, *args)``:
    on rank 0, send the call to the other ranks (a no-op on workers and with one rank)."""

    def __init__(self, rank: int, world: int, control: Any = None,
                 workers: list[subprocess.Popen] | None = None, kind: str = "tensor-parallel"):
        self.rank, self.world = rank, world
        self.control = control
        self.workers = workers or []
        self.stopping = False
        self.kind = kind  # how the error naming a dead rank calls it

    # ---- data-parallel attention: each rank runs its own batches ------------------------
    def any_rank(self, flag: bool) -> bool:
        """Whether any rank passes True (every rank calls it: one small all-reduce)."""
        box = torch.tensor([int(flag)])
        self._collective(dist.all_reduce, box, op=dist.ReduceOp.MAX, group=self.control)
        return bool(box.item())

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order; None on the others)."""
        out = [None] * self.world if self.rank == 0 else None
        self._collective(dist.gather_object, obj, out, dst=0, group=self.control)
        return out

    @property
    def sends(self) -> bool:
        return self.rank == 0 and self.world > 1 and not self.stopping

    def mirror(self, call: str, *args: Any) -> None:
        if self.sends:
            self._collective(dist.broadcast_object_list, [(call, args)], src=0,
                             group=self.control)

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run one control collective; when it fails on rank 0 (a peer's socket reset as the
        peer died), first see whether a worker is gone: if so, the one-line error and exit
        (``check_peers``), not the collective's traceback."""
        try:
            fn(*args, **kwargs)
        except Exception:
            if self.rank == 0:
                self.check_peers()
            raise

    def receive(self) -> tuple[str, tuple] | None:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def check_peers(self, wait: float = 1.0) -> None:
        """Rank 0: if a worker has exited (waiting up to ``wait`` seconds for one to be seen
        gone, as after a collective failed), stop the others and end this process with one
        line naming the rank."""
        deadline = time.monotonic() + wait
        while not self.stopping and self.workers:
            dead = next(((r, p) for r, p in enumerate(self.workers, start=1)
                         if p.poll() is not None), None)
            if dead is not None:
                rank, proc = dead
                print(f"dllm: {self.kind} rank {rank} exited (code {proc.returncode}); "
                      "stopping", file=sys.stderr, flush=True)
                for other in self.workers:
                    if other.poll() is None:
                        other.kill()
                os._exit(1)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Rank 0: tell the workers to exit and wait for them (idempotent)."""
        if not self.sends:
            return
        self.stopping = True
        try:
            dist.broadcast_object_list([None], src=0, group=self.control)
        except Exception:  # noqa: BLE001 - a worker already gone: nothing to tell
            pass
        for proc in self.workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(config: Any, device: torch.device) -> RankGroup:
    """This process's place among the ranks of ``config``, starting the worker processes it
    hosts. Three ways in: one host (``world_size`` ranks: tensor- or context-parallel, this
    process rank 0);
    several hosts (``nnodes``: each starts the ranks of its share; node 0's process is rank 0,
    another node's process hosts its ranks until they end and then exits); torchrun (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK`` in the environment: every
    process is one rank; rank 0 returns, the others run as workers and exit)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _launch_torchrun(config, device)
    world = config.world_size
    if world == 1:
        return RankGroup(0, 1)
    if dist.is_initialized():
        raise ValueError("one multi-rank (tensor- or context-parallel) engine per process: "
                         "shut the other down first (Engine.shutdown)")
    per_node = world // config.nnodes
    if device.type == "cuda" and torch.cuda.device_count() < per_node:
        raise ValueError(f"{per_node} ranks on this host need {per_node} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    addr = config.dist_init_addr or f"127.0.0.1:{_free_port()}"
    first = config.node_rank * per_node
    workers = [_start_worker(config, rank, world, addr, per_node)
               for rank in range(max(first, 1), first + per_node)]
    if config.node_rank > 0:  # this host serves nothing itself: it hosts its ranks
        codes = [proc.wait() for proc in workers]
        sys.exit(max((abs(c) for c in codes), default=0))
    control = _init_group(0, world, addr, device)
    group = RankGroup(0, world, control, workers, _kind(config))
    atexit.register(group.shutdown)
    threading.Thread(target=_watch_workers, args=(group,), daemon=True,
                     name="dllm-tp-watch").start()
    return group


def _start_worker(config: Any, rank: int, world: int, addr: str,
                  per_node: int) -> subprocess.Popen:
    # A fresh interpreter (``python -m dllm.distributed``), not multiprocessing: the caller's
    # script is not imported again, so it needs no ``__main__`` guard.
    proc = subprocess.Popen([sys.executable, "-m", "dllm.distributed"], stdin=subprocess.PIPE)
    pickle.dump((config, rank, world, addr, rank % per_node, os.getpid()), proc.stdin)
    proc.stdin.close()
    return proc


def _launch_torchrun(config: Any, device: torch.device) -> RankGroup:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if config.world_size not in (1, world):
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} × "
                         f"context_parallel_size {config.context_parallel_size} but torchrun "
                         f"started {world} processes")
    addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if rank > 0:
        worker_main(config, rank, world, addr, int(os.environ.get("LOCAL_RANK", rank)), None)
        sys.exit(0)
    return RankGroup(0, world, _init_group(0, world, addr, device), kind=_kind(config))


def _kind(config: Any) -> str:
    if config.data_parallel_size > 1:
        return "data-parallel"
    return "context-parallel" if config.context_parallel_size > 1 else "tensor-parallel"


def _watch_workers(group: RankGroup) -> None:
    while not group.stopping:
        group.check_peers(wait=0.0)
        time.sleep(0.2)


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def worker_main(config: Any, rank: int, world: int, addr: str, local_rank: int,
                parent: int | None) -> None:
    """A worker rank: join the group, build the engine replica, run the calls rank 0 sends.
    ``parent``: the process whose end ends this one (None under torchrun)."""
    from dllm.engine import Engine

    if parent is not None:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    logging.basicConfig(level=logging.WARNING)
    device = config.resolve_device()
    if device.type == "cuda":  # one GPU per rank
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        config = dataclasses.replace(config, device=str(device))
    control = _init_group(rank, world, addr, device)
    engine = Engine(config, ranks=RankGroup(rank, world, control, kind=_kind(config)))
    ranks = engine.ranks
    try:
        while (msg := ranks.receive()) is not None:
            call, args = msg
            getattr(engine, call)(*args)
    except BaseException:  # noqa: BLE001 - die at once: rank 0 names this rank and stops
        logger.exception("%s rank %d failed", ranks.kind, rank)
        logging.shutdown()
        os._exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":  # a worker rank, started by ``launch``
    worker_main(*pickle.load(sys.stdin.buffer))
