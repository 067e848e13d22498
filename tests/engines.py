"""One multi-rank ``LLM`` at a time for the tensor-parallel test modules: starting the ranks
is the slow part on two cores, so an engine is kept until another is asked for."""

from __future__ import annotations

import os
from typing import Any

from dllm import LLM


class Engines:
    """``(name, tp, engine settings)`` → an ``LLM`` (tp 1: single process, one per name).
    A process holds one tensor-parallel engine at a time, so the tests of one key run
    together and its engine is kept until another is asked for (or ``release``).
    ``one_thread_ranks``: the ranks it starts run one thread each (three ranks on two cores
    otherwise spin against each other)."""

    def __init__(self, ckpts: dict[str, str], one_thread_ranks: bool = False):
        self.ckpts = ckpts
        self.one_thread_ranks = one_thread_ranks
        self.single: dict[str, LLM] = {}
        self.key: tuple | None = None
        self.current: LLM | None = None

    def __call__(self, name: str, tp: int, **engine_args: Any) -> LLM:
        if tp == 1:
            if name not in self.single:
                self.single[name] = LLM(self.ckpts[name], max_running_requests=4, page_size=4)
            return self.single[name]
        key = (name, tp, tuple(sorted(engine_args.items())))
        if self.key != key:
            self.release()
            if self.one_thread_ranks:
                os.environ["OMP_NUM_THREADS"] = "1"
            try:
                self.current = LLM(self.ckpts[name], max_running_requests=4, page_size=4,
                                   tensor_parallel_size=tp, **engine_args)
            finally:
                if self.one_thread_ranks:
                    os.environ.pop("OMP_NUM_THREADS")
            self.key = key
        return self.current

    def release(self) -> None:
        if self.current is not None:
            self.current.engine.shutdown()
        self.key, self.current = None, None
