"""Host reads and carried inputs of the overlap schedule: a step is queued before the previous
step's result is read, so the host reads results through an early copy (``HostCopy``) and the
next batch takes its input tokens from the previous output on the device (``Carry``)."""

from __future__ import annotations

import torch

from dllm.runner.forward_batch import ScheduledBatch


class HostCopy:
    """A small device tensor's copy to pinned host memory, started now (queued behind the
    work that produces it) and read later: ``tolist`` waits for this copy only, not for work
    queued after it. On the CPU it is the tensor itself."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tensor = host
        self._tensor = tensor

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._tensor.tolist()


class Carry:
    """Builds a batch's ``ScheduledBatch.carry``: ``add(source)`` for each row in order, with
    ``(tensor, row)`` for a row whose input tokens are that row of an in-flight output (one
    source tensor per forward launched the step before), None for the host's input ids;
    ``attach(batch)`` sets the concatenated sources and the ``carry_row`` input."""

    def __init__(self) -> None:
        self._offsets: dict[int, int] = {}
        self._sources: list[torch.Tensor] = []
        self._size = 0
        self._rows: list[int] = []

    def add(self, source: tuple[torch.Tensor, int] | None) -> None:
        if source is None:
            self._rows.append(-1)
            return
        tensor, row = source
        key = id(tensor)
        if key not in self._offsets:
            self._offsets[key] = self._size
            self._sources.append(tensor)
            self._size += tensor.shape[0]
        self._rows.append(self._offsets[key] + row)

    def attach(self, batch: ScheduledBatch) -> None:
        if not self._sources:
            return
        rows = [t if t.dim() == 2 else t[:, None] for t in self._sources]
        batch.carry = rows[0] if len(rows) == 1 else torch.cat(rows)
        batch.row_inputs["carry_row"] = self._rows
