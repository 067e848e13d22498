"""The released checkpoints' own files (``tests/data/configs``, provenance in ``SOURCES.md``):
the factory copies them key for key (only sizes and special-token ids differ), each released
``config.json`` loads with random weights once shrunk, each released chat template renders, and
every family ends a generation at the token that closes its assistant turn."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from dllm import LLM, SamplingParams
from dllm.testing import make_tiny_checkpoint
from dllm.testing.families import RELEASES
from dllm.tokenizer import load_tokenizer

DATA = Path(__file__).parent / "data" / "configs"
RELEASED = sorted(a for a, r in RELEASES.items() if r.data_dir)

# Keys whose values are sizes (the tiny checkpoints shrink them) or the weights' dtype.
SIZE_KEYS = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_window_layers", "d_model", "n_heads",
    "n_kv_heads", "n_layers", "mlp_hidden_size", "embedding_size", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "rotary_dim", "n_group", "topk_group",
    "layer_types", "torch_dtype",
})
ID_KEYS = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id"})
# LLaDA2.0-mini-preview's tokenizer_config has no added_tokens_decoder; its tokenizer.json's
# added tokens (SOURCES.md 5a).
LLADA2_IDS = {156891: "<|startoftext|>", 156892: "<|endoftext|>", 156893: "[CLS]",
              156894: "[gMASK]", 156895: "<|mask|>", 156896: "<tool_call>",
              156897: "</tool_call>", 156898: "<tool_response>", 156899: "</tool_response>",
              156900: "<|role_end|>"}
# The released chat templates rendered on [system, user] with a generation prompt.
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  hi  "}]
RENDERED = {
    "LLaDAModelLM": "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "LLaDA2MoeModelLM": "<role>SYSTEM</role>Be brief.\ndetailed thinking off<|role_end|>"
                        "<role>HUMAN</role>  hi  <|role_end|><role>ASSISTANT</role>",
    "SDARForCausalLM": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n  hi  "
                       "<|im_end|>\n<|im_start|>assistant\n",
    "DreamModel": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n  hi  "
                  "<|im_end|>\n<|im_start|>assistant\n",
    "Fast_dLLM_QwenForCausalLM": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                 "  hi  <|im_end|>\n<|im_start|>assistant\n",
}
TURN_END = {"LLaDAModelLM": "<|eot_id|>", "LLaDA2MoeModelLM": "<|role_end|>",
            "SDARForCausalLM": "<|im_end|>", "DreamModel": "<|im_end|>",
            "Fast_dLLM_QwenForCausalLM": "<|im_end|>", "LLaDAMoEModelLM": "<|role_end|>",
            "SDARMoeForCausalLM": "<|im_end|>"}


def _json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _released(arch: str, name: str) -> Any:
    return _json(DATA / RELEASES[arch].data_dir / name)


def _released_id_names(arch: str) -> dict[int, str]:
    tok = _released(arch, "tokenizer_config.json")
    if "added_tokens_decoder" not in tok:
        assert arch == "LLaDA2MoeModelLM"
        return LLADA2_IDS
    return {int(k): v["content"] for k, v in tok["added_tokens_decoder"].items()}


def _as_names(value: Any, names: dict[int, str]) -> Any:
    if isinstance(value, list):
        return [_as_names(v, names) for v in value]
    return names[value] if isinstance(value, int) and not isinstance(value, bool) else value


def _check_same(released: dict, tiny: dict, released_names: dict[int, str],
                tiny_names: dict[int, str]) -> None:
    assert set(tiny) == set(released), (
        f"keys differ: only released {sorted(set(released) - set(tiny))}, "
        f"only tiny {sorted(set(tiny) - set(released))}")
    for key, value in released.items():
        if key in SIZE_KEYS:
            continue
        if key in ID_KEYS and value is not None:
            assert _as_names(tiny[key], tiny_names) == _as_names(value, released_names), key
        else:
            assert tiny[key] == value, key


@pytest.fixture(scope="module", params=RELEASED)
def tiny(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))


def _tiny_names(path: Path) -> dict[int, str]:
    tok = _json(path / "tokenizer_config.json")
    return {int(k): v["content"] for k, v in tok["added_tokens_decoder"].items()}


def test_config_copies_the_release(tiny) -> None:
    arch, path = tiny
    _check_same(_released(arch, "config.json"), _json(path / "config.json"),
                _released_id_names(arch), _tiny_names(path))


def test_generation_config_copies_the_release(tiny) -> None:
    arch, path = tiny
    _check_same(_released(arch, "generation_config.json"),
                _json(path / "generation_config.json"), _released_id_names(arch),
                _tiny_names(path))


def test_tokenizer_files_copy_the_release(tiny) -> None:
    arch, path = tiny
    released = _released(arch, "tokenizer_config.json")
    mine = _json(path / "tokenizer_config.json")
    released_added = released.pop("added_tokens_decoder", None)
    added = mine.pop("added_tokens_decoder")
    assert mine == released
    names = {v["content"]: v["special"] for v in added.values()}
    if released_added is None:
        assert set(names) == set(LLADA2_IDS.values())
    else:
        want = {v["content"]: v["special"] for v in released_added.values()
                if not v["content"].startswith("<|reserved_token_")}
        assert names == want
    if (DATA / RELEASES[arch].data_dir / "special_tokens_map.json").exists():
        want_map = _released(arch, "special_tokens_map.json")
        if arch == "SDARForCausalLM":  # the release's map spells the mask "<MASK>" (families)
            want_map["additional_special_tokens"][-1] = "<|MASK|>"
        assert _json(path / "special_tokens_map.json") == want_map
    template = DATA / RELEASES[arch].data_dir / "chat_template.jinja"
    if template.exists():
        assert (path / "chat_template.jinja").read_text() == template.read_text()


def test_released_chat_template_renders(tiny) -> None:
    arch, path = tiny
    tok = load_tokenizer(str(path))
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == RENDERED[arch]
    released = _released(arch, "tokenizer_config.json").get("chat_template")
    if released is not None:
        assert tok.chat_template == released


def _shrunk_file(config_path: Path, tiny_path: Path, out: Path) -> Path:
    """A released ``config.json`` with the tiny checkpoint's sizes and special ids, beside the
    tiny checkpoint's tokenizer."""
    config = _json(config_path)
    tiny_config = _json(tiny_path / "config.json")
    for key in (SIZE_KEYS | ID_KEYS) & set(config):
        config[key] = tiny_config.get(key, config[key])
    out.mkdir()
    for f in tiny_path.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in DATA.glob("*/config.json")))
def test_every_kept_config_loads(folder: str, tmp_path: Path) -> None:
    """Every config.json kept here (the dFactory training variants and SDAR-8B too) loads with
    random weights once shrunk, and generates."""
    path = DATA / folder / "config.json"
    arch = _json(path)["architectures"][0]
    tiny_path = make_tiny_checkpoint(arch, tmp_path / "tiny")
    llm = LLM(str(_shrunk_file(path, tiny_path, tmp_path / "ckpt")), load_format="dummy",
              device="cpu", max_running_requests=2)
    out = llm.generate([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_released_config_loads_and_generates(tiny, tmp_path: Path) -> None:
    arch, path = tiny
    released = DATA / RELEASES[arch].data_dir / "config.json"
    llm = LLM(str(_shrunk_file(released, path, tmp_path / "ckpt")), load_format="dummy",
              device="cpu", max_running_requests=2)
    out = llm.chat([{"role": "user", "content": "hi"}],
                   SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


@pytest.mark.parametrize("arch", sorted(TURN_END))
def test_generation_ends_at_the_turn_end_token(arch: str, tmp_path: Path) -> None:
    path = make_tiny_checkpoint(arch, tmp_path)
    llm = LLM(str(path), device="cpu", max_running_requests=1)
    turn_end = llm.tokenizer.convert_tokens_to_ids(TURN_END[arch])
    eos = llm.tokenizer.convert_tokens_to_ids(llm.tokenizer.eos_token)
    assert {turn_end, eos} <= set(llm.engine.info.eos_token_ids)
