#!/usr/bin/env python
"""Train the built-in block-diffusion model (``dllm/builtin_model/``) from scratch.

The network is the runtime's own ``SDARForCausalLM``; the checkpoint it writes has SDAR's
tensor names and config keys and loads with ``dllm.models.loader.load_model`` and ``LLM()``.

Recipe (SDAR / BD3-LM block diffusion). A sequence is the ChatML text of a conversation; the
last assistant answer, its ``<|im_end|>`` and ``<|endoftext|>`` padding to the end of that block
are the response, everything before it is the (always clean) prompt. Blocks are aligned to
position 0, as the engine aligns them, so the last prompt block is shared with the first
response tokens. Per block a mask ratio ``t ~ U(0, 1]`` is drawn and each response token of the
block is replaced by ``<|MASK|>`` with probability ``t``. The model reads the noised sequence
concatenated with the clean one under a 2L x 2L mask: a noised block sees itself
(bidirectionally) and the clean blocks before it; a clean block sees the clean blocks up to and
including itself. The loss is cross-entropy on the masked positions.

The tokenizer is trained here with ``tokenizers``: ChatML specials, the mask token, and one token
per character (so every digit and every letter is its own token: arithmetic, reversing and
counting stay learnable).

The corpus comes from ``dllm.tasks`` with training seeds that never equal ``tasks.EVAL_SEED``.
At the end the script decodes held-out questions (the eval seed) with a naive block-diffusion
decoder (full recompute per step) and prints accuracy and tokens per forward.

    python scripts/train_builtin.py --out dllm/builtin_model --max-minutes 7

``--hybrid`` trains the hybrid sibling (``dllm/builtin_hybrid/``, ``--model builtin-hybrid``):
the same corpus, tokenizer and objective on a Granite-H layout (``--attention-every`` 4: three
Mamba2 layers, then one attention layer), exported as a ``GraniteMoeHybridForBlockDiffusion``
checkpoint (GraniteMoeHybrid keys and tensor names, plus ``mask_token_id`` and ``block_size``).
The two copies pass the Mamba2 layers as the engine runs them: the clean copy causally over
the whole sequence (the committed state); each noised block from the clean state and conv
window at its start, causally within the block (a denoise step from the committed state).
The SSM is its quadratic form over the sequence (``_ssd_two_copies``), in plain
differentiable torch.

    python scripts/train_builtin.py --hybrid --out dllm/builtin_hybrid --max-minutes 10
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers


def _ensure_dllm_importable() -> None:
    """Run from a source tree that is not pip-installed (e.g. a bare GPU machine): the repo
    root holds ``dllm/`` and, beside it, ``models/`` and ``runner/``, which pyproject maps to
    ``dllm.models`` and ``dllm.runner``."""
    try:
        import dllm.models  # noqa: F401
    except ModuleNotFoundError:
        root = str(Path(__file__).resolve().parents[1])
        sys.path.insert(0, root)
        import dllm

        dllm.__path__.append(root)


_ensure_dllm_importable()

from dllm import tasks  # noqa: E402
from dllm.models.attention import AttentionLayer  # noqa: E402
from dllm.models.config import ModelConfig  # noqa: E402
from dllm.models.granite_hybrid import GraniteMoeHybridForCausalLM  # noqa: E402
from dllm.models.loader import load_weights  # noqa: E402
from dllm.models.mamba2 import (  # noqa: E402
    Mamba2Mixer,
    discretize,
    gated_rms_norm,
    split_projection,
)
from dllm.models.registry import BLOCK_DIFFUSION_GRANITE_HYBRID  # noqa: E402
from dllm.models.sdar import SDARForCausalLM  # noqa: E402
from dllm.runner.attention.base import AttentionBackend  # noqa: E402
from dllm.runner.forward_batch import AttentionMask, ForwardBatch, ForwardMode  # noqa: E402

EOT, IM_START, IM_END, MASK, UNK = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>",
                                    "<|unk|>")
SPECIALS = [EOT, IM_START, IM_END, MASK, UNK]
ALPHABET = [chr(c) for c in range(32, 127)] + ["\n"]  # printable ASCII and newline
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Relative frequency of each family in the corpus: sorting and arithmetic are the hardest to learn.
FAMILY_WEIGHTS = {"add": 1.5, "sub": 1.5, "compare": 1.0, "reverse": 1.1, "sort": 1.7,
                  "count": 1.2, "greeting": 0.03}
MULTI_TURN_FRACTION = 0.1  # examples with 1-2 earlier exchanges in the prompt


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """``CHAT_TEMPLATE`` in Python (a test checks that both agree)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """One token per character (specials aside): digits are split individually first, then
    every character is its own pre-token, so BPE can learn no merges."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Split(Regex("."), behavior="isolated"),
    ])
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIALS) + len(ALPHABET),
                                  special_tokens=SPECIALS, initial_alphabet=ALPHABET,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    missing = [c for c in ALPHABET if tok.token_to_id(c) is None]
    if missing:
        raise RuntimeError(f"tokenizer lacks characters {missing}")
    return tok


def tokenizer_config(max_len: int) -> dict:
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "mask_token": MASK,
        "model_max_length": max_len,
        "pad_token": EOT,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
    }


def special_tokens_map() -> dict:
    return {"additional_special_tokens": [IM_START, IM_END], "eos_token": IM_END,
            "mask_token": MASK, "pad_token": EOT, "unk_token": UNK}


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------


def family_counts(n: int) -> dict[str, int]:
    total = sum(FAMILY_WEIGHTS.values())
    return {f: max(1, round(n * w / total)) for f, w in FAMILY_WEIGHTS.items()}


def chunk_seed(seed: int, chunk: int) -> int:
    s = 1_000_000 * (seed + 1) + chunk
    assert s != tasks.EVAL_SEED
    return s


def conversations(n: int, seed: int, chunk: int) -> list[tuple[str, str]]:
    """``(prompt text, response text)`` pairs of one corpus chunk."""
    s = chunk_seed(seed, chunk)
    pool = [ex for f, k in family_counts(n).items() for ex in tasks.generate(f, k, s)]
    rng = random.Random(f"train-chunk:{s}")
    rng.shuffle(pool)
    out = []
    for q, a in pool:
        messages: list[dict[str, str]] = []
        if rng.random() < MULTI_TURN_FRACTION:
            for pq, pa in rng.sample(pool, rng.randint(1, 2)):
                messages += [{"role": "user", "content": pq}, {"role": "assistant", "content": pa}]
        messages.append({"role": "user", "content": q})
        out.append((render_chat(messages, add_generation_prompt=True), a + IM_END))
    return out


def _conversations_job(job: tuple[int, int, int]) -> list[tuple[str, str]]:
    return conversations(*job)


class CharEncoder:
    """Vectorised encoding for this tokenizer, which maps every character to one token: the
    special tokens are replaced by placeholder bytes, then one table lookup per byte.
    ``check`` compares it with the tokenizer itself."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.lut = torch.full((128,), tok.token_to_id(UNK), dtype=torch.uint8)
        for c in ALPHABET:
            self.lut[ord(c)] = tok.token_to_id(c)
        for i, s in enumerate(SPECIALS):
            self.lut[1 + i] = tok.token_to_id(s)  # placeholders \x01..\x05

    @staticmethod
    def _plain(text: str) -> str:
        for i, s in enumerate(SPECIALS):
            text = text.replace(s, chr(1 + i))
        return text

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat ids (uint8) and the number of tokens of each text."""
        plain = [self._plain(t) for t in texts]
        data = "".join(plain).encode("ascii")
        flat = self.lut[torch.frombuffer(bytearray(data), dtype=torch.uint8).long()]
        return flat, torch.tensor([len(t) for t in plain], dtype=torch.int64)

    def check(self, texts: list[str]) -> None:
        flat, lens = self.encode(texts)
        for text, ids in zip(texts, flat.split(lens.tolist()), strict=True):
            want = self.tok.encode(text, add_special_tokens=False).ids
            if ids.tolist() != want:
                raise RuntimeError(f"fast encoding differs from the tokenizer on {text!r}")


def pack(enc: CharEncoder, convs: list[tuple[str, str]], block: int, buckets: list[int],
         pad_id: int) -> dict[int, tuple[torch.Tensor, ...]]:
    """Per bucket length L: ``ids [n, L]`` (uint8, padded with ``pad_id``), ``prompt_len [n]``
    and ``end [n]``, the end of the block holding ``<|im_end|>`` (the loss covers
    ``[prompt_len, end)``). Conversations longer than the longest bucket are dropped."""
    flat, lens = enc.encode([p + r for p, r in convs])
    plens = enc.encode([p for p, _ in convs])[1]
    offs = torch.cumsum(lens, 0) - lens
    end = (lens + block - 1) // block * block
    out, lo = {}, 0
    for L in sorted(buckets):
        sel = ((end > lo) & (end <= L)).nonzero().squeeze(1)
        lo = L
        if len(sel) == 0:
            continue
        col = torch.arange(L)
        idx = (offs[sel, None] + col).clamp(max=len(flat) - 1)
        ids = torch.where(col < lens[sel, None], flat[idx], torch.tensor(pad_id, dtype=torch.uint8))
        out[L] = (ids, plens[sel].to(torch.int16), end[sel].to(torch.int16))
    return out


def build_corpus(tok: Tokenizer, n: int, seed: int, block: int, buckets: list[int],
                 workers: int) -> dict[int, tuple[torch.Tensor, ...]]:
    per_chunk = 20_000
    jobs = [(min(per_chunk, n - i), seed, c) for c, i in enumerate(range(0, n, per_chunk))]
    if workers > 1 and len(jobs) > 1:
        # spawn, not fork: the parent has already started torch's threads.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx) as ex:
            convs = [c for part in ex.map(_conversations_job, jobs) for c in part]
    else:
        convs = [c for job in jobs for c in conversations(*job)]
    enc = CharEncoder(tok)
    enc.check([p + r for p, r in convs[:500]])
    parts = [pack(enc, convs[i : i + 100_000], block, buckets, tok.token_to_id(EOT))
             for i in range(0, len(convs), 100_000)]
    corpus = {}
    for L in buckets:
        got = [p[L] for p in parts if L in p]
        if got:
            corpus[L] = tuple(torch.cat([g[i] for g in got]) for i in range(3))
    return corpus


# ---------------------------------------------------------------------------------------------
# Model and attention
# ---------------------------------------------------------------------------------------------


def model_config(args: argparse.Namespace, tok: Tokenizer) -> dict:
    vocab = tok.get_vocab_size()
    padded = -(-vocab // 64) * 64
    return {
        "architectures": ["SDARForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": args.block_size,
        "bos_token_id": tok.token_to_id(EOT),
        "eos_token_id": tok.token_to_id(IM_END),
        "head_dim": args.hidden_size // args.heads,
        "hidden_act": "silu",
        "hidden_size": args.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": args.intermediate_size,
        "mask_token_id": tok.token_to_id(MASK),
        "max_position_embeddings": args.max_positions,
        "max_window_layers": args.layers,
        "model_type": "sdar",
        "num_attention_heads": args.heads,
        "num_hidden_layers": args.layers,
        "num_key_value_heads": args.heads,
        "pad_token_id": tok.token_to_id(EOT),
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": padded,
    }


def hybrid_config(args: argparse.Namespace, tok: Tokenizer) -> dict:
    """The Granite-H layout: ``attention_every - 1`` Mamba2 layers, then one attention layer,
    repeated; no μP multipliers (all 1, attention scale 1/sqrt(head_dim)); RoPE attention
    unless ``--nope`` (Granite 4.0-H's own attention is NoPE)."""
    vocab = tok.get_vocab_size()
    head_dim = args.hidden_size // args.heads
    kinds = ["attention" if (i + 1) % args.attention_every == 0 else "mamba"
             for i in range(args.layers)]
    return {
        "architectures": [BLOCK_DIFFUSION_GRANITE_HYBRID], "model_type": "granitemoehybrid",
        "attention_bias": False, "attention_dropout": 0.0, "attention_multiplier": head_dim ** -0.5,
        "block_size": args.block_size, "bos_token_id": tok.token_to_id(EOT),
        "eos_token_id": tok.token_to_id(IM_END), "embedding_multiplier": 1.0,
        "hidden_act": "silu", "hidden_size": args.hidden_size, "initializer_range": 0.02,
        "intermediate_size": args.intermediate_size, "layer_types": kinds, "logits_scaling": 1.0,
        "mamba_chunk_size": 64, "mamba_conv_bias": True, "mamba_d_conv": 4,
        "mamba_d_head": args.mamba_head_dim, "mamba_d_state": args.mamba_d_state,
        "mamba_expand": 2, "mamba_n_groups": 1,
        "mamba_n_heads": 2 * args.hidden_size // args.mamba_head_dim, "mamba_proj_bias": False,
        "mask_token_id": tok.token_to_id(MASK), "max_position_embeddings": args.max_positions,
        "normalization_function": "rmsnorm", "num_attention_heads": args.heads,
        "num_experts_per_tok": 0, "num_hidden_layers": args.layers,
        "num_key_value_heads": args.heads, "num_local_experts": 0,
        "pad_token_id": tok.token_to_id(EOT),
        "position_embedding_type": "nope" if args.nope else "rope",
        "residual_multiplier": 1.0, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "rope_theta": 10000.0, "shared_intermediate_size": args.intermediate_size,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": -(-vocab // 64) * 64,
    }


def init_mamba(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Mamba2's usual initialisation: ``dt_bias`` the inverse softplus of a dt drawn
    log-uniformly in [1e-3, 1e-1], ``A = -[1, 16]`` uniformly, ``D = 1``."""
    for m in model.modules():
        if isinstance(m, Mamba2Mixer):
            with torch.no_grad():
                h = m.dt_bias.shape[0]
                dt = torch.exp(torch.rand(h, generator=gen) * (math.log(0.1) - math.log(1e-3))
                               + math.log(1e-3))
                m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                m.A_log.copy_(torch.log(1 + 15 * torch.rand(h, generator=gen)))
                m.D.fill_(1.0)


def _conv_blocks(xbc: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(causal conv)`` of ``xbc [b, n, B, C]`` (n blocks), each block's window
    continuing from ``prev [b, n, K-1, C]`` (the inputs before it)."""
    k = weight.shape[-1]
    window = torch.cat([prev, xbc], dim=2)  # [b, n, K-1+B, C]
    taps = window.unfold(2, k, 1)  # [b, n, B, C, K]
    out = (taps * weight).sum(-1)
    return F.silu(out + bias if bias is not None else out)


def _ssd_two_copies(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    c: torch.Tensor, block: int) -> torch.Tensor:
    """The SSM of both copies in its quadratic ("attention") form over the whole sequence,
    without D. ``x [2, b, L, H, P]``, ``dt [2, b, L, H]``, ``a [H]``, ``b, c [2, b, L, H, N]``
    (copy 0 noised, copy 1 clean). With ``G`` the clean copy's inclusive cumulative decay
    ``Σ dt·A`` and ``g`` the noised copy's, restarted at every block:

    - clean ``y_t = Σ_{s≤t} (C_t·B_s) e^{G_t − G_s} dt_s x_s``: causal over the sequence;
    - noised ``y_t = Σ_{s<start(t)} (C_t·B̄_s) e^{G_{start−1} + g_t − G_s} dt̄_s x̄_s
      + Σ_{start≤s≤t} (C_t·B_s) e^{g_t − g_s} dt_s x_s`` (bars: the clean copy): the clean
      state at the block's start carried into the noised block, which runs causally.

    The same numbers as the state recursion of ``dllm.models.mamba2`` (a test checks it
    against the mixer), as batched matrix products over ``[b, H, L, L]`` scores: at these
    lengths (≤ 192) cheaper than materialising the ``[H, P, N]`` state at every block."""
    _, bsz, length, heads, _ = x.shape
    n = length // block
    da = (dt * a).permute(0, 1, 3, 2)  # [2, b, H, L]
    xdt = (x * dt[..., None]).permute(0, 1, 3, 2, 4)  # [2, b, H, L, P]
    bt, ct = b.permute(0, 1, 3, 2, 4), c.permute(0, 1, 3, 2, 4)  # [2, b, H, L, N]
    big = da[1].cumsum(-1)  # G, [b, H, L]
    small = da[0].view(bsz, heads, n, block).cumsum(-1).view(bsz, heads, length)  # g
    pos = torch.arange(length, device=x.device)
    blk = pos // block
    causal = pos[:, None] >= pos[None, :]
    before = blk[:, None] > blk[None, :]  # s in an earlier block than t
    within = causal & (blk[:, None] == blk[None, :])
    # G at the position before each block's start (0 for the first block).
    g_prev = torch.cat([torch.zeros_like(big[..., :1]), big[..., block - 1:-1:block]], -1)
    g_prev = g_prev.repeat_interleave(block, dim=-1)  # [b, H, L]

    def decay(rows: torch.Tensor, cols: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.exp((rows[..., :, None] - cols[..., None, :]).masked_fill(~keep, -math.inf))

    clean = (ct[1] @ bt[1].transpose(-1, -2)) * decay(big, big, causal)
    cross = (ct[0] @ bt[1].transpose(-1, -2)) * decay(g_prev + small, big, before)
    intra = (ct[0] @ bt[0].transpose(-1, -2)) * decay(small, small, within)
    y_clean = clean @ xdt[1]
    y_noised = cross @ xdt[1] + intra @ xdt[0]
    return torch.stack([y_noised, y_clean]).permute(0, 1, 3, 2, 4)  # [2, b, L, H, P]


def mamba_two_copies(m: Mamba2Mixer, noised: torch.Tensor, clean: torch.Tensor,
                     block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixer over the two copies ``[b, L, H]`` (module docstring): the clean copy causal
    over the sequence, each noised block from the clean state (and conv window) at its
    start. Matches ``Mamba2Mixer.forward`` of a block from that state (checked in
    ``tests/test_builtin_model.py``)."""
    d = m.dims
    bsz, length, _ = clean.shape
    n, k = length // block, d.conv_kernel
    both = torch.stack([noised, clean])  # [2, b, L, H]
    z, xbc, dt = split_projection(m.in_proj(both), d)
    xbc = xbc.view(2, bsz, n, block, -1)
    # Conv windows: the K-1 clean inputs before each block (zeros before the first).
    tail = xbc[1, :, :, block - (k - 1):]  # [b, n, K-1, C]
    prev = torch.cat([torch.zeros_like(tail[:, :1]), tail[:, :-1]], dim=1)
    weight = m.conv1d.weight.squeeze(1)
    conv = _conv_blocks(xbc.reshape(2 * bsz, n, block, -1), prev.repeat(2, 1, 1, 1),
                        weight, m.conv1d.bias).view(2, bsz, length, -1)
    dt, a = discretize(dt, m.dt_bias, m.A_log, d.time_step_limit)
    x, bm, cm = conv.float().split([d.intermediate_size, d.n_groups * d.d_state,
                                    d.n_groups * d.d_state], dim=-1)
    rep = d.num_heads // d.n_groups
    x = x.reshape(2, bsz, length, d.num_heads, d.head_dim)
    bm = bm.reshape(2, bsz, length, d.n_groups, d.d_state).repeat_interleave(rep, dim=3)
    cm = cm.reshape(2, bsz, length, d.n_groups, d.d_state).repeat_interleave(rep, dim=3)
    y = _ssd_two_copies(x, dt, a, bm, cm, block) + x * m.D.float()[:, None]
    y = y.reshape(2, bsz, length, d.intermediate_size)
    out = m.out_proj(gated_rms_norm(y, z, m.norm.weight, d.norm_eps,
                                    d.norm_group_size).to(both.dtype))
    return out[0], out[1]


def hybrid_hidden(model: GraniteMoeHybridForCausalLM, xt: torch.Tensor | None,
                  x0: torch.Tensor, mask: torch.Tensor, block: int) -> torch.Tensor:
    """Hidden states ``[b, L, H]`` of the noised copy ``xt``: attention layers over the two
    copies under ``block_diffusion_mask`` (as for the attention-only model), Mamba2 layers by
    ``mamba_two_copies``. ``xt`` None: the one sequence ``x0`` under a block-causal ``mask``
    (the SSM causal over it), for decoding; batched, unlike the runner's stateless path."""
    b, length = x0.shape
    copies = 1 if xt is None else 2
    inner = model.model
    pos = torch.arange(length, device=x0.device)
    ids = x0 if xt is None else torch.cat([xt, x0], dim=1)
    fb = dense_batch(ids, mask)
    flat_pos = pos.repeat(copies).expand(b, copies * length).reshape(-1)
    x = inner.embed_tokens(ids.reshape(-1)) * inner.embedding_multiplier
    for layer in inner.layers:
        h = layer.input_layernorm(x)
        if layer.is_mamba:
            hv = h.view(b, copies * length, -1)
            noised, clean = mamba_two_copies(layer.mamba, hv[:, :length], hv[:, -length:],
                                             block)
            h = (clean if xt is None else torch.cat([noised, clean], dim=1)).reshape(
                b * copies * length, -1)
        else:
            h = layer.self_attn(flat_pos, h, fb)
        x = x + h * layer.residual_multiplier
        h = layer.post_attention_layernorm(x)
        x = x + layer.shared_mlp(h) * layer.residual_multiplier
    return inner.norm(x).view(b, copies * length, -1)[:, :length]


class DenseMaskAttention(AttentionBackend):
    """Training/eval attention: the flat token axis is ``[batch, S]`` rows of equal length,
    attended with ``scaled_dot_product_attention`` under one explicit ``[S, S]`` mask taken
    from ``forward_batch.extras["attn_mask"]``. No KV cache."""

    name = "dense_mask"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                forward_batch: ForwardBatch) -> torch.Tensor:
        mask = forward_batch.extras["attn_mask"]
        b, s = forward_batch.batch_size, mask.shape[-1]
        q, k, v = (x.view(b, s, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling)
        return out.transpose(1, 2).reshape(b * s, layer.num_heads, layer.head_dim)


def dense_batch(ids: torch.Tensor, mask: torch.Tensor) -> ForwardBatch:
    """A ``ForwardBatch`` for ``DenseMaskAttention`` over ``ids [b, s]``."""
    b, s = ids.shape
    zeros = torch.zeros(b, dtype=torch.int64, device=ids.device)
    lens = torch.full((b,), s, dtype=torch.int64, device=ids.device)
    return ForwardBatch(
        mode=ForwardMode.EXTEND, batch_size=b, input_ids=ids.reshape(-1),
        positions=torch.zeros(b * s, dtype=torch.int64, device=ids.device),
        req_pool_indices=zeros, prefix_lens=zeros, extend_lens=lens, seq_lens=lens,
        out_cache_loc=torch.zeros(b * s, dtype=torch.int64, device=ids.device),
        prefix_lens_cpu=[0] * b, extend_lens_cpu=[s] * b, seq_lens_cpu=[s] * b,
        attention_mask=AttentionMask.BLOCK_CAUSAL, attn_backend=DenseMaskAttention(),
        extras={"attn_mask": mask},
    )


def block_causal_mask(length: int, block: int, device: torch.device) -> torch.Tensor:
    blk = torch.arange(length, device=device) // block
    return blk[None, :] <= blk[:, None]


def block_diffusion_mask(length: int, block: int, device: torch.device) -> torch.Tensor:
    """``[2L, 2L]``: rows/keys ``[0, L)`` are the noised copy, ``[L, 2L)`` the clean one."""
    blk = torch.arange(length, device=device) // block
    q, k = blk[:, None], blk[None, :]
    top = torch.cat([q == k, k < q], dim=1)  # noised: own block, clean earlier blocks
    bottom = torch.cat([torch.zeros_like(q == k), k <= q], dim=1)  # clean: block-causal
    return torch.cat([top, bottom], dim=0)


def run_hidden(model: SDARForCausalLM, ids: torch.Tensor, positions: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """``ids [b, s]`` at ``positions [s]`` → hidden ``[b, s, H]``."""
    b, s = ids.shape
    fb = dense_batch(ids, mask)
    pos = positions.expand(b, s).reshape(-1)
    return model(ids.reshape(-1), pos, fb).view(b, s, -1)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def training_loss(model: SDARForCausalLM, x0: torch.Tensor, prompt_len: torch.Tensor,
                  end: torch.Tensor, block: int, mask_id: int, mask2: torch.Tensor,
                  gen: torch.Generator) -> torch.Tensor:
    b, L = x0.shape
    dev = x0.device
    pos = torch.arange(L, device=dev)
    response = (pos[None] >= prompt_len[:, None]) & (pos[None] < end[:, None])
    t = 1.0 - torch.rand(b, L // block, device=dev, generator=gen)  # (0, 1]
    noise = torch.rand(b, L, device=dev, generator=gen)
    masked = response & (noise < t.repeat_interleave(block, dim=1))
    xt = torch.where(masked, torch.full_like(x0, mask_id), x0)
    if isinstance(model, GraniteMoeHybridForCausalLM):
        hidden = hybrid_hidden(model, xt, x0, mask2, block)
    else:
        hidden = run_hidden(model, torch.cat([xt, x0], dim=1), torch.cat([pos, pos]), mask2)
    logits = model.compute_logits(hidden[:, :L][masked]).float()
    return F.cross_entropy(logits, x0[masked])


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------------
# Naive block-diffusion decoding (full recompute each step) for the final metrics
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def naive_decode(model: SDARForCausalLM, prompts: list[list[int]], block: int, mask_id: int,
                 stop_ids: set[int], threshold: float | None, max_new: int,
                 autocast: bool) -> list[tuple[list[int], int, int]]:
    """Greedy decoding of every prompt at once. Each step unmasks, in every unfinished row's
    current block, the most confident masked token and (``threshold`` set) every masked token
    whose probability exceeds it. Returns ``(tokens, denoise forwards, blocks)`` per prompt;
    the tokens end at the first stop id (included)."""
    dev = next(model.parameters()).device
    n = len(prompts)
    plen = torch.tensor([len(p) for p in prompts], device=dev)
    limit = -(-(max(len(p) for p in prompts) + max_new) // block) * block
    x = torch.full((n, limit), mask_id, dtype=torch.int64, device=dev)
    for i, p in enumerate(prompts):
        x[i, : len(p)] = torch.tensor(p, device=dev)
    mask = block_causal_mask(limit, block, dev)
    pos = torch.arange(limit, device=dev)
    cur = plen // block  # current block of each row
    last = (plen + max_new - 1) // block  # last block each row may decode
    active = torch.ones(n, dtype=torch.bool, device=dev)
    forwards = torch.zeros(n, dtype=torch.int64, device=dev)
    blocks = torch.zeros(n, dtype=torch.int64, device=dev)
    offs = torch.arange(block, device=dev)
    stops = torch.tensor(sorted(stop_ids), device=dev)
    rows = torch.arange(n, device=dev)
    while bool(active.any()):
        idx = active.nonzero().squeeze(1)
        with torch.autocast(dev.type, torch.bfloat16, enabled=autocast):
            hidden = (hybrid_hidden(model, None, x[idx], mask, block)
                      if isinstance(model, GraniteMoeHybridForCausalLM)
                      else run_hidden(model, x[idx], pos, mask))
        cols = cur[idx, None] * block + offs  # [a, B]
        h = hidden[torch.arange(len(idx), device=dev)[:, None], cols]
        probs = model.compute_logits(h).float().softmax(-1)
        conf, pred = probs.max(-1)
        tokens = x[idx[:, None], cols]
        masked = tokens == mask_id
        conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
        pick = F.one_hot(conf.argmax(-1), block).bool() & masked
        if threshold is not None:
            pick |= masked & (conf > threshold)
        x[idx[:, None], cols] = torch.where(pick, pred, tokens)
        forwards[idx] += 1
        resolved = ~(x[idx[:, None], cols] == mask_id).any(-1)
        done_rows = idx[resolved]
        if len(done_rows):
            blocks[done_rows] += 1
            bcols = cur[done_rows, None] * block + offs
            gen_part = bcols >= plen[done_rows, None]
            hit = (torch.isin(x[done_rows[:, None], bcols], stops) & gen_part).any(-1)
            finished = hit | (cur[done_rows] >= last[done_rows])
            active[done_rows[finished]] = False
            cur[done_rows[~finished]] += 1
    out = []
    for i in rows.tolist():
        gen = x[i, plen[i]:].tolist()
        cut = next((j + 1 for j, t in enumerate(gen) if t in stop_ids), None)
        gen = gen[:cut] if cut is not None else gen[:max_new]
        out.append((gen, int(forwards[i]), int(blocks[i])))
    return out


def evaluate(model: SDARForCausalLM, tok: Tokenizer, block: int, n_per_family: int,
             autocast: bool) -> dict:
    """Accuracy and parallelism on held-out questions (the eval seed), in the training
    templates (``one_token_per_step``, ``threshold_0.9``) and in the held-out templates
    (the same names with ``held_out_`` in front)."""
    mask_id, stop_ids = tok.token_to_id(MASK), {tok.token_to_id(IM_END), tok.token_to_id(EOT)}
    result = {}
    for held_out in (False, True):
        items = [(f, q, a) for f in tasks.EVAL_FAMILIES
                 for q, a in tasks.generate(f, n_per_family, tasks.EVAL_SEED, held_out)]
        prompts = [tok.encode(render_chat([{"role": "user", "content": q}], True),
                              add_special_tokens=False).ids for _, q, _ in items]
        for name, threshold in (("one_token_per_step", None), ("threshold_0.9", 0.9)):
            outs = naive_decode(model, prompts, block, mask_id, stop_ids, threshold, 64,
                                autocast)
            per: dict[str, list[int]] = {}
            toks = fwd = blks = 0
            for (f, _, a), (gen, nf, nb) in zip(items, outs, strict=True):
                text = tok.decode(gen, skip_special_tokens=True).strip()
                per.setdefault(f, []).append(int(text == a))
                toks, fwd, blks = toks + len(gen), fwd + nf, blks + nb
            acc = {f: sum(v) / len(v) for f, v in per.items()}
            acc["overall"] = sum(sum(v) for v in per.values()) / len(items)
            result[("held_out_" if held_out else "") + name] = {
                "accuracy": acc, "tokens_per_forward": toks / max(fwd, 1),
                "forwards_per_block": fwd / max(blks, 1)}
            print(f"eval {'held-out' if held_out else 'train'} phrasings, {name}: "
                  + ", ".join(f"{f} {100 * v:.1f}" for f, v in acc.items()), flush=True)
    return result


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def granite_names(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The hybrid's parameters under GraniteMoeHybrid's released tensor names: the packed
    ``qkv_proj`` split into ``q_proj``/``k_proj``/``v_proj``, ``shared_mlp.gate_up_proj`` as
    ``shared_mlp.input_linear`` (gate rows first, as Granite stores it), ``down_proj`` as
    ``output_linear``."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    sizes = [config["num_attention_heads"] * head_dim,
             config["num_key_value_heads"] * head_dim, config["num_key_value_heads"] * head_dim]
    out = {}
    for name, t in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), t.split(sizes), strict=True):
                out[f"{base}{part}.weight"] = rows.contiguous()
        elif name.endswith("shared_mlp.gate_up_proj.weight"):
            out[name.replace("gate_up_proj", "input_linear")] = t
        elif name.endswith("shared_mlp.down_proj.weight"):
            out[name.replace("down_proj", "output_linear")] = t
        else:
            out[name] = t
    return out


def save_checkpoint(model: SDARForCausalLM, config: dict, tok: Tokenizer, out: Path,
                    block: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
             for k, v in model.state_dict().items()}
    if isinstance(model, GraniteMoeHybridForCausalLM):
        state = granite_names(state, config)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(config["max_position_embeddings"]), indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_tokens_map(), indent=2) + "\n")
    gen = {"dllm": {"algorithm": "threshold", "threshold": 0.9},
           "eos_token_id": [tok.token_to_id(IM_END), tok.token_to_id(EOT)],
           "pad_token_id": tok.token_to_id(EOT), "bos_token_id": tok.token_to_id(EOT)}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--hybrid", action="store_true",
                   help="train the hybrid sibling (Mamba2 + attention, Granite-H layout)")
    p.add_argument("--attention-every", type=int, default=4,
                   help="--hybrid: every N-th layer is attention, the others Mamba2")
    p.add_argument("--mamba-head-dim", type=int, default=64)
    p.add_argument("--mamba-d-state", type=int, default=32)
    p.add_argument("--nope", action="store_true",
                   help="--hybrid: attention without positions (Granite 4.0-H's own choice)")
    p.add_argument("--init-from", metavar="DIR",
                   help="start from this checkpoint (its config and tokenizer; the size flags "
                        "are ignored) instead of a fresh initialisation: a second run that "
                        "continues a first, with its own warm-up and schedule")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--buckets", default="64,128,192",
                   help="sequence lengths (multiples of the block size) examples are padded to")
    p.add_argument("--train-examples", type=int, default=2_000_000)
    p.add_argument("--steps", type=int, default=20_000, help="optimizer steps (upper bound)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="shrink --steps to fit this much training time (measured after "
                        "--calibration-steps, inside the warmup, so the schedule is that of "
                        "--steps set to the printed value; re-fitted, only ever shorter, "
                        "at every log line if the steps slow down)")
    p.add_argument("--calibration-steps", type=int, default=60)
    p.add_argument("--batch-tokens", type=int, default=65536,
                   help="tokens of the noised copy per step (the model reads twice as many)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--eval-per-family", type=int, default=200)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--save-every-minutes", type=float, default=2.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    autocast = device.type == "cuda"
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {hw}", flush=True)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    buckets = [int(b) for b in args.buckets.split(",")]
    if any(b % args.block_size for b in buckets):
        raise SystemExit("every bucket length must be a multiple of the block size")
    out = Path(args.out)

    t0 = time.time()
    src = Path(args.init_from) if args.init_from else None
    if src is not None:  # warm start: the checkpoint's own tokenizer and config
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    else:
        tok = train_tokenizer([p + r for p, r in conversations(2000, args.seed, 0)])
    corpus = build_corpus(tok, args.train_examples, args.seed, args.block_size, buckets,
                          args.workers)
    counts = {L: len(c[0]) for L, c in corpus.items()}
    print(f"tokenizer: {tok.get_vocab_size()} tokens; corpus: {sum(counts.values())} examples "
          f"by length {counts} in {time.time() - t0:.1f}s", flush=True)
    corpus = {L: tuple(x.to(device) for x in c) for L, c in corpus.items()}
    lengths = sorted(corpus)
    weights = torch.tensor([float(counts[L]) for L in lengths])
    masks = {L: block_diffusion_mask(L, args.block_size, device) for L in lengths}

    if src is not None:
        config = json.loads((src / "config.json").read_text())
        if (config["model_type"] == "granitemoehybrid") != args.hybrid:
            raise SystemExit(f"--init-from {src}: a {config['model_type']} checkpoint; "
                             f"{'drop' if args.hybrid else 'add'} --hybrid")
        cls = GraniteMoeHybridForCausalLM if args.hybrid else SDARForCausalLM
        model = load_weights(cls(ModelConfig(config)), src, torch.float32).to(device)
        model.requires_grad_(True)  # the loader fills parameters for inference
        print(f"initialised from {src}", flush=True)
    elif args.hybrid:
        config = hybrid_config(args, tok)
        model = GraniteMoeHybridForCausalLM(ModelConfig(config))  # torch's default init
        init_mamba(model, torch.Generator().manual_seed(args.seed))
        model = model.to(device)
    else:
        config = model_config(args, tok)
        model = SDARForCausalLM(ModelConfig(config)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, config {json.dumps(config)}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    pick = torch.Generator().manual_seed(args.seed)
    mask_id = tok.token_to_id(MASK)

    total = args.steps
    model.train()
    t_train = time.time()
    last_save = t_train
    t_calib = None
    loss_sum, loss_n = 0.0, 0
    step = 0
    while step < total:
        if args.max_minutes is not None and step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.time()
        if args.max_minutes is not None and step == args.calibration_steps and t_calib:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_calib) / (args.calibration_steps - 10)
            fit = int((args.max_minutes * 60 - (time.time() - t_train)) / per_step) + step
            total = max(step + 1, min(total, fit))
            print(f"calibration: {per_step * 1e3:.1f} ms/step -> --steps {total}", flush=True)
        L = lengths[int(torch.multinomial(weights, 1, generator=pick))]
        ids, plen, end = corpus[L]
        bsz = max(1, args.batch_tokens // L)
        rows = torch.randint(0, len(ids), (bsz,), device=device, generator=gen)
        x0 = ids[rows].long()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.lr, args.warmup)
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss = training_loss(model, x0, plen[rows].long(), end[rows].long(),
                                 args.block_size, mask_id, masks[L], gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_sum += loss.detach()
        loss_n += 1
        step += 1
        if (args.max_minutes is not None and t_calib and step > args.calibration_steps
                and step % args.log_every == 0):
            # Re-fit, never lengthening: another process on the same GPU (or a clock that
            # drops under steady load) slows the steps after the calibration.
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_calib) / (step - 10)
            fit = int((args.max_minutes * 60 - (time.time() - t_train)) / per_step) + step
            if fit < total:
                total = max(step + 1, fit)
                print(f"re-fit: {per_step * 1e3:.1f} ms/step -> --steps {total}", flush=True)
        if step % args.log_every == 0 or step == total:
            avg = float(loss_sum) / loss_n
            print(f"step {step}/{total} loss {avg:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{time.time() - t_train:.0f}s", flush=True)
            loss_sum, loss_n = 0.0, 0
            final_loss = avg
        if time.time() - last_save > args.save_every_minutes * 60:
            save_checkpoint(model, config, tok, out, args.block_size)
            last_save = time.time()
    train_s = time.time() - t_train
    save_checkpoint(model, config, tok, out, args.block_size)

    model.eval()
    t_eval = time.time()
    metrics = (evaluate(model, tok, args.block_size, args.eval_per_family, autocast)
               if args.eval_per_family > 0 else {})
    summary = {"command": shlex.join([sys.executable, *sys.argv]), "hardware": hw,
               "torch": torch.__version__, "parameters": n_params, "steps": total,
               "train_seconds": round(train_s, 1), "final_loss": final_loss,
               "eval_seed": tasks.EVAL_SEED, "eval_per_family": args.eval_per_family,
               "eval_seconds": round(time.time() - t_eval, 1), "metrics": metrics}
    if src is not None:  # the run this one continues, and its own (recursively)
        prev = src / "train_metrics.json"
        summary["initialised_from"] = json.loads(prev.read_text()) if prev.exists() else str(src)
    print("final:", json.dumps(summary, indent=2), flush=True)
    (out / "train_metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
