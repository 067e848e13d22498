"""The NCCL path on the one GPU a single-GPU machine has (issue 23's part that one H200
allows): a rank started torchrun-style (``RANK``/``WORLD_SIZE``/``MASTER_*`` in its
environment) joins an NCCL default group of one rank and a Gloo control group, serves with
CUDA graphs on, and gives the tokens of a plain single-process engine; NCCL's all-reduce,
all-gather and broadcast on CUDA tensors run in that group. Several ranks on NCCL need a
machine of several GPUs (never lent so far). NVLink multicast stays off in every process
(``NCCL_NVLS_ENABLE=0`` and the two other variables the device notes name)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from dllm import LLM, SamplingParams
from dllm.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}

RANK_SCRIPT = r"""
import json, sys
import torch
import torch.distributed as dist
from dllm import LLM, SamplingParams

path, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(path, device="cuda", dtype="bfloat16", max_running_requests=8,
          algorithm="low_confidence_static")
assert dist.is_initialized() and dist.get_backend() == "nccl" and dist.get_world_size() == 1
graphs = llm.engine.runner.runners[0] is not llm.engine.runner.eager
params = SamplingParams(max_new_tokens=16, ignore_eos=True)
tokens = [o.token_ids for o in llm.generate(prompts, params)]
x = torch.arange(6, device="cuda", dtype=torch.float32)
dist.all_reduce(x)
parts = [torch.empty_like(x)]
dist.all_gather(parts, x)
dist.broadcast(x, src=0)
torch.cuda.synchronize()
print(json.dumps({"tokens": tokens, "graphs": graphs, "nccl": torch.cuda.nccl.version(),
                  "all_reduce": x.tolist(), "all_gather": parts[0].tolist()}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_single_rank_nccl_group_serves_like_one_process(tmp_path):
    path = str(make_tiny_checkpoint("SDARForCausalLM", tmp_path / "sdar", seed=0,
                                    hidden_size=256, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=128))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 200, (1 + 3 * i,), generator=g).tolist() for i in range(5)]
    env = {**os.environ, **NO_MULTICAST, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.run([sys.executable, "-c", RANK_SCRIPT, path, json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["graphs"]
    assert got["all_reduce"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] == got["all_gather"]
    plain = LLM(path, device="cuda", dtype="bfloat16", max_running_requests=8,
                algorithm="low_confidence_static")
    want = [o.token_ids for o in plain.generate(
        prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))]
    assert got["tokens"] == want
