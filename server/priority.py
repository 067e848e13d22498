"""CPU priorities inside the server: the HTTP event loop first, the engine after it.

The server is one process: the event loop thread (every connection, ``/health``, every
stream's bytes) and the engine thread (the model's steps, with torch's own worker threads)
share the machine's cores. When the cores are all busy — the engine's steps, other programs —
the operating system hands them out by niceness, so a loop thread that wakes up for a
request can wait behind the engine's torch work for tens of milliseconds.
``--engine-nice N`` runs the engine thread, the torch threads it starts and the body-worker
processes ``N`` steps nicer than the loop: the loop, which needs little CPU but needs it at
once, gets it first; the engine keeps every cycle the loop leaves (and waits while the loop
works, e.g. receiving a large body: streams then slow down). Raising one's own
niceness needs no privilege. ``--engine-cpu-threads`` caps torch's threads of a CPU engine;
by default one core is left for the loop (``default_cpu_threads``): on two cores, one torch
thread served more requests a second with a lower ``/health`` tail than two
(``bench/results/stress-20261202-015457-t`` … ``-015746-t1``)."""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("dllm.server")
ENGINE_THREAD_NAME = "dllm-engine"  # the engine thread and the torch threads it starts


def lower_priority(pid_or_tid: int, nice: int) -> None:
    """Add ``nice`` to the niceness of the process or thread (Linux: a thread id is a
    process id for ``setpriority``). Nothing happens where the system has no niceness."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    current = os.getpriority(os.PRIO_PROCESS, pid_or_tid)
    os.setpriority(os.PRIO_PROCESS, pid_or_tid, min(19, current + nice))


def name_thread(tid: int, name: str) -> None:
    """The thread's name as ``top -H``, ``ps -L`` and py-spy show it (Linux; threads it
    starts take the name too)."""
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def default_cpu_threads() -> int:
    """Torch threads of a CPU engine by default: the cores this process may run on, but one
    (the HTTP event loop's), and at least one."""
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    return max(1, cores - 1)


def engine_thread_init(nice: int, cpu_threads: int | None, device_type: str):
    """What the engine thread runs first (``AsyncLLM(thread_init=...)``): its niceness, so
    every thread it starts from then on (torch's OpenMP workers are started by the first
    parallel operation of each thread) inherits it, and its name; and torch's thread count
    for it (``None``: ``default_cpu_threads``; 0: torch's own default)."""
    if cpu_threads is None:
        cpu_threads = default_cpu_threads()

    def init() -> None:
        import torch  # here: the body workers import this module without torch

        tid = threading.get_native_id()
        name_thread(tid, ENGINE_THREAD_NAME)
        lower_priority(tid, nice)
        if cpu_threads and device_type == "cpu":
            torch.set_num_threads(cpu_threads)
        logger.debug("engine thread: nice %d, torch threads %d",
                     os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                     torch.get_num_threads())

    return init
