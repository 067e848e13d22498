"""The engine flags generated from ``EngineConfig`` (``dllm.cli_args``): every subcommand
has each flag with the spelling, default, conversion and choices it had when the flags were
written out by hand, and the defaults give ``EngineConfig()``."""

from __future__ import annotations

import argparse

import pytest

from dllm.cli_args import engine_config_from_args
from dllm.config import EngineConfig
from dllm.server.cli import build_parser

DTYPES = ["auto", "bf16", "bfloat16", "float", "float16", "float32", "fp16", "fp32", "half"]
# flag: (dest, default, type, choices, nargs, const) -- the hand-written parser's, exactly
ENGINE_FLAGS = {
    "--model": ("model", None, None, None, None, None),
    "--tokenizer": ("tokenizer", None, None, None, None, None),
    "--algorithm": ("algorithm", None, None, None, None, None),
    "--algorithm-config": ("algorithm_config", {}, "json_object", None, None, None),
    "--block-size": ("block_size", None, "int", None, None, None),
    "--mask-token-id": ("mask_token_id", None, "int", None, None, None),
    "--max-running-requests": ("max_running_requests", 64, "int", None, None, None),
    "--page-size": ("page_size", 16, "int", None, None, None),
    "--num-kv-pages": ("num_kv_pages", None, "int", None, None, None),
    "--kv-cache-memory-gb": ("kv_cache_memory_gb", None, "float", None, None, None),
    "--max-prefill-tokens": ("max_prefill_tokens", 4096, "int", None, None, None),
    "--context-length": ("context_length", None, "int", None, None, None),
    "--dtype": ("dtype", "auto", None, DTYPES, None, None),
    "--device": ("device", "auto", None, None, None, None),
    "--attention-backend": ("attention_backend", "auto", None, ["auto", "sdpa", "flashinfer"],
                            None, None),
    "--seed": ("seed", 0, "int", None, None, None),
    "--served-model-name": ("served_model_name", None, "str", None, "+", None),
    "--chat-template": ("chat_template", None, None, None, None, None),
    "--trust-remote-code": ("trust_remote_code", False, None, None, 0, True),
    "--task": ("task", "auto", None, ["auto", "generate", "embed"], None, None),
    "--load-format": ("load_format", "safetensors", None, ["safetensors", "dummy"], None, None),
    "--disable-cuda-graph": ("disable_cuda_graph", False, None, None, 0, True),
    "--cuda-graph-max-bs": ("cuda_graph_max_bs", None, "int", None, None, None),
    "--cuda-graph-bs": ("cuda_graph_batch_sizes", None, "int", None, "+", None),
    "--disable-overlap-schedule": ("overlap_schedule", None, None, None, 0, False),
    "--disable-merged-commit": ("merged_commit", None, None, None, 0, False),
    "--tensor-parallel-size": ("tensor_parallel_size", 1, "int", None, None, None),
    "--expert-parallel-size": ("expert_parallel_size", 1, "int", None, None, None),
    "--data-parallel-size": ("data_parallel_size", 1, "int", None, None, None),
    "--context-parallel-size": ("context_parallel_size", 1, "int", None, None, None),
    "--nnodes": ("nnodes", 1, "int", None, None, None),
    "--node-rank": ("node_rank", 0, "int", None, None, None),
    "--dist-init-addr": ("dist_init_addr", None, None, None, None, None),
    "--disable-prefix-cache": ("enable_prefix_cache", True, None, None, 0, False),
    "--state-track-interval": ("state_track_interval", 256, "int", None, None, None),
}
# Other spellings users bring from vLLM and SGLang.
ENGINE_ALIASES = {"--context-length": ["--max-model-len"],
                  "--tensor-parallel-size": ["--tp", "--tp-size"],
                  "--expert-parallel-size": ["--ep", "--ep-size"],
                  "--data-parallel-size": ["--dp", "--dp-size"],
                  "--context-parallel-size": ["--cp", "--cp-size"]}
COMMANDS = ("generate", "serve", "chat", "eval")


def subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_engine_flags_keep_their_spelling_default_and_conversion(command):
    group = next(g for g in subparser(command)._action_groups if g.title == "engine")
    flags, aliases = {}, {}
    for a in group._group_actions:
        flag, *others = a.option_strings
        flags[flag] = (a.dest, a.default, getattr(a.type, "__name__", None),
                       None if a.choices is None else list(a.choices), a.nargs, a.const)
        if others:
            aliases[flag] = others
    assert flags == ENGINE_FLAGS
    assert aliases == ENGINE_ALIASES
    assert all(a.help for a in group._group_actions)


@pytest.mark.parametrize("command", COMMANDS)
def test_the_defaults_are_the_config_defaults(command):
    args = build_parser().parse_args([command])
    assert engine_config_from_args(args) == EngineConfig()


def test_flags_convert_to_config_values():
    args = build_parser().parse_args([
        "serve", "--algorithm-config", '{"threshold": 0.9}', "--cuda-graph-bs", "4", "1", "2",
        "--disable-overlap-schedule", "--disable-cuda-graph", "--dtype", "bf16",
        "--kv-cache-memory-gb", "1.5", "--max-running-requests", "8", "--model", "/m"])
    cfg = engine_config_from_args(args)
    assert (cfg.algorithm_config, cfg.cuda_graph_batch_sizes, cfg.overlap_schedule,
            cfg.disable_cuda_graph, cfg.dtype, cfg.kv_cache_memory_gb,
            cfg.max_running_requests, cfg.model) == (
        {"threshold": 0.9}, (1, 2, 4), False, True, "bf16", 1.5, 8, "/m")


@pytest.mark.parametrize("argv", [["--dtype", "float64"], ["--task", "score"],
                                  ["--algorithm-config", "{threshold}"],
                                  ["--page-size", "big"]])
def test_a_bad_flag_value_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["chat", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}: " in err and len(err.strip().splitlines()) == 1
    if argv[0] == "--algorithm-config":
        assert "is not JSON" in err and """'{"threshold": 0.9}'""" in err
    else:
        assert f"argument {argv[0]}: invalid" in err
