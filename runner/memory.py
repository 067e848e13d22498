"""Memory pools (DESIGN §6): request slots → token slots, and the paged KV cache."""

from __future__ import annotations

import math

import numpy as np
import torch


class OutOfMemoryError(RuntimeError):
    """A pool had fewer free entries than asked for. The scheduler checks before it allocates,
    so this signals a bookkeeping bug, not a user error."""


class ReqToTokenPool:
    """Row ``r`` maps request slot ``r``'s token index ``t`` (its cache index, i.e. absolute
    position) to a KV slot. Unused entries hold 0, the padding slot. Row 0 is reserved for the
    padding rows of CUDA-graph batches: it always points at the reserved page 0."""

    PADDING_ROW = 0

    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str = "cpu"):
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.req_to_token = torch.zeros(max_reqs + 1, max_context, dtype=torch.int64,
                                        device=device)
        self._free: list[int] = list(range(max_reqs, 0, -1))
        # Bumped whenever a row is handed out or freed (its token slots change): a batch
        # carries the version it was built at, and an attention backend reuses its plan
        # (page table) only for a batch of the same layout and version.
        self.version = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfMemoryError("no free request slot")
        self.version += 1
        return self._free.pop()

    def free(self, index: int) -> None:
        if index in self._free:
            raise RuntimeError(f"request slot {index} freed twice")
        self.req_to_token[index].zero_()
        self._free.append(index)
        self.version += 1


class TokenToKVPool:
    """Paged per-layer K/V buffers ``[num_slots, kv_heads, head_dim]``.

    Page 0 is reserved: its slots absorb the writes of padding tokens, so padded batches
    (CUDA graphs) never touch a live request's cache."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
    ):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        num_slots = num_pages * page_size
        v_dim = v_head_dim or head_dim
        self.k_buffers = [self._buffer(num_slots, num_kv_heads, head_dim)
                          for _ in range(num_layers)]
        self.v_buffers = [self._buffer(num_slots, num_kv_heads, v_dim)
                          for _ in range(num_layers)]
        self._free_pages: list[int] = list(range(num_pages - 1, 0, -1))

    def _buffer(self, *shape: int) -> torch.Tensor:
        """One layer's K or V, zeros. On the CPU the zeros come from ``calloc`` (through
        numpy), whose pages the operating system maps only when a request first writes them:
        a 2 GiB default pool costs what is in use, not 2 GiB up front."""
        if self.device.type != "cpu":
            return torch.zeros(*shape, dtype=self.dtype, device=self.device)
        count = math.prod(shape)
        raw = np.zeros(count * self.dtype.itemsize, dtype=np.uint8)  # calloc: lazily mapped
        return torch.from_numpy(raw).view(self.dtype).view(*shape)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc_pages(self, n: int) -> list[int]:
        if n > len(self._free_pages):
            raise OutOfMemoryError(f"asked for {n} KV pages, {len(self._free_pages)} free")
        pages = self._free_pages[len(self._free_pages) - n :]
        del self._free_pages[len(self._free_pages) - n :]
        return pages[::-1]

    def free_pages(self, pages: list[int]) -> None:
        self._free_pages.extend(reversed(pages))

    def slots_for(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """KV slots of token indices ``[start, end)`` of a sequence stored in ``pages``."""
        t = torch.arange(start, end)
        page_ids = torch.tensor(pages, dtype=torch.int64)[t // self.page_size]
        return page_ids * self.page_size + t % self.page_size

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)


class MambaStatePool:
    """Recurrent state of the hybrid models (DESIGN §6): per Mamba layer a conv state
    ``[slots, conv_dim, K − 1]`` (the model dtype) and an SSM state ``[slots, heads, head_dim,
    d_state]`` (``spec.ssm_dtype``, fp32), one slot per running request — its *committed*
    state: the state after every token it has fed so far (the prompt chunks prefilled, the
    tokens decoded) — and, with the prefix cache, its *track* slots (the extra buffers a
    forward ending on the track grid also writes) and the snapshots the prefix tree holds.

    Slot 0 is the padding slot: padding rows of a CUDA-graph batch read and write it, and a
    forward whose state must be discarded (a block-diffusion denoise step) writes there, so
    no live request's state is touched. A slot is zeroed when it is handed out (a fresh
    request's state is zeros: the conv's zero padding and ``h_0 = 0``); the zeroing is a
    device op queued behind every forward already launched, so a slot freed while a forward
    that wrote it was still queued is safe to hand out again."""

    PADDING_SLOT = 0

    def __init__(self, num_slots: int, num_layers: int, conv_shape: tuple[int, int],
                 ssm_shape: tuple[int, int, int], dtype: torch.dtype,
                 ssm_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot besides the padding slot")
        self.num_slots = num_slots  # usable slots (slot 0 excluded)
        self.num_layers = num_layers
        self.conv = [torch.zeros(num_slots + 1, *conv_shape, dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.ssm = [torch.zeros(num_slots + 1, *ssm_shape, dtype=ssm_dtype, device=device)
                    for _ in range(num_layers)]
        self._free: list[int] = list(range(num_slots, 0, -1))

    @classmethod
    def bytes_per_slot(cls, num_layers: int, conv_shape: tuple[int, int],
                       ssm_shape: tuple[int, int, int], dtype: torch.dtype,
                       ssm_dtype: torch.dtype = torch.float32) -> int:
        conv = conv_shape[0] * conv_shape[1] * dtype.itemsize
        ssm = ssm_shape[0] * ssm_shape[1] * ssm_shape[2] * ssm_dtype.itemsize
        return num_layers * (conv + ssm)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[index], self.ssm[index]

    def alloc(self) -> int:
        if not self._free:
            raise OutOfMemoryError("no free state slot")
        slot = self._free.pop()
        for conv, ssm in zip(self.conv, self.ssm, strict=True):
            conv[slot].zero_()
            ssm[slot].zero_()
        return slot

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot ``dst`` becomes a copy of slot ``src`` in every layer (a prefix-cache hit
        restoring a snapshot into a request's committed slot): device copies queued on the
        current stream, so they land after every forward already launched (the one that
        wrote ``src``) and before the next one (which reads ``dst``)."""
        for conv, ssm in zip(self.conv, self.ssm, strict=True):
            conv[dst].copy_(conv[src])
            ssm[dst].copy_(ssm[src])

    def free(self, slot: int) -> None:
        if slot == self.PADDING_SLOT or slot in self._free:
            raise RuntimeError(f"state slot {slot} freed twice (or the padding slot)")
        self._free.append(slot)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)
