"""The built-in model (``dllm/builtin_model/``): it loads with no arguments and answers, the
task generator it was trained on is deterministic, and its training script runs."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dllm import LLM, SamplingParams, tasks
from dllm.checkpoint import BUILTIN_MODEL_DIR
from dllm.models.loader import load_model
from dllm.server.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
FIXED = [
    ("What is 17+25?", "42"),
    ("What is 348 + 127?", "475"),
    ("Compute 90 - 58.", "32"),
    ("Which is larger, 482 or 428?", "482"),
    ("Reverse the word: planet", "tenalp"),
    ("Sort these words: pear, apple, fig", "apple, fig, pear"),
    ("How many letters are in 'banana'?", "6"),
]


def load_train_script():
    spec = importlib.util.spec_from_file_location("train_builtin",
                                                  ROOT / "scripts" / "train_builtin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def builtin() -> LLM:
    return LLM()  # no model: the built-in one


def test_builtin_model_answers(builtin):
    outs = builtin.chat([[{"role": "user", "content": q}] for q, _ in FIXED],
                        SamplingParams(max_new_tokens=32))
    assert [o.text.strip() for o in outs] == [a for _, a in FIXED]
    assert all(o.finish_reason == "stop" for o in outs)
    # The checkpoint's default (threshold 0.9) decodes several tokens per denoise forward.
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens / sum(o.num_denoise_forwards for o in outs) >= 2.0


def test_builtin_model_one_token_per_step(builtin):
    params = SamplingParams(max_new_tokens=32, dllm={
        "algorithm": "low_confidence_static", "steps_per_block": builtin.engine.block_size})
    outs = builtin.chat([[{"role": "user", "content": q}] for q, _ in FIXED[:4]], params)
    assert [o.text.strip() for o in outs] == [a for _, a in FIXED[:4]]


def test_chat_command_uses_builtin_model(capsys):
    assert cli_main(["chat", "What is 17+25?"]) == 0
    assert capsys.readouterr().out.strip() == "42"


def test_chat_stats_line_reports_the_answer(builtin, capsys):
    """``dllm chat --stats``: one line on stderr whose counts are the answer's own."""
    assert cli_main(["chat", "--stats", "Sort these words: pear, apple, fig"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "apple, fig, pear"
    m = re.fullmatch(r"\[(\d+) prompt \+ (\d+) output tokens, (\d+) forwards \((\d+) denoise, "
                     r"(\d+) blocks\), ([\d.]+) tokens/forward, ([\d.]+) s, ([\d.]+) tokens/s\]",
                     captured.err.strip())
    assert m, captured.err
    builtin.engine.clear_prefix_cache()  # the command's engine was fresh: no cached blocks
    out = builtin.chat([{"role": "user", "content": "Sort these words: pear, apple, fig"}],
                       SamplingParams(max_new_tokens=128, temperature=0.0))[0]
    counts = [int(m.group(i)) for i in range(1, 6)]
    assert counts == [out.prompt_tokens, out.completion_tokens, out.num_forward_passes,
                      out.num_denoise_forwards, out.num_blocks]
    assert float(m.group(6)) == round(out.completion_tokens / out.num_denoise_forwards, 2)


def test_builtin_checkpoint_files():
    d = BUILTIN_MODEL_DIR
    assert (d / "model.safetensors").stat().st_size <= 16 * 2**20
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["SDARForCausalLM"]
    assert config["block_size"] in (4, 8)
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["dllm"] == {"algorithm": "threshold", "threshold": 0.9}
    tok = AutoTokenizer.from_pretrained(str(d))
    assert tok.eos_token == "<|im_end|>" and gen["eos_token_id"][0] == tok.eos_token_id
    assert tok.mask_token_id == config["mask_token_id"]
    # Digits and letters are single tokens.
    assert len(tok.encode("348+127 banana", add_special_tokens=False)) == 14


def test_chat_template_matches_training_format():
    train = load_train_script()
    tok = AutoTokenizer.from_pretrained(str(BUILTIN_MODEL_DIR))
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "Reverse the word: cat"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == train.render_chat(messages, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_task_generator_is_deterministic():
    for family in tasks.FAMILIES:
        a = tasks.generate(family, 50, seed=7)
        assert a == tasks.generate(family, 50, seed=7)
        assert len(a) == 50 and all(isinstance(q, str) and isinstance(x, str) for q, x in a)
    assert tasks.generate("add", 50, 7) != tasks.generate("add", 50, 8)
    # Pinned values: the generator must not drift, or the eval would change under the model.
    assert tasks.generate("add", 3, 0) == [
        ("Hmm, Can you compute 87 added to 592", "679"),
        ("Compute 132 plus 53 together!", "185"),
        ("What is the total when you add the numbers 44 and 933?", "977")]
    assert tasks.generate("sort", 1, 0) == [
        ("excuse me, can you organize (Cake, grey, pump) in alphabetic order?",
         "Cake, grey, pump")]
    assert tasks.generate("sort", 2, 3, held_out=True)[0] == (
        "In alphabetical order, town, Mask, Wall, Hair are", "Hair, Mask, town, Wall")
    with pytest.raises(ValueError, match="unknown task family"):
        tasks.generate("poetry", 1, 0)


HELD_OUT_GROUPS = {
    "add": ("ADD",), "sub": ("SUB",), "compare": ("LARGER", "SMALLER"), "reverse": ("REVERSE",),
    "sort": ("SORT",), "count": ("LENGTH", "OCCURRENCE")}


# Words the templates themselves use ("list", "order"): never taken for a value.
TEMPLATE_WORDS = {w for name in dir(tasks) if name.endswith(("_PHRASES", "_HELD_OUT"))
                  for t in getattr(tasks, name) for w in re.findall(r"[a-z]+", t.lower())}


def _value_free(text: str, family: str, template_words: bool = False) -> str:
    """A question or template with its values replaced by kinds: numbers N, task words W (a
    list of them one W; word families only; not the words templates use unless
    ``template_words``), single letters C (and their plurals); then ``tasks.skeleton``. A
    different path from the generator's own check, which compares templates before their
    values go in."""
    vocab = set(tasks.WORDS) if template_words else set(tasks.WORDS) - TEMPLATE_WORDS
    words = "|".join(sorted(vocab, key=len, reverse=True))
    text = re.sub(r"\d+", " nn ", text.lower())
    if family in ("reverse", "sort", "count"):
        text = re.sub(rf"\b({words})\b", " ww ", text)
    text = re.sub(r"\b[a-z]('?s)?\b", " cc ", text)
    text = re.sub(r"ww(\W+ww)+", "ww", text)
    return tasks.skeleton(text)


def test_held_out_templates_are_never_training_questions():
    values = {"a": 111, "b": 222, "op": "+", "w": "zebra", "ws": "cat, dog, fig", "c": "z"}
    for family, groups in HELD_OUT_GROUPS.items():
        held = {_value_free(t.format(**values), family) for g in groups
                for t in getattr(tasks, f"{g}_HELD_OUT")}
        train = {_value_free(q, family) for q, _ in tasks.generate(family, 3000, 1)}
        assert len(train) > 150, family  # the composed phrasings are many
        assert not held & train, (family, sorted(held & train)[:5])
        # ...and the held-out stream draws its questions from those templates alone
        held = {_value_free(t.format(**values), family, True) for g in groups
                for t in getattr(tasks, f"{g}_HELD_OUT")}
        got = {_value_free(q, family, True)
               for q, _ in tasks.generate(family, 500, 1, held_out=True)}
        assert got <= held, family


def test_natural_templates_split_by_the_training_phrasings():
    """The independently written phrasings: a template whose skeleton is a training phrasing's
    counts as trained (the first set against the grammar written before it was seen, the second
    against the whole grammar); every other one is held out; none is lost."""
    for groups in HELD_OUT_GROUPS.values():
        for g in groups:
            held = getattr(tasks, f"{g}_HELD_OUT")
            assert set(held) >= set(getattr(tasks, f"{g}_DESIGNED"))
            assert set(getattr(tasks, f"_{g}_FIRST")) < set(getattr(tasks, f"{g}_PHRASES"))
            first = {tasks.skeleton(t) for t in getattr(tasks, f"_{g}_FIRST")}
            assert len(getattr(tasks, f"{g}_NATURAL")) >= 12
            for t in getattr(tasks, f"{g}_NATURAL"):
                assert (t in held) != (tasks.skeleton(t) in first), t
            # Training produces the grammar's phrasings less the held-out ones.
            held_skeletons = {tasks.skeleton(t) for t in held}
            trained = {tasks.skeleton(t) for t in getattr(tasks, f"{g}_PHRASES")}
            trained -= held_skeletons
            assert len(getattr(tasks, f"{g}_NATURAL2")) == 30
            for t in getattr(tasks, f"{g}_NATURAL2"):
                assert (tasks.skeleton(t) in held_skeletons) != (tasks.skeleton(t) in trained), t


def _minuend_first(q: str) -> bool:
    """Whether the first number in a subtraction question is the one subtracted from."""
    low = q.lower()
    m = re.search(r"(?:from|out of|off)\D*?(\d+)", low) or re.search(r"less than\D*?(\d+)", low)
    return m is None or m.start(1) == re.search(r"\d+", low).start()


@pytest.mark.parametrize("held_out", [False, True])
def test_task_answers_are_correct(held_out):
    generate = functools.partial(tasks.generate, held_out=held_out)
    for q, a in generate("add", 300, 1):
        x, y = map(int, re.findall(r"\d+", q))
        assert a == str(x + y), q
    for q, a in generate("sub", 300, 1):
        x, y = map(int, re.findall(r"\d+", q))
        assert a == str(x - y if _minuend_first(q) else y - x), q
    for q, a in generate("compare", 300, 1):
        x, y = map(int, re.findall(r"\d+", q))
        larger = any(w in q.lower() for w in ("larg", "bigg", "great", "more", "max", "high"))
        assert a == str(max(x, y) if larger else min(x, y)), q
    for q, a in generate("reverse", 200, 1):
        assert a[::-1] in q
    for q, a in generate("sort", 200, 1):
        words = a.split(", ")
        assert words == sorted(words, key=str.lower) and 3 <= len(words) <= 5
        assert all(w in q for w in words)
    for q, a in generate("count", 200, 1):
        words = [w for w in re.findall(r"[a-z]+", q.lower()) if w in tasks.WORDS]
        letters = set(re.findall(r"\b([a-z])(?:'?s)?\b", q.lower()))  # the letter asked
        counts = {str(len(w)) for w in words}
        counts |= {str(w.count(c)) for w in words for c in letters}
        assert a in counts, q


def test_training_script_tiny_run_writes_loadable_checkpoint(tmp_path):
    train = load_train_script()
    out = tmp_path / "ckpt"
    summary = train.main([
        "--out", str(out), "--hidden-size", "32", "--layers", "1", "--heads", "2",
        "--intermediate-size", "64", "--steps", "3", "--warmup", "2",
        "--train-examples", "400", "--batch-tokens", "512", "--workers", "1",
        "--eval-per-family", "1", "--seed", "3",
    ])
    assert summary["steps"] == 3 and summary["final_loss"] > 0
    assert set(summary["metrics"]) == {"one_token_per_step", "threshold_0.9",
                                       "held_out_one_token_per_step", "held_out_threshold_0.9"}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        assert (out / name).is_file(), name
    model, spec, config = load_model(out)
    assert spec.name == "SDARForCausalLM" and config["block_size"] == 8
    assert "model.layers.0.self_attn.q_norm.weight" in dict(model.named_parameters())
    llm = LLM(str(out), max_running_requests=2)
    got = llm.chat([{"role": "user", "content": "What is 1+1?"}],
                   SamplingParams(max_new_tokens=8))[0]
    assert got.error is None and len(got.token_ids) >= 1


def test_hybrid_training_tiny_run_writes_loadable_checkpoint(tmp_path):
    """``--hybrid``: a Granite-H layout (Mamba2, attention) trained with the same objective,
    exported under GraniteMoeHybrid's tensor names as a GraniteMoeHybridForBlockDiffusion
    checkpoint that the engine serves by block diffusion."""
    import torch

    train = load_train_script()
    out = tmp_path / "hybrid"
    summary = train.main([
        "--hybrid", "--out", str(out), "--hidden-size", "32", "--layers", "2", "--heads", "2",
        "--attention-every", "2", "--mamba-head-dim", "16", "--mamba-d-state", "8",
        "--intermediate-size", "64", "--steps", "3", "--warmup", "2",
        "--train-examples", "400", "--batch-tokens", "512", "--workers", "1",
        "--eval-per-family", "1", "--seed", "3",
    ])
    assert summary["steps"] == 3 and summary["final_loss"] > 0
    model, spec, config = load_model(out)
    assert spec.name == "GraniteMoeHybridForBlockDiffusion" and spec.recurrent_state
    assert config["layer_types"] == ["mamba", "attention"] and config["block_size"] == 8
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.1.self_attn.q_proj.weight", "model.layers.0.mamba.A_log",
            "model.layers.0.shared_mlp.input_linear.weight"} <= names
    llm = LLM(str(out), max_running_requests=2)
    assert llm.engine.runner.state_pool is not None
    got = llm.chat([{"role": "user", "content": "What is 1+1?"}],
                   SamplingParams(max_new_tokens=8))[0]
    assert got.error is None and len(got.token_ids) >= 1
    llm.engine.check_memory()
    # The training forward's Mamba2 layers equal the engine's mixer: the clean copy over the
    # whole sequence, every noised block from the clean state (and conv window) at its start.
    m = model.model.layers[0].mamba
    g = torch.Generator().manual_seed(0)
    clean, noised = torch.randn(2, 2, 24, 32, generator=g)
    got_noised, got_clean = train.mamba_two_copies(m, noised, clean, 8)
    for row in range(2):
        want_clean, _, _ = m(clean[row], *m.zero_states(1), [24])
        assert torch.allclose(got_clean[row], want_clean, atol=1e-5)
        for start in (0, 8, 16):
            conv, ssm = m.zero_states(1)
            if start:
                _, conv, ssm = m(clean[row, :start], conv, ssm, [start])
            want_block, _, _ = m(noised[row, start:start + 8], conv, ssm, [8])
            assert torch.allclose(got_noised[row, start:start + 8], want_block, atol=1e-5)


def test_builtin_names_select_the_packaged_models(tmp_path, monkeypatch):
    from dllm.checkpoint import BUILTIN_HYBRID_DIR, BUILTIN_MODEL_DIR, resolve_model_path

    assert resolve_model_path("builtin") == resolve_model_path(None) == str(BUILTIN_MODEL_DIR)
    monkeypatch.chdir(tmp_path)  # a directory of that name is a checkpoint path, not the alias
    (tmp_path / "builtin").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path("builtin")

    if (BUILTIN_HYBRID_DIR / "config.json").is_file():
        assert resolve_model_path("builtin-hybrid") == str(BUILTIN_HYBRID_DIR)
    else:
        with pytest.raises(ValueError, match="built-in hybrid model is not packaged"):
            LLM("builtin-hybrid")


def test_eval_reports_train_and_held_out_phrasings(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "--per-family", "2", "--thresholds", "0.9", "--families",
                     "add,reverse", "--no-progress", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "train phrasings:" in printed and "held-out phrasings:" in printed
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"train", "held-out"}
    for rows in report["results"].values():
        assert [r["name"] for r in rows] == ["threshold τ=0.9",
                                             "low_confidence_static, 1 token/step"]
        for r in rows:
            assert set(r["accuracy"]) == {"add", "reverse", "overall"}
            assert r["tokens"] > 0 and r["denoise_forwards"] > 0
    assert cli_main(["eval", "--phrasings", "novel", "--per-family", "1"]) == 2
    assert "--phrasings 'novel': give some of train, held-out" in capsys.readouterr().err


@pytest.mark.parametrize("hybrid", [False, True])
def test_init_from_continues_a_checkpoint(tmp_path, hybrid):
    """``--init-from``: the second run starts from the first run's weights (the loader maps
    the exported names back, the hybrid's Granite names included): at learning rate 0 it
    writes the same tensors; its summary holds the first run's; the wrong kind is refused."""
    import torch
    from safetensors.torch import load_file

    train = load_train_script()
    size = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--intermediate-size", "64"]
    if hybrid:
        size += ["--hybrid", "--attention-every", "2", "--mamba-head-dim", "16",
                 "--mamba-d-state", "8"]
    common = ["--train-examples", "400", "--batch-tokens", "512", "--workers", "1",
              "--eval-per-family", "0", "--seed", "3"]
    first, second = tmp_path / "first", tmp_path / "second"
    train.main(["--out", str(first), *size, "--steps", "3", "--warmup", "2", *common])
    summary = train.main(["--out", str(second), *(["--hybrid"] if hybrid else []),
                          "--init-from", str(first), "--steps", "1", "--warmup", "1",
                          "--lr", "0", *common])
    assert summary["initialised_from"]["steps"] == 3
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SystemExit, match="--hybrid"):
        train.main(["--out", str(tmp_path / "third"), *([] if hybrid else ["--hybrid"]),
                    "--init-from", str(first), "--steps", "1", *common])
