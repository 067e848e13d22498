"""The prefix cache (DESIGN §6): a radix tree over chunks of committed tokens whose values are
the KV pages (and, for hybrid models, recurrent-state snapshots) those tokens left behind.

A chunk is ``chunk`` tokens: ``lcm(page size, block size)``, so a node holds whole KV pages and
whole blocks (autoregressive models: one page). Its key is the chunk's token ids, its value the
pages that hold their KV at those absolute positions. The KV of a chunk depends only on the
tokens up to its end (causal, or block-causal with blocks inside the chunk), so equal token
prefixes have equal KV, bit for bit: reuse is exact. Full-attention dLLMs (every token sees the
masked tail) have no such KV and never build a tree.

Hybrid models: a node may also hold a state slot of the ``MambaStatePool``, the recurrent state
after the node's last token (a snapshot a forward wrote into a request's *track* slot, donated
to the tree). A state exists only at the ends of some nodes (the track grid), so a hybrid match
is cut back to the deepest node that has one.

Reference counts: a running request *locks* the deepest node of its cached prefix, which
counts one reference on every node of the path to the root; a node with references is never
evicted. Unreferenced nodes are evicted leaf first, least recently used first, when the KV
pool (or the state pool) needs room; their pages and state slot return to the pools together.
Every page and slot is free, held by a request, or held by exactly one node
(``check``)."""

from __future__ import annotations

import heapq
import itertools
import math

from dllm.runner.memory import MambaStatePool, TokenToKVPool


class Node:
    __slots__ = ("key", "pages", "state", "parent", "children", "refs", "last_used", "end")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None, end: int):
        self.key = key  # the chunk's token ids
        self.pages = pages  # KV pages of the chunk's tokens, in order
        self.state: int | None = None  # hybrid: the state slot after ``end`` tokens
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.refs = 0  # running requests whose locked path includes this node
        self.last_used = 0
        self.end = end  # tokens from the root to this node's end


class PrefixCache:
    """``chunk``: tokens per node (a multiple of the page size). ``state_pool``: the hybrid
    model's state pool (None: a KV-only tree)."""

    def __init__(self, kv_pool: TokenToKVPool, chunk: int,
                 state_pool: MambaStatePool | None = None):
        if chunk % kv_pool.page_size:
            raise ValueError(f"a prefix-cache chunk ({chunk}) must be whole KV pages "
                             f"({kv_pool.page_size} tokens)")
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.chunk = chunk
        self.pages_per_node = chunk // kv_pool.page_size
        self.root = Node((), [], None, 0)
        self.root.refs = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_pages = 0  # pages held by the tree
        self.num_states = 0  # state slots held by the tree
        self.evictable_pages = 0  # pages of unreferenced nodes
        self.evictable_states = 0
        self.num_evicted_pages = 0  # pages returned to the pool by eviction, ever

    @staticmethod
    def chunk_for(page_size: int, block_size: int) -> int:
        return math.lcm(page_size, block_size)

    # ---- lookup ------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int, need_state: bool = False) -> Node:
        """The deepest node whose path spells a prefix of ``tokens`` no longer than ``limit``
        tokens (with ``need_state``: the deepest such node holding a state snapshot; the root
        when none). Touches the path (LRU)."""
        node, best, tick = self.root, self.root, next(self._clock)
        c = self.chunk
        for start in range(0, limit // c * c, c):
            child = node.children.get(tuple(tokens[start : start + c]))
            if child is None:
                break
            node = child
            node.last_used = tick
            if not need_state or node.state is not None:
                best = node
        return best

    @staticmethod
    def path(node: Node) -> list[Node]:
        """The nodes from the root's child down to ``node``."""
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def pages_of(self, node: Node) -> list[int]:
        return [p for n in self.path(node) for p in n.pages]

    # ---- references --------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node.parent is not None:
            if node.refs == 0:
                self._evictable(node, -1)
            node.refs += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            node.refs -= 1
            if node.refs < 0:
                raise RuntimeError("prefix-cache node unlocked more often than locked")
            if node.refs == 0:
                self._evictable(node, +1)
            node = node.parent

    def _evictable(self, node: Node, sign: int) -> None:
        self.evictable_pages += sign * len(node.pages)
        if node.state is not None:
            self.evictable_states += sign

    # ---- insertion ---------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int], states: dict[int, int] | None = None
               ) -> tuple[Node, set[int], set[int]]:
        """Add the whole chunks of ``tokens`` (KV in ``pages``, page i holding tokens
        ``[i·P, (i+1)·P)``) below the root. ``states``: a state slot per chunk end (tokens
        from the start) to donate where that node has none. A chunk already in the tree keeps
        its own pages (the caller keeps its copy). Returns the deepest node and the pages and
        state slots the tree took over."""
        states = states or {}
        node, c, per = self.root, self.chunk, self.pages_per_node
        took_pages: set[int] = set()
        took_states: set[int] = set()
        tick = next(self._clock)
        for i, start in enumerate(range(0, len(tokens) // c * c, c)):
            key = tuple(tokens[start : start + c])
            child = node.children.get(key)
            if child is None:
                child = Node(key, list(pages[i * per : (i + 1) * per]), node, start + c)
                node.children[key] = child
                self.num_nodes += 1
                self.num_pages += per
                self.evictable_pages += per
                took_pages.update(child.pages)
            slot = states.get(start + c)
            if slot is not None and child.state is None:
                child.state = slot
                self.num_states += 1
                if child.refs == 0:
                    self.evictable_states += 1
                took_states.add(slot)
            child.last_used = tick
            node = child
        return node, took_pages, took_states

    # ---- eviction ----------------------------------------------------------------------
    def _leaves(self) -> list[tuple[int, int, Node]]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if not n.children and n.refs == 0:
                out.append((n.last_used, id(n), n))
        return out

    def evict(self, num_pages: int = 0, num_states: int = 0) -> None:
        """Free unreferenced nodes, least recently used leaves first, until the KV pool has
        ``num_pages`` free pages and the state pool ``num_states`` free slots (or nothing is
        left to evict)."""
        def short() -> bool:
            return (self.kv_pool.num_free_pages < num_pages
                    or (self.state_pool is not None and self.state_pool.num_free < num_states))

        if not short():
            return
        heap = self._leaves()
        heapq.heapify(heap)
        while heap and short():
            _, _, node = heapq.heappop(heap)
            parent = self._remove(node)
            if parent.parent is not None and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))

    def _remove(self, node: Node) -> Node:
        parent = node.parent
        del parent.children[node.key]
        self.kv_pool.free_pages(node.pages)
        self.num_evicted_pages += len(node.pages)
        self.num_nodes -= 1
        self.num_pages -= len(node.pages)
        self.evictable_pages -= len(node.pages)
        if node.state is not None:
            self.state_pool.free(node.state)
            self.num_states -= 1
            self.evictable_states -= 1
        node.parent = None
        return parent

    def clear(self) -> None:
        """Evict every unreferenced node (all of them when no request runs)."""
        self.evict(num_pages=self.kv_pool.num_usable_pages + 1,
                   num_states=(self.state_pool.num_slots + 1) if self.state_pool else 0)

    # ---- accounting --------------------------------------------------------------------
    def held(self) -> tuple[list[int], list[int]]:
        """The pages and state slots the tree holds."""
        pages, states, stack = [], [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            pages += n.pages
            if n.state is not None:
                states.append(n.state)
        return pages, states
