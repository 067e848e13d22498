"""A naive, no-cache forward of the hybrid Mamba2 + attention architectures, written from the
published math and independent of ``dllm.models`` (the ground truth the engine is held to).

Everything is spelled out and slow: the SSM is the recurrence itself, one token at a time
(``h_t = exp(dt_t·A)·h_{t−1} + dt_t·x_t ⊗ B_t``, ``y_t = h_t·C_t + D·x_t``, Dao & Gu 2024),
the causal conv a loop over its taps, attention a masked softmax over explicit scores. The
weights are read from the checkpoint's safetensors by their released names.

* ``GraniteMoeHybridForCausalLM``: ``x = embed · embedding_multiplier``; per layer
  ``x += residual_multiplier · mixer(rmsnorm(x))`` (Mamba2 or attention by ``layer_types``,
  attention scale ``attention_multiplier``, RoPE only if ``position_embedding_type == "rope"``)
  and ``x += residual_multiplier · (shared_mlp + MoE)(rmsnorm(x))`` (MoE: softmax over the
  top-k router logits); ``logits = head(rmsnorm(x)) / logits_scaling``.
* ``BambaForCausalLM``: attention at ``attn_layer_indices`` with RoPE on the first half of each
  head (``partial_rotary_factor`` 0.5, θ = 10000), SwiGLU ``feed_forward``.
* ``NemotronHForCausalLM``: one pre-norm and one mixer per layer by ``hybrid_override_pattern``:
  ``M`` Mamba2 (gated norm per group of ``I / n_groups``), ``*`` attention without positions,
  ``-`` MLP ``down(relu(up(x))²)``, ``E`` MoE (sigmoid scores, top-k on the scores plus the
  correction bias within the best groups, weights normalized and times
  ``routed_scaling_factor``, plus a shared expert).
* ``Mamba2ForCausalLM``: ``x += mixer(rmsnorm(x))`` per layer.

``attention_mask`` (``[T, T]`` bool, ``True`` where query ``t`` may see key ``s``) replaces the
causal mask of every attention layer — e.g. block-causal for block diffusion — while the SSM
stays causal, as it is in the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def load(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update({k: v.double() for k, v in load_file(str(f)).items()})
    return config, weights


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(-x.abs())) + x.clamp(min=0)


# ---------------------------------------------------------------------------------------------
# Mamba2 mixer: the recurrence, one token at a time
# ---------------------------------------------------------------------------------------------


def mamba_mixer(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, *, heads: int,
                head_dim: int, groups: int, state: int, eps: float, norm_groups: int,
                dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    """``x [T, hidden]`` → ``[T, hidden]`` for the mixer under prefix ``p``; zero initial
    state."""
    T = x.shape[0]
    inter = heads * head_dim
    proj = x @ w[f"{p}.in_proj.weight"].T
    if f"{p}.in_proj.bias" in w:
        proj = proj + w[f"{p}.in_proj.bias"]
    z = proj[:, :inter]
    xbc = proj[:, inter:inter + inter + 2 * groups * state]
    dt_raw = proj[:, 2 * inter + 2 * groups * state:]
    kern = w[f"{p}.conv1d.weight"][:, 0, :]  # [C, K]
    K = kern.shape[1]
    conv = torch.zeros_like(xbc)
    for t in range(T):
        acc = w[f"{p}.conv1d.bias"].clone() if f"{p}.conv1d.bias" in w else 0.0 * xbc[0]
        for j in range(K):
            src = t - (K - 1) + j
            if src >= 0:
                acc = acc + kern[:, j] * xbc[src]
        conv[t] = silu(acc)
    xs = conv[:, :inter].reshape(T, heads, head_dim)
    Bs = conv[:, inter:inter + groups * state].reshape(T, groups, state)
    Cs = conv[:, inter + groups * state:].reshape(T, groups, state)
    A = -torch.exp(w[f"{p}.A_log"])
    D = w[f"{p}.D"]
    per_group = heads // groups
    h = torch.zeros(heads, head_dim, state, dtype=x.dtype)
    y = torch.zeros(T, heads, head_dim, dtype=x.dtype)
    for t in range(T):
        dt = softplus(dt_raw[t] + w[f"{p}.dt_bias"]).clamp(dt_limit[0], dt_limit[1])
        for hd in range(heads):
            g = hd // per_group
            h[hd] = torch.exp(dt[hd] * A[hd]) * h[hd] + dt[hd] * torch.outer(xs[t, hd], Bs[t, g])
            y[t, hd] = h[hd] @ Cs[t, g] + D[hd] * xs[t, hd]
    gated = y.reshape(T, inter) * silu(z)
    size = inter // norm_groups
    normed = torch.cat([rmsnorm(gated[:, k * size:(k + 1) * size], 1.0, eps)
                        for k in range(norm_groups)], dim=-1) * w[f"{p}.norm.weight"]
    out = normed @ w[f"{p}.out_proj.weight"].T
    if f"{p}.out_proj.bias" in w:
        out = out + w[f"{p}.out_proj.bias"]
    return out


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def _rope(v: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the first ``rot`` dims of ``v [T, heads, d]``, positions 0..T−1."""
    T = v.shape[0]
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    a, rest = v[..., :rot], v[..., rot:]
    half = rot // 2
    rotated = torch.cat([-a[..., half:], a[..., :half]], -1)
    return torch.cat([a * cos + rotated * sin, rest], -1)


def attention(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, *, heads: int, kv: int,
              d: int, scale: float, mask: torch.Tensor, rope: tuple[int, float] | None
              ) -> torch.Tensor:
    T = x.shape[0]

    def proj(name: str) -> torch.Tensor:
        out = x @ w[f"{p}.{name}.weight"].T
        return out + w[f"{p}.{name}.bias"] if f"{p}.{name}.bias" in w else out

    q = proj("q_proj").reshape(T, heads, d)
    k = proj("k_proj").reshape(T, kv, d)
    v = proj("v_proj").reshape(T, kv, d)
    if rope is not None:
        q, k = _rope(q, *rope), _rope(k, *rope)
    out = torch.zeros(T, heads, d, dtype=x.dtype)
    for hd in range(heads):
        g = hd // (heads // kv)
        scores = (q[:, hd] @ k[:, g].T) * scale
        scores = scores.masked_fill(~mask, -math.inf)
        out[:, hd] = torch.softmax(scores, dim=-1) @ v[:, g]
    res = out.reshape(T, heads * d) @ w[f"{p}.o_proj.weight"].T
    return res + w[f"{p}.o_proj.bias"] if f"{p}.o_proj.bias" in w else res


# ---------------------------------------------------------------------------------------------
# The four architectures
# ---------------------------------------------------------------------------------------------


def _granite_mamba(c: dict[str, Any]) -> dict[str, Any]:
    heads = c["mamba_n_heads"]
    head_dim = c.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = int(c.get("mamba_expand", 2) * c["hidden_size"]) // heads
    return {"heads": heads, "head_dim": head_dim, "groups": c["mamba_n_groups"],
            "state": c["mamba_d_state"], "eps": c["rms_norm_eps"], "norm_groups": 1}


def _granite(c, w, ids, mask):
    H, eps, mult = c["hidden_size"], c["rms_norm_eps"], c["residual_multiplier"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = H // heads
    rope = (d, float(c["rope_theta"])) if c.get("position_embedding_type") == "rope" else None
    x = w["model.embed_tokens.weight"][ids] * c["embedding_multiplier"]
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}"
        n = rmsnorm(x, w[f"{p}.input_layernorm.weight"], eps)
        if kind == "mamba":
            out = mamba_mixer(w, f"{p}.mamba", n, **_granite_mamba(c))
        else:
            out = attention(w, f"{p}.self_attn", n, heads=heads, kv=kv, d=d,
                            scale=c["attention_multiplier"], mask=mask, rope=rope)
        x = x + out * mult
        n = rmsnorm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        up = n @ w[f"{p}.shared_mlp.input_linear.weight"].T
        half = up.shape[-1] // 2
        ffn = (silu(up[:, :half]) * up[:, half:]) @ w[f"{p}.shared_mlp.output_linear.weight"].T
        if c.get("num_local_experts", 0):
            ffn = ffn + _granite_moe(c, w, f"{p}.block_sparse_moe", n)
        x = x + ffn * mult
    x = rmsnorm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return (x @ head.T) / c["logits_scaling"]


def _granite_moe(c, w, p, n):
    k = c["num_experts_per_tok"]
    logits = n @ w[f"{p}.router.layer.weight"].T
    out = torch.zeros_like(n)
    for t in range(n.shape[0]):
        top, idx = torch.topk(logits[t], k)
        gates = torch.softmax(top, dim=-1)
        for g, e in zip(gates, idx.tolist(), strict=True):
            up = w[f"{p}.input_linear.weight"][e] @ n[t]
            half = up.shape[0] // 2
            out[t] += g * (w[f"{p}.output_linear.weight"][e] @ (silu(up[:half]) * up[half:]))
    return out


def _swiglu(w, p, x):
    gate, up = x @ w[f"{p}.gate_proj.weight"].T, x @ w[f"{p}.up_proj.weight"].T
    return (silu(gate) * up) @ w[f"{p}.down_proj.weight"].T


def _bamba(c, w, ids, mask):
    H, eps = c["hidden_size"], c["rms_norm_eps"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or H // heads
    attn = set(c.get("attn_layer_indices") or [])
    x = w["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        n = rmsnorm(x, w[f"{p}.input_layernorm.weight"], eps)
        if i in attn:
            out = attention(w, f"{p}.self_attn", n, heads=heads, kv=kv, d=d, scale=d ** -0.5,
                            mask=mask, rope=(d // 2, 10000.0))
        else:
            out = mamba_mixer(w, f"{p}.mamba", n, **_granite_mamba(c))
        x = x + out
        x = x + _swiglu(w, f"{p}.feed_forward", rmsnorm(x, w[f"{p}.pre_ff_layernorm.weight"], eps))
    x = rmsnorm(x, w["model.final_layernorm.weight"], eps)
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def _relu2_mlp(w, p, x):
    return torch.relu(x @ w[f"{p}.up_proj.weight"].T) ** 2 @ w[f"{p}.down_proj.weight"].T


def _nemotron_moe(c, w, p, n):
    E, k = c["n_routed_experts"], c["num_experts_per_tok"]
    n_group, topk_group = c.get("n_group", 1), c.get("topk_group", 1)
    scores = torch.sigmoid(n @ w[f"{p}.gate.weight"].T)
    out = torch.zeros_like(n)
    for t in range(n.shape[0]):
        choice = scores[t] + w[f"{p}.gate.e_score_correction_bias"]
        per = E // n_group
        group_score = torch.stack([choice[g * per:(g + 1) * per].topk(min(2, per)).values.sum()
                                   for g in range(n_group)])
        keep = torch.zeros(E, dtype=torch.bool)
        for g in torch.topk(group_score, topk_group).indices.tolist():
            keep[g * per:(g + 1) * per] = True
        idx = torch.topk(choice.masked_fill(~keep, 0.0), k).indices
        weight = scores[t][idx]
        if c.get("norm_topk_prob", True):
            weight = weight / (weight.sum() + 1e-20)
        weight = weight * c.get("routed_scaling_factor", 1.0)
        for g, e in zip(weight, idx.tolist(), strict=True):
            out[t] += g * _relu2_mlp(w, f"{p}.experts.{e}", n[t:t + 1])[0]
    return out + _relu2_mlp(w, f"{p}.shared_experts", n)


def _nemotron_h(c, w, ids, mask):
    H, eps = c["hidden_size"], c.get("layer_norm_epsilon", 1e-5)
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or H // heads
    limit = tuple(c.get("time_step_limit") or (0.0, math.inf))
    x = w["backbone.embeddings.weight"][ids]
    for i, kind in enumerate(c["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}"
        n = rmsnorm(x, w[f"{p}.norm.weight"], eps)
        m = f"{p}.mixer"
        if kind == "M":
            out = mamba_mixer(w, m, n, heads=c["mamba_num_heads"], head_dim=c["mamba_head_dim"],
                              groups=c["n_groups"], state=c["ssm_state_size"], eps=eps,
                              norm_groups=c["n_groups"], dt_limit=limit)
        elif kind == "*":
            out = attention(w, m, n, heads=heads, kv=kv, d=d, scale=d ** -0.5, mask=mask,
                            rope=None)
        elif kind == "-":
            out = _relu2_mlp(w, m, n)
        else:
            out = _nemotron_moe(c, w, m, n)
        x = x + out
    x = rmsnorm(x, w["backbone.norm_f.weight"], eps)
    return x @ w.get("lm_head.weight", w["backbone.embeddings.weight"]).T


def _mamba2(c, w, ids, mask):
    eps = c["layer_norm_epsilon"]
    limit = tuple(c.get("time_step_limit") or (0.0, math.inf))
    x = w["backbone.embeddings.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"backbone.layers.{i}"
        n = rmsnorm(x, w[f"{p}.norm.weight"], eps)
        x = x + mamba_mixer(w, f"{p}.mixer", n, heads=c["num_heads"], head_dim=c["head_dim"],
                            groups=c["n_groups"], state=c["state_size"], eps=eps, norm_groups=1,
                            dt_limit=limit)
    x = rmsnorm(x, w["backbone.norm_f.weight"], eps)
    return x @ w.get("lm_head.weight", w["backbone.embeddings.weight"]).T


FORWARDS = {"GraniteMoeHybridForCausalLM": _granite,
            "GraniteMoeHybridForBlockDiffusion": _granite,  # the same network
            "BambaForCausalLM": _bamba,
            "NemotronHForCausalLM": _nemotron_h, "Mamba2ForCausalLM": _mamba2}


def naive_logits(path: str | Path, ids: list[int], attention_mask: torch.Tensor | None = None,
                 *, loaded: tuple[dict, dict] | None = None) -> torch.Tensor:
    """Logits ``[T, vocab]`` (float64) of one row. ``attention_mask [T, T]`` bool (default
    causal) applies to attention layers only."""
    config, weights = loaded if loaded is not None else load(path)
    T = len(ids)
    mask = (torch.ones(T, T, dtype=torch.bool).tril() if attention_mask is None
            else attention_mask.bool())
    arch = config["architectures"][0]
    return FORWARDS[arch](config, weights, torch.tensor(ids), mask)


def naive_greedy(path: str | Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation by full recompute at every step."""
    loaded = load(path)
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(naive_logits(path, ids, loaded=loaded)[-1].argmax()))
    return ids[len(prompt):]


def block_causal_mask(T: int, block: int, offset: int = 0) -> torch.Tensor:
    """Block-causal attention over ``T`` tokens: blocks of ``block`` tokens from ``offset``;
    a token sees its own block and every earlier one, and each token before ``offset`` is a
    block of its own (a causal prefix)."""
    pos = torch.arange(T)
    blk = torch.where(pos < offset, pos - offset, (pos - offset) // block)
    return blk[None, :] <= blk[:, None]
