"""The post-step of a ``DLLM_EXTEND`` forward: align the logits, run each row's unmasking
algorithm on the device, and pack the result into one small tensor for the host.

A batch with a traced request (``SamplingParams.denoise_steps`` or ``logprobs``) appends
trace columns to that tensor (``dllm.trace``): per position the algorithm's confidence and
the log-probability of the output token, and the top alternatives when asked, so they
reach the host in the same copy. Other batches compute none of it."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from dllm.algorithms import ALGORITHMS, get_algorithm
from dllm.algorithms.base import KEY_SPECS, DenoiseInput, SamplingTensors
from dllm.algorithms.sampling import log_normalizer
from dllm.models.parallel import map_leading
from dllm.request import BlockState, DenoiseState, Req
from dllm.runner.forward_batch import ForwardBatch, LogitsMode
from dllm.runner.input_registry import InputRegistry
from dllm.trace import RowTrace, trace_width, unpack_row


@dataclass(frozen=True)
class DenoiseResult:
    """Host copy of one denoise step's result (the one read per step)."""

    tokens: list[list[int]]  # [bs][B]
    done: list[bool]
    num_transferred: list[int]
    state: list[dict]  # per row: algorithm state, name -> 0-d device tensor
    # Shifted-logits models (Fast-dLLM v2): the greedy token read at the block's last
    # position, the next block's first token on a commit row; -1 otherwise.
    next_token: list[int]
    trace: list[RowTrace] | None = None  # traced batches: every row's trace columns


ROW_INPUTS = {  # name -> (dtype, pad)
    "step": (torch.int64, 0),
    "num_initial_masks": (torch.int64, 0),
    "temperature": (torch.float32, 0.0),
    "top_k": (torch.int64, 0),
    "top_p": (torch.float32, 1.0),
    "seed": (torch.int64, 0),
}


def denoise_inputs(registry: InputRegistry) -> None:
    """Declare the post-step inputs in the runner's static registry: the row settings above,
    every algorithm key (``cfg.<key>``) and every algorithm state (``state.<key>``), so a
    captured graph reads them all from fixed buffers."""
    registry.register("editable", "tokens", torch.int64, 0)
    for name, (dtype, pad) in ROW_INPUTS.items():
        registry.register(name, "reqs", dtype, pad)
    for key, spec in KEY_SPECS.items():
        registry.register(f"cfg.{key}", "reqs", torch.float32 if spec.kind is float
                          else torch.int64, 0)
    for cls in ALGORITHMS.values():
        for key in cls.state_keys:
            registry.register(f"state.{key}", "reqs", torch.int64, 0)


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed")


def _row_settings(r: Req) -> dict[str, float | int]:
    """A request's sampling settings and algorithm settings (``cfg.<key>``, strings by their
    index among the choices, as ``stack_configs`` does) as numbers, computed once."""
    if r.row_settings is None:
        p = r.params
        settings: dict[str, float | int] = {
            "temperature": float(p.temperature), "top_k": p.effective_top_k,
            "top_p": float(p.top_p), "seed": int(p.seed or 0)}
        config = r.denoise.algo_config if isinstance(r.state, DenoiseState) else {}
        for key, v in config.items():
            spec = KEY_SPECS[key]
            settings[f"cfg.{key}"] = (spec.choices.index(v) if spec.kind is str
                                      and isinstance(v, str) else int(v) if spec.kind is bool
                                      else v)
        r.row_settings = settings
    return r.row_settings


def sampling_rows(reqs: list[Req]) -> dict[str, list]:
    """Per-row sampling settings (shared by every generation kind)."""
    rows = [_row_settings(r) for r in reqs]
    return {k: [s[k] for s in rows] for k in SAMPLING_KEYS}


def sampling_flags(row_inputs: dict[str, list]) -> tuple[bool, bool, bool]:
    """Host knowledge of a batch's sampling (``SamplingTensors.may_sample/may_filter/
    may_filter_any``): whether any row samples, whether any sampled row filters by top-k /
    top-p, and whether any row at all sets them (Dream filters greedy rows too). Rows that
    need none get identical results without the noise hashing or the vocabulary sort."""
    rows = list(zip(row_inputs["temperature"], row_inputs["top_k"], row_inputs["top_p"],
                    strict=True))
    may_sample = any(t > 0 for t, _, _ in rows)
    return (may_sample, any(t > 0 and (k > 0 or p < 1) for t, k, p in rows),
            any(k > 0 or p < 1 for _, k, p in rows))


GRAPH_FLAGS = ((False, False, False), (True, True, True))


GREEDY_FILTERED = (False, False, True)


def graph_flags(row_inputs: dict[str, list]) -> tuple[bool, bool, bool]:
    """The sampling flags a captured graph is keyed by: a greedy batch replays a graph
    without the sampling work; any sampling row takes the general graph (exact for every
    row). Two graphs per shape (``GRAPH_FLAGS``, captured at start), instead of one per
    ``sampling_flags`` value, and a third for a greedy batch in which some row sets top-k or
    top-p (``GREEDY_FILTERED``, captured on first use): Dream's distribution filters greedy
    rows too, which the plain greedy graph skips."""
    may_sample, _, may_filter_any = sampling_flags(row_inputs)
    if may_sample:
        return GRAPH_FLAGS[1]
    return GREEDY_FILTERED if may_filter_any else GRAPH_FLAGS[0]


def config_rows(reqs: list[Req]) -> dict[str, list]:
    """Each row's algorithm settings as numbers, one list per key any row uses (0 where a
    row's algorithm has no such key)."""
    rows = [_row_settings(r) for r in reqs]
    keys: set[str] = set()
    for s in rows:
        keys.update(s)
    return {k: [s.get(k, 0) for s in rows] for k in sorted(keys) if k.startswith("cfg.")}


def state_rows(reqs: list[Req], device: torch.device) -> dict[str, torch.Tensor]:
    """Each row's algorithm state, stacked on the device (zeros at a block's start)."""
    keys = sorted({k for r in reqs for k in get_algorithm(r.denoise.algorithm).state_keys})
    if not keys:  # most algorithms keep no state: no device work at all
        return {}
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return {f"state.{k}": torch.stack([r.denoise.block.algo_state.get(k, zero) for r in reqs])
            for k in keys}


def trace_top(reqs: list[Req]) -> int | None:
    """The trace a batch computes: None when no request asked for one, else the most
    log-probability alternatives any of them asked for (0: the output token's only)."""
    tops = [r.params.logprobs or 0 for r in reqs if r.params.traced]
    return max(tops) if tops else None


_TRACE_TAG = "#trace"


def graph_group(algorithm: str, top: int | None) -> str:
    """The captured-graph group of a batch's rows: the algorithm, tagged with the trace
    (a traced batch replays a graph of its own; untraced graphs are unchanged)."""
    return algorithm if top is None else f"{algorithm}{_TRACE_TAG}{top}"


def parse_group(group: str) -> tuple[str, int | None]:
    """Inverse of ``graph_group``."""
    name, tag, top = group.partition(_TRACE_TAG)
    return name, (int(top) if tag else None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 values as int64 columns holding their bits (one packed copy for all)."""
    return t.float().contiguous().view(torch.int32).to(torch.int64)


# The unmasking step's vocabulary passes make tensors of [positions, vocab] (the sampler's
# counter hashes in int64, float32 probabilities): over a wide batch the step's largest
# allocations, which a CUDA graph of that batch keeps for good. Rows pass through the
# algorithm in groups of at most this many positions (one row a pass if a row has more); a
# row's result does not depend on the other rows', so the tokens are the same. A traced
# batch's trace columns (``_trace``) pass in the same groups.
POST_CHUNK_POSITIONS = 2048


def _rows_a_pass(block: int) -> int:
    """Rows of ``block`` positions in one pass (``POST_CHUNK_POSITIONS``; at least one)."""
    return max(1, POST_CHUNK_POSITIONS // block)


def _put(dst: torch.Tensor | None, at: slice | torch.Tensor | None,
         src: torch.Tensor) -> torch.Tensor:
    """``src`` written into the rows ``at`` of ``dst`` (``at`` None: ``src`` is every row)."""
    if at is None:
        return src
    if isinstance(at, slice):
        dst[at] = src
    else:
        dst.index_copy_(0, at, src)
    return dst


class DenoisePost:
    """Runs on the device right after the forward, with no host synchronisation: every
    per-row input comes from the runner's static registry (``fb.extras``). ``groups`` maps
    an algorithm to its rows, known on the host; a CUDA graph captures one algorithm over
    all rows of a padded batch."""

    def __init__(self, groups: dict[str, list[int]], num_rows: int, mask_token_id: int,
                 logits_shift: int, flags: tuple[bool, bool, bool] = (True, True, True),
                 trace: int | None = None):
        """``trace``: None, or the top alternatives the trace columns carry (``trace_top``)."""
        self.groups = groups
        self.trace = trace
        self.flags = flags
        self.num_rows = num_rows
        self.mask_token_id = mask_token_id
        self.logits_shift = logits_shift

    @classmethod
    def for_graph(cls, bs: int, group: str, flags: tuple[bool, bool, bool],
                  mask_token_id: int | None, logits_shift: int) -> DenoisePost:
        """The post-step a CUDA graph of ``bs`` rows captures for the algorithm ``group``
        (``graph_group``: one algorithm over every row, padding rows included)."""
        name, trace = parse_group(group)
        return cls({name: list(range(bs))}, bs, mask_token_id, logits_shift, flags, trace)

    @classmethod
    def for_reqs(cls, reqs: list[Req], blocks: list[BlockState], mask_token_id: int,
                 logits_shift: int) -> DenoisePost:
        """``blocks``: the block of each row (``ScheduledBatch.row_state``)."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, (r, blk) in enumerate(zip(reqs, blocks, strict=True)):
            if not blk.resolved:  # commit rows only write their KV
                groups[r.denoise.algorithm].append(i)
        return cls(dict(groups), len(reqs), mask_token_id, logits_shift,
                   sampling_flags(sampling_rows(reqs)), trace_top(reqs))

    def __call__(self, fb: ForwardBatch, hidden: torch.Tensor,
                 logits: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        bs, b = self.num_rows, fb.block_size
        logits = logits[: bs * b].view(bs, b, -1)
        last_logits = logits[:, -1]
        # Fast-dLLM v2's commit pass takes the next block's first token greedily from the
        # block's last position (its reference does so at any temperature).
        next_token = (logits[:, -1].argmax(dim=-1) if self.logits_shift else
                      torch.full((bs,), -1, dtype=torch.int64, device=logits.device))
        if self.logits_shift:
            # Token i is read from position i-1; position 0 of a block is never masked.
            logits = map_leading(logits, lambda t: torch.cat([t[:, :1], t[:, :-1]], dim=1))
        ex = fb.extras
        # A merged commit row (``LogitsMode.BLOCK``): the step is over each row's last block.
        sel = fb.block_token_index if fb.logits_mode is LogitsMode.BLOCK else slice(0, bs * b)
        full = {
            "tokens": fb.input_ids[sel].view(bs, b),
            "editable": ex["editable"][sel].view(bs, b).bool(),
            "positions": fb.positions[sel].view(bs, b),
            **{k: v[:bs] for k, v in ex.items() if k not in ("editable",)},
        }
        out_tokens = full["tokens"].clone()
        done = torch.zeros(bs, dtype=torch.int64, device=logits.device)
        transferred = torch.zeros_like(done)
        states: dict[str, torch.Tensor] = {}
        # Traced batches: each row's confidence (NaN where its algorithm reports none).
        conf = (torch.full((bs, b), float("nan"), device=logits.device)
                if self.trace is not None else None)
        per = _rows_a_pass(b)
        for name, rows in self.groups.items():
            algo = get_algorithm(name)
            for lo in range(0, len(rows), per):
                part = rows[lo:lo + per]
                # The whole batch in one pass: no gather; a run of rows (a wide graph's
                # passes): a slice; else a gather.
                at: slice | torch.Tensor | None = (
                    None if len(part) == bs else
                    slice(part[0], part[-1] + 1) if part[-1] - part[0] + 1 == len(part) else
                    torch.tensor(part, dtype=torch.int64, device=logits.device))

                def take(t: torch.Tensor, at: slice | torch.Tensor | None = at) -> torch.Tensor:
                    return (t if at is None else t[at] if isinstance(at, slice)
                            else t.index_select(0, at))

                x = DenoiseInput(
                    logits=take(logits), tokens=take(full["tokens"]),
                    editable=take(full["editable"]), mask_id=self.mask_token_id,
                    step=take(full["step"]), num_initial_masks=take(full["num_initial_masks"]),
                    positions=take(full["positions"]),
                    sampling=SamplingTensors(*(take(full[k]) for k in (
                        "temperature", "top_k", "top_p", "seed")), *self.flags),
                    config={k: take(full[f"cfg.{k}"]).to(KEY_SPECS[k].dtype)
                            for k in algo.defaults},
                    state={k: take(full[f"state.{k}"]) for k in algo.state_keys},
                    block_len=take(full["fd.block_len"]) if "fd.block_len" in full else None,
                )
                out = algo.step(x)
                if conf is not None and out.confidence is not None:
                    c = out.confidence() if callable(out.confidence) else out.confidence
                    conf = _put(conf, at, c.float())
                out_tokens = _put(out_tokens, at, out.tokens)
                done = _put(done, at, out.done.to(torch.int64))
                transferred = _put(transferred, at, out.num_transferred.to(torch.int64))
                for k, v in out.state.items():
                    if at is not None:
                        states.setdefault(k, v.new_zeros((bs, *v.shape[1:])))
                    states[k] = _put(states.get(k), at, v)
        packed = torch.cat([out_tokens, done[:, None], transferred[:, None],
                            next_token[:, None]], dim=1)
        if conf is not None:
            packed = torch.cat([packed, self._trace(logits, last_logits, out_tokens,
                                                    next_token, conf)], dim=1)
        return packed, states

    def _trace(self, logits: torch.Tensor, last_logits: torch.Tensor, tokens: torch.Tensor,
               next_token: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        """The trace columns (``dllm.trace.trace_columns``): ``log_softmax`` of the aligned
        logits at each output token, the algorithm's confidence (the probability where it
        reports none), the top-``k`` alternatives, and the same for the next block's first
        token read at the last position (0 for models without shifted logits). Rows pass in
        groups of at most ``POST_CHUNK_POSITIONS`` positions, as the unmasking's do (a row's
        columns do not depend on the other rows')."""
        bs, b = tokens.shape
        per = _rows_a_pass(b)
        if bs > per:
            return torch.cat([self._trace(logits[i:i + per], last_logits[i:i + per],
                                          tokens[i:i + per], next_token[i:i + per],
                                          conf[i:i + per])
                              for i in range(0, bs, per)])
        k = self.trace
        raw = logits.float()
        norm = log_normalizer(raw)  # [bs, B], summed in a fixed order: batch-invariant
        lp = raw.gather(-1, tokens[..., None]).squeeze(-1) - norm
        conf = torch.where(torch.isnan(conf), lp.exp(), conf)
        cols = [_bits(conf), _bits(lp)]
        if k:
            top = raw.topk(k, dim=-1)
            cols += [top.indices.reshape(bs, b * k),
                     _bits(top.values - norm[..., None]).reshape(bs, b * k)]
        last = last_logits.float()
        nxt = next_token.clamp(min=0)
        last_norm = log_normalizer(last)
        next_lp = last.gather(-1, nxt[:, None]).squeeze(-1) - last_norm
        if not self.logits_shift:
            next_lp = torch.zeros_like(next_lp)
        cols.append(_bits(next_lp)[:, None])
        if k:
            top = last.topk(k, dim=-1)
            cols += [top.indices, _bits(top.values - last_norm[:, None])]
        return torch.cat(cols, dim=1)

    @staticmethod
    def read(output: tuple[torch.Tensor, dict[str, torch.Tensor]],
             trace: int | None = None) -> DenoiseResult:
        """The one host read of a denoise step. ``trace``: a traced batch's ``trace_top``
        (its rows carry trace columns after the usual ones)."""
        packed, states = output
        rows = packed.tolist()
        if trace is not None:
            k = trace
            b = trace_width(len(rows[0]), k)
            traced = [unpack_row(r[b + 3:], b, k) for r in rows]
            rows = [r[: b + 3] for r in rows]
        return DenoiseResult(
            tokens=[r[:-3] for r in rows],
            done=[bool(r[-3]) for r in rows],
            num_transferred=[r[-2] for r in rows],
            state=[{k: v[i] for k, v in states.items()} for i in range(len(rows))],
            next_token=[r[-1] for r in rows],
            trace=traced if trace is not None else None,
        )
