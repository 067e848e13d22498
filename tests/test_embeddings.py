"""Pooled embeddings equal a transformers forward with the same pooling."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from dllm import LLM
from dllm.testing import make_tiny_checkpoint

POOLING_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
                "last": "pooling_mode_lasttoken"}
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("emb"), seed=2)
    hf = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    return path, hf, AutoTokenizer.from_pretrained(path)


def sentence_transformers_layout(src, dst, pooling: str, normalize: bool) -> str:
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    cfg = {"word_embedding_dimension": 64, **{k: False for k in POOLING_KEYS.values()}}
    cfg[POOLING_KEYS[pooling]] = True
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def reference(hf, tok, text: str, pooling: str, normalize: bool, dims: int | None):
    ids = tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0]
    v = {"cls": h[0], "mean": h.mean(0), "last": h[-1]}[pooling]
    if dims:
        v = v[:dims]
    return F.normalize(v, dim=0) if normalize else v


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [False, True])
def test_embeddings_equal_transformers(base, tmp_path, pooling, normalize):
    path, hf, tok = base
    st = sentence_transformers_layout(path, tmp_path / "st", pooling, normalize)
    llm = LLM(st, max_prefill_tokens=4)  # a budget of 4 tokens: prompts span several chunks
    assert llm.engine.task == "embed"
    for dims in (None, 16):
        outs = llm.embed(TEXTS, dimensions=dims)
        for text, out in zip(TEXTS, outs, strict=True):
            want = reference(hf, tok, text, pooling, normalize, dims)
            got = torch.tensor(out.embedding)
            assert got.shape == want.shape
            assert F.cosine_similarity(got, want, dim=0) > 0.9999
            assert torch.allclose(got, want, atol=1e-4)
            if normalize:
                assert abs(got.norm().item() - 1) < 1e-5
    llm.engine.check_memory()


def test_task_embed_flag_and_normalize_override(base):
    path, hf, tok = base
    llm = LLM(str(path), task="embed")
    out = llm.embed("hello world", normalize=True, dimensions=8)[0]
    want = reference(hf, tok, "hello world", "last", True, 8)  # LAST is the Qwen3 default
    assert torch.allclose(torch.tensor(out.embedding), want, atol=1e-5)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("hello", dimensions=0)
    gen = LLM(str(path))
    with pytest.raises(ValueError, match="task='embed'"):
        gen.embed("hello")


def test_an_input_of_exactly_the_context_length_is_embedded(base, tmp_path):
    path, hf, tok = base
    llm = LLM(str(path), task="embed", context_length=24, max_prefill_tokens=8)
    ids = list(range(5, 29))  # 24 tokens: the whole context, nothing reserved for output
    out = llm.embed(ids)[0]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).last_hidden_state[0, -1]
    assert torch.allclose(torch.tensor(out.embedding), want, atol=1e-4)
    with pytest.raises(ValueError, match="exceeds the context length"):
        llm.embed(ids + [5])
    llm.engine.check_memory()
