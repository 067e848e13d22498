"""The Mamba2 mixer (``dllm.models.mamba2``) against transformers 4.57's own mixer outputs
(``tests/data/refvectors/hybrid_*.json``, from ``scripts/refvectors/hybrid.py``) and against
itself: chunked equals whole, a block from a state equals continuing the sequence, decode
equals the next row of a full forward, varlen batched rows equal each row alone.

fp32 throughout; every bound is 1e-5 relative to the largest magnitude compared (the values
reach ~10, where one fp32 ulp is ~1e-6)."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dllm.models.mamba2 import Mamba2Dims, Mamba2Mixer
from dllm.testing.factory import make_tiny_hybrid_checkpoint
from tests.refvector_replay import check_factory_weights

sys.path.insert(0, str(Path(__file__).parent))
from naive_hybrid import load as naive_load  # noqa: E402
from naive_hybrid import mamba_mixer as naive_mixer  # noqa: E402

DATA = Path(__file__).parent / "data" / "refvectors"
CASES = ["granite_h_micro", "bamba", "mamba2"]
PREFIX = {"GraniteMoeHybridForCausalLM": "model.layers.0.mamba",
          "BambaForCausalLM": "model.layers.0.mamba", "Mamba2ForCausalLM": "backbone.layers.0.mixer",
          "NemotronHForCausalLM": "backbone.layers.0.mixer"}


def decode_b64(s: str, shape: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.float32).copy()
                            ).reshape(shape)


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max(1, max |b|)."""
    b = b.to(a.dtype)
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def mixer_from(path: Path) -> tuple[Mamba2Mixer, dict, dict]:
    config = json.loads((path / "config.json").read_text())
    prefix = PREFIX[config["architectures"][0]]
    m = Mamba2Mixer(Mamba2Dims.from_config(config))
    w = load_file(str(path / "model.safetensors"))
    state = {k[len(prefix) + 1:]: v for k, v in w.items() if k.startswith(prefix + ".")}
    m.load_state_dict(state, strict=True)
    return m.eval(), config, prefix


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    record = json.loads((DATA / f"hybrid_{request.param}.json").read_text())
    ck = record["checkpoint"]
    path = make_tiny_hybrid_checkpoint(ck["layout"], tmp_path_factory.mktemp(request.param),
                                       seed=ck["seed"], **ck["overrides"])
    check_factory_weights(path, ck, ck["layout"])
    m, config, prefix = mixer_from(path)
    return record, path, m, config, prefix


@torch.no_grad()
def test_whole_row_equals_transformers(case) -> None:
    record, _, m, config, _ = case
    v = record["mixer"]
    x = decode_b64(v["input"], [v["tokens"], config["hidden_size"]])
    y, _, _ = m(x, *m.zero_states(1), [v["tokens"]])
    assert close(y, decode_b64(v["output"], list(y.shape))) <= 1e-5


@torch.no_grad()
def test_prefill_states_and_decode_equal_transformers(case) -> None:
    """transformers' cached prefill (conv state = the last K inputs, SSM state) and its
    one-token cache path, against ``forward`` then ``decode``."""
    record, _, m, config, _ = case
    v = record["mixer"]
    n = v["decode_after_prefill"]
    x = decode_b64(v["input"], [v["tokens"], config["hidden_size"]])
    _, conv, ssm = m(x[:n], *m.zero_states(1), [n])
    hf_conv = decode_b64(v["conv_state_after_prefill"], v["conv_state_shape"])
    assert close(conv[0], hf_conv[:, 1:]) <= 1e-5  # ours keeps K - 1 inputs, theirs K
    assert close(ssm[0], decode_b64(v["ssm_state_after_prefill"], v["ssm_state_shape"])) <= 1e-5
    y, _, _ = m.decode(x[n:n + 1], conv, ssm)
    assert close(y[0], decode_b64(v["decode_output"], [config["hidden_size"]])) <= 1e-5


@torch.no_grad()
def test_sequential_recurrence_equals_transformers(case) -> None:
    """The naive reference's token-by-token mixer (tests/naive_hybrid.py) agrees too."""
    record, path, m, config, prefix = case
    v = record["mixer"]
    x = decode_b64(v["input"], [v["tokens"], config["hidden_size"]])
    _, w = naive_load(path)
    d = m.dims
    y = naive_mixer(w, prefix, x.double(), heads=d.num_heads, head_dim=d.head_dim,
                    groups=d.n_groups, state=d.d_state, eps=d.norm_eps,
                    norm_groups=d.intermediate_size // d.norm_group_size)
    assert close(y, decode_b64(v["output"], list(y.shape))) <= 1e-5


def _random_mixer(dims: Mamba2Dims, seed: int = 0) -> Mamba2Mixer:
    gen = torch.Generator().manual_seed(seed)
    m = Mamba2Mixer(dims)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        m.A_log.copy_(torch.log(1 + 7 * torch.rand(dims.num_heads, generator=gen)))
        m.dt_bias.copy_(torch.rand(dims.num_heads, generator=gen) - 1.0)
    return m.eval()


DIMS = {"full-norm": Mamba2Dims(32, 8, 8, 2, 16, 4, 8, 1e-5, 64),
        "group-norm": Mamba2Dims(32, 8, 8, 4, 8, 4, 8, 1e-5, 16, (0.0, 0.5))}


@pytest.mark.parametrize("name", sorted(DIMS))
@torch.no_grad()
def test_chunked_equals_whole(name: str) -> None:
    m = _random_mixer(DIMS[name])
    x = torch.randn(45, 32, generator=torch.Generator().manual_seed(1))
    ref = None
    for chunk in (1, 3, 8, 64):
        m.dims = Mamba2Dims(**{**DIMS[name].__dict__, "chunk_size": chunk})
        y, conv, ssm = m(x, *m.zero_states(1), [45])
        if ref is None:
            ref = (y, conv, ssm)
        for a, b in zip((y, conv, ssm), ref, strict=True):
            assert close(a, b) <= 1e-5


@pytest.mark.parametrize("name", sorted(DIMS))
@torch.no_grad()
def test_block_from_state_equals_continuing(name: str) -> None:
    """Prefill in blocks of any sizes (chunked prefill; block diffusion's committed blocks)
    from the state the previous block left equals one forward of the whole row."""
    m = _random_mixer(DIMS[name], seed=2)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    whole, conv_w, ssm_w = m(x, *m.zero_states(1), [40])
    for cuts in ((1, 40), (4, 8, 12, 16, 20, 24, 28, 32, 36, 40), (3, 11, 27, 40), (2, 3, 40)):
        state, start, ys = m.zero_states(1), 0, []
        for end in cuts:
            y, *state = m(x[start:end], *state, [end - start])
            ys.append(y)
            start = end
        assert close(torch.cat(ys), whole) <= 1e-5
        assert close(state[0], conv_w) <= 1e-5 and close(state[1], ssm_w) <= 1e-5


@pytest.mark.parametrize("name", sorted(DIMS))
@torch.no_grad()
def test_decode_equals_next_row_of_full_forward(name: str) -> None:
    m = _random_mixer(DIMS[name], seed=4)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(5))
    whole, _, _ = m(x, *m.zero_states(1), [20])
    _, conv, ssm = m(x[:12], *m.zero_states(1), [12])
    for t in range(12, 20):  # decode token by token from the prefill's state
        y, conv, ssm = m.decode(x[t:t + 1], conv, ssm)
        assert close(y[0], whole[t]) <= 1e-5


@pytest.mark.parametrize("name", sorted(DIMS))
@torch.no_grad()
def test_varlen_batch_equals_alone(name: str) -> None:
    """Rows of different lengths from different states, token-major, equal each row alone;
    ``decode`` over rows equals each row's own decode."""
    m = _random_mixer(DIMS[name], seed=6)
    gen = torch.Generator().manual_seed(7)
    lens = [17, 1, 0, 9]
    conv = torch.randn(m.dims.conv_state_shape(4), generator=gen)
    ssm = torch.randn(m.dims.ssm_state_shape(4), generator=gen)
    x = torch.randn(sum(lens), 32, generator=gen)
    y, conv_b, ssm_b = m(x, conv, ssm, lens)
    start = 0
    for r, n in enumerate(lens):
        y_r, conv_r, ssm_r = m(x[start:start + n], conv[r:r + 1], ssm[r:r + 1], [n])
        assert close(y[start:start + n], y_r) <= 1e-5 if n else y_r.shape[0] == 0
        assert close(conv_b[r], conv_r[0]) <= 1e-5 and close(ssm_b[r], ssm_r[0]) <= 1e-5
        start += n
    assert torch.equal(conv_b[2], conv[2]) and torch.equal(ssm_b[2], ssm[2])  # 0 tokens
    xd = torch.randn(4, 32, generator=gen)
    yd, conv_d, ssm_d = m.decode(xd, conv, ssm)
    for r in range(4):
        y_r, conv_r, ssm_r = m(xd[r:r + 1], conv[r:r + 1], ssm[r:r + 1], [1])
        assert close(yd[r], y_r[0]) <= 1e-5
        assert close(conv_d[r], conv_r[0]) <= 1e-5 and close(ssm_d[r], ssm_r[0]) <= 1e-5


@torch.no_grad()
def test_inputs_are_not_written(tmp_path: Path) -> None:
    """A denoise step reads the committed state and writes nothing: the mixer returns new
    states and leaves the ones it was given bit-identical."""
    m = _random_mixer(DIMS["full-norm"], seed=8)
    gen = torch.Generator().manual_seed(9)
    conv = torch.randn(m.dims.conv_state_shape(2), generator=gen)
    ssm = torch.randn(m.dims.ssm_state_shape(2), generator=gen)
    before = conv.clone(), ssm.clone()
    m(torch.randn(7, 32, generator=gen), conv, ssm, [4, 3])
    m.decode(torch.randn(2, 32, generator=gen), conv, ssm)
    assert torch.equal(conv, before[0]) and torch.equal(ssm, before[1])


@torch.no_grad()
def test_nemotron_h_group_norm_mixer_equals_naive(tmp_path: Path) -> None:
    """Nemotron-H's mixer (gated norm per group) on the factory's hub-named checkpoint equals
    the naive token-by-token reference."""
    path = make_tiny_hybrid_checkpoint("nemotron-h", tmp_path)
    m, config, prefix = mixer_from(path)
    assert m.dims.norm_group_size == m.dims.intermediate_size // config["n_groups"]
    x = torch.randn(19, config["hidden_size"], generator=torch.Generator().manual_seed(10))
    y, _, _ = m(x, *m.zero_states(1), [19])
    _, w = naive_load(path)
    d = m.dims
    ref = naive_mixer(w, prefix, x.double(), heads=d.num_heads, head_dim=d.head_dim,
                      groups=d.n_groups, state=d.d_state, eps=d.norm_eps,
                      norm_groups=config["n_groups"])
    assert close(y, ref) <= 1e-5
