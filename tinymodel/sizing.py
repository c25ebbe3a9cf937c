"""Size the tiny MiMo-V2 checkpoint for this machine: a short probe, cached per machine.

The default checkpoint (24 layers x hidden 1024) gives a single-stream TPOT at
k=1 of 26 ms with 2 OMP threads (81 ms with 1) on an AVX-512/AMX machine but ~4x
that on a 2-core AVX2 VM, where every demo and test then runs 4x slower. `size_tiny_model` picks the depth (and,
if even the shallowest model is too slow, a narrower width) and the dtype so
that the TPOT of one stream at k=1 with perfect drafts, as configs/local-cpu.yaml
runs it (1 OMP thread, eager), lands near TARGET_TPOT_MS within BAND_MS, and
k=3 stays MIN_SPEEDUP_K3 times faster than k=1.

* dtype (`choose_dtype`): bfloat16 where the CPU has native bf16 (avx512_bf16 or
  amx_bf16; aarch64 bf16), else float32 (emulated bf16 was slower than float32
  on an AVX2-only EPYC: 100 vs 85 ms).
* The probe (`run_probe`, in one subprocess with 1 thread, a few seconds)
  times one decode step's worth of a layer at the chosen dtype - fused qkv, o,
  gate_up and down matrix products with 2 and 4 token rows (the verify steps of
  k=1 and k=3) plus the small ops around them - with vLLM's own CPU GEMM kernels
  (oneDNN, loaded from the vllm package without importing it) when vllm is
  installed, cycling through weights larger than the last-level cache; and the
  cost of one small Python-dispatched torch op (vLLM's per-step overhead scales
  with it). Times are CPU time divided by the share of a core a replica gets
  (`_timed`): MTP_CANARY_CPU_SHARE where set (work that outranks the replicas,
  which CPU time cannot see), else the cgroup's CPU quota.
* The model (`predict_lines`, constants in CALIBRATION, measured against real
  vLLM with benchmarks/tiny_checkpoint.py --fit):
  step_ms(k, L) = overhead_ops * op_ms + (layer_scale[k] * L + draft_layers * k) * layer_ms(k + 1),
  TPOT = step_ms / (k + 1) (perfect drafts: k + 1 tokens per step).
* `choose_layers` (pure) picks L from those two lines, at width 1024 or, when
  even 2 layers are too slow or k=3 is under 1.5x at every depth in band, 512
  then 256 (`search_sizes`); `size_tiny_model` caches
  the result in `<cache>/machine-probe/<key>-<request>.json`, key = CPU model,
  a hash of the CPU flags, the CPU quota of this process's cgroup (and the
  declared CPU share), torch's
  version and PROBE_VERSION with this file's source hash; request = an explicit
  width / dtype. A cached answer is reused as is (MTP_CANARY_REPROBE=1 probes
  again), so both arms of a run (and later runs) get the same size.

Accuracy: the host's speed here drifted up to ~1.6x within minutes (a shared
VM), and the probe's figures with it (+-20 % between runs); the model predicted
vLLM's k=1 TPOT within 10 % at 2-24 layers (e.g. 10 layers: 32.3 predicted,
35.3 ms measured). Under a CPU quota it is worse (see quota_overhead_factor).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from tinymodel.checkpoint import DEFAULT_CACHE, TinyCheckpointSpec

PROBE_VERSION = 1
TARGET_TPOT_MS = 25.0
BAND_MS = (15.0, 40.0)
MIN_SPEEDUP_K3 = 1.5
SPEEDUP_MARGIN = 0.1  # the choice asks the model for 1.6x: the probe's figures are +-20 % on a shared host
LAYER_RANGE = (2, 48)  # the sane depths: >= 2 (layer 0 global attention, then sliding), <= 2x the default
HIDDEN_CHOICES = (1024, 512, 256)  # widths tried in order (search_sizes: while the wider cannot do)
PROBE_TIMEOUT_S = 120.0
REPROBE_ENV = "MTP_CANARY_REPROBE"  # set to 1 to ignore the cached answer and probe again
# The share of one core each replica will get, where that is less than the CPU: work that outranks
# the replicas on every core (benchmarks/hogged.sh's CPU hogs; a busy shared host). The probe's CPU
# time cannot see it (other processes do not inflate a process's CPU time), a cgroup quota it
# reads itself. Default: the cgroup quota, capped at one core.
CPU_SHARE_ENV = "MTP_CANARY_CPU_SHARE"

# step_ms(k, L) = overhead_ops * op_ms + (layer_scale[k] * L + draft_layers * k) * layer_ms(k + 1)
# Fitted on the machine of issue 10 (Sapphire Rapids, 1 OMP thread, enforce_eager,
# vLLM 0.32 CPU, bf16) from vLLM TPOT at 2, 8 and 24 layers, k=1 and k=3
# (`benchmarks/tiny_checkpoint.py --speed-only --omp-threads 1 --layers 2 8 24 --fit`):
# step_ms k=1 = 18.3 + 6.03 L, k=3 = 32.2 + 5.71 L (residuals < 4 %), probe
# layer_ms(2) 4.78, layer_ms(4) 4.58 (memory-bound: 4 rows cost what 2 do), op_ms 0.00275.
CALIBRATION: dict[str, Any] = {
    "overhead_ops": 3940.0,  # per-step overhead (scheduler, sampler, API server...) in small-op times
    "draft_layers": 1.555,  # one MTP draft pass costs this many decoder layers
    "layer_scale": {1: 1.261, 3: 1.247},  # a vLLM decoder layer / the probe's layer (attention, rotary...)
    # Under a CPU quota below one CPU the server's processes share it, and vLLM's
    # busy-polling (shm_broadcast sched_yield()s for up to 1 s after each read)
    # burns quota a slow but unthrottled core would not charge: the fixed
    # overhead measured 2.1x (k=1) / 2.6x (k=3) what the probe predicted at 25 %
    # of a core (L=2, hidden 256: TPOT 74 / 48 ms). Applied when the quota is < 1. Not for a
    # declared share (MTP_CANARY_CPU_SHARE): beside CPU hogs that outrank them the replicas' processes
    # are not charged for the polling as under a quota. Measured (benchmarks/hogged.sh 10, share
    # 0.247, Xeon VM): 3 layers x 512 ran the demo at k=1 TPOT p50 15.3 ms, where the probe said 25
    # with the factor and 16 without it.
    "quota_overhead_factor": 2.3,
}

Progress = Callable[[str], None]
DType = Literal["bfloat16", "float32"]


# -- the CPU -------------------------------------------------------------------
def read_cpu_info(text: str | None = None) -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo text (x86 'flags', aarch64 'Features')."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            text = ""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return model or platform.processor() or platform.machine(), flags


def native_bf16(flags: Iterable[str]) -> bool:
    """The CPU computes in bf16 natively (x86: avx512_bf16 or amx_bf16; aarch64: bf16)."""
    flags = set(flags)
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def choose_dtype(flags: Iterable[str]) -> DType:
    """bfloat16 with native bf16, else float32 (bf16 emulated in AVX2 is slower than float32)."""
    return "bfloat16" if native_bf16(flags) else "float32"


def cgroup_cpu_limit() -> float | None:
    """CPUs this process's cgroup may use (quota / period), None when unlimited or unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        base = None
        if controllers == "":  # cgroup v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            try:
                quota, period = (base / "cpu.max").read_text().split()
                return None if quota == "max" else int(quota) / int(period)
            except (OSError, ValueError):
                continue
        if "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                base = Path("/sys/fs/cgroup") / mount / path.lstrip("/")
                try:
                    quota = int((base / "cpu.cfs_quota_us").read_text())
                    period = int((base / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                return None if quota <= 0 else quota / period
    return None


def declared_cpu_share(environ: dict[str, str] | None = None) -> float | None:
    """MTP_CANARY_CPU_SHARE (a float in (0, 1]), None when unset; a clear ValueError naming it otherwise."""
    raw = (os.environ if environ is None else environ).get(CPU_SHARE_ENV, "").strip()
    if not raw:
        return None
    try:
        share = float(raw)
    except ValueError:
        share = math.nan
    if not 0 < share <= 1:
        raise ValueError(f"{CPU_SHARE_ENV}={raw!r}: the share of one core each replica gets, a number in (0, 1]")
    return share


def replica_cpu_share(cpu_limit: float | None, declared: float | None) -> float:
    """The share of one core a replica's thread gets: the declared share, else the cgroup quota, capped at 1."""
    if declared is not None:
        return declared
    return min(1.0, cpu_limit) if cpu_limit else 1.0


def machine_key(
    model: str,
    flags: Iterable[str],
    cpu_limit: float | None = None,
    torch_version: str | None = None,
    cpu_share: float | None = None,
) -> str:
    """The probe cache's key: CPU model, flags hash, cgroup CPU limit, declared CPU share, torch version, probe code version."""
    if torch_version is None:
        torch_version = _torch_version()
    flags_hash = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    fields = {
        "cpu": model,
        "flags": flags_hash,
        "cpu_limit": None if cpu_limit is None else round(cpu_limit, 3),
        "torch": torch_version,
        "probe": probe_code_version(),
    }
    if cpu_share is not None:  # only when declared: the keys of machines without it stay as they were
        fields["cpu_share"] = round(cpu_share, 3)
    payload = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def probe_code_version() -> str:
    """PROBE_VERSION and this module's source hash: an edited probe or calibration re-probes."""
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return f"{PROBE_VERSION}-{source}"


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


# -- the probe -----------------------------------------------------------------
class ProbeFigures(BaseModel):
    """What one probe measured (per decoder layer, one thread, at `dtype`)."""

    dtype: str
    hidden_size: int
    intermediate_size: int
    working_set_layers: int = Field(..., description="layers cycled through (the candidate model's size)")
    layer_ms: dict[int, float] = Field(..., description="token rows -> ms for one layer's products and small ops")
    op_ms: float = Field(..., description="ms of one small Python-dispatched torch op")
    kernel: str = Field(..., description="vllm-onednn (the engine's CPU GEMMs) or torch")
    cpu_share: float = Field(
        1.0,
        description="CPU a thread may have (MTP_CANARY_CPU_SHARE, else the cgroup quota, capped at 1): times are CPU time / this",
    )
    cpu_share_seen: float = Field(1.0, description="CPU time / wall time the probe got (below cpu_share: a busy machine)")
    cpu_share_declared: bool = Field(
        False, description="cpu_share is MTP_CANARY_CPU_SHARE's, not a cgroup quota's (no quota_overhead_factor then)"
    )
    wall_s: float


def _load_vllm_kernels() -> str | None:
    """Load vLLM's CPU kernel library the way vLLM picks it, without importing vllm (seconds)."""
    import importlib.util

    import torch

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).parent
    if platform.machine() in ("x86_64", "AMD64"):
        if torch.cpu._is_avx512_supported():
            name = "_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so"
        else:
            name = "_C_AVX2.abi3.so"
    else:
        name = "_C.abi3.so"
    try:
        torch.ops.load_library(str(root / name))
    except (OSError, RuntimeError):
        return None
    return name if hasattr(torch.ops._C, "create_onednn_mm_handler") else None


def _timed(fns: dict[Any, Callable[[], Any]], block_s: float, blocks: int, share: float) -> tuple[dict[Any, float], float]:
    """({name: seconds per call}, CPU share seen): per name the least over `blocks` blocks of >= block_s CPU seconds.

    The blocks of the different names are interleaved, so a drift of the
    host's speed (seen here: 2x within minutes) moves them together and their
    ratios (2 vs 4 token rows) stay meaningful. Seconds per call = CPU seconds
    per call / `share`, the CPU share a thread of this process may have (its
    cgroup's quota, capped at 1). CPU time, not wall time: other processes
    competing for the cores (the machine is shared) do not inflate it, and a
    quota (cgroup cfs: 25 ms per 100 ms period, say) slows a long-running
    thread by exactly `share`, without the noise of where a short block falls
    within a period. The least block: interference (a neighbour's memory
    traffic) only ever adds. The CPU share seen (CPU / wall) is reported so a
    probe that ran on a busy machine can be told apart.
    """
    for fn in fns.values():
        fn()
    per_call: dict[Any, list[float]] = {name: [] for name in fns}
    seen = []
    for _ in range(blocks):
        for name, fn in fns.items():
            n, w0, c0 = 0, time.perf_counter(), time.process_time()
            while True:
                fn()
                n += 1
                cpu = time.process_time() - c0
                if cpu >= block_s:
                    break
            wall = time.perf_counter() - w0
            per_call[name].append(cpu / n / share)
            seen.append(cpu / wall)
    return {name: min(v) for name, v in per_call.items()}, sorted(seen)[len(seen) // 2]


def _linear(weight: Any, kernels: str | None) -> Callable[[Any], Any]:
    """x -> x @ weight.T as vLLM's CPU build runs it: its oneDNN kernel when loaded, else torch's."""
    import torch
    import torch.nn.functional as F

    n, _ = weight.shape
    if kernels is not None:
        try:
            handle = torch.tensor(torch.ops._C.create_onednn_mm_handler(weight.t(), 32), dtype=torch.int64)
        except RuntimeError:
            handle = None
        if handle is not None:

            def mm(x, _h=handle, _n=n):  # the handler holds its packed copy (vLLM drops the weight too)
                out = torch.empty((x.shape[0], _n), dtype=x.dtype)
                torch.ops._C.onednn_mm(out, x, None, _h)
                return out

            return mm
    return lambda x, _w=weight: F.linear(x, _w)


def run_probe(
    hidden_size: int,
    intermediate_size: int,
    dtype: str,
    working_set_layers: int,
    rows: tuple[int, ...] = (2, 4),
    block_s: float = 0.12,
    blocks: int = 3,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int = 64,
    use_vllm_kernels: bool = True,
) -> ProbeFigures:
    """Time one decoder layer's decode step in this process (call it with 1 thread; see probe_subprocess)."""
    import torch
    import torch.nn.functional as F

    t_start = time.perf_counter()
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    h, inter = hidden_size, intermediate_size
    heads = num_heads or h // head_dim
    kv_heads = num_kv_heads or math.gcd(heads, 4)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    shapes = {"qkv": (q_size + 2 * kv_size, h), "o": (h, q_size), "gate_up": (2 * inter, h), "down": (h, inter)}
    lib = _load_vllm_kernels() if use_vllm_kernels else None

    layers = []
    for _ in range(working_set_layers):
        layers.append({name: _linear(torch.full(shape, 0.01, dtype=torch_dtype), lib) for name, shape in shapes.items()})
    norm_w = torch.ones(h, dtype=torch_dtype)

    def rms(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * norm_w

    def step(x):
        # One decode step through every layer: the products a layer streams and
        # the small ops around them (norms, residual adds, SiLU-and-mul).
        for layer in layers:
            qkv = layer["qkv"](rms(x))
            attn = qkv[:, :q_size].contiguous()
            x = x + layer["o"](attn)
            gate_up = layer["gate_up"](rms(x))
            gate, up = gate_up.chunk(2, dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
        return x

    declared = declared_cpu_share()
    share = replica_cpu_share(cgroup_cpu_limit(), declared)
    xs = {m: torch.full((m, h), 0.01, dtype=torch_dtype) for m in rows}
    a, b = torch.ones(8, 64), torch.ones(8, 64)
    fns: dict[Any, Callable[[], Any]] = {m: (lambda x=x: step(x)) for m, x in xs.items()}
    fns["op"] = lambda: [torch.add(a, b) for _ in range(100)]
    times, cpu_share_seen = _timed(fns, block_s, blocks, share)
    layer_ms = {m: times[m] * 1000 / working_set_layers for m in rows}
    op_ms = times["op"] * 1000 / 100
    return ProbeFigures(
        dtype=dtype,
        hidden_size=h,
        intermediate_size=inter,
        working_set_layers=working_set_layers,
        layer_ms={m: round(v, 4) for m, v in layer_ms.items()},
        op_ms=round(op_ms, 6),
        kernel="vllm-onednn" if lib else "torch",
        cpu_share=round(share, 3),
        cpu_share_seen=round(cpu_share_seen, 3),
        cpu_share_declared=declared is not None,
        wall_s=round(time.perf_counter() - t_start, 2),
    )


def llc_bytes() -> int | None:
    """Size of the largest CPU cache level (sysfs), None when unknown."""
    best = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            size = int(text.rstrip("KMG")) * scale
        except ValueError:
            continue
        best = max(best or 0, size)
    return best


def working_set_layers(hidden_size: int, dtype: str, llc: int | None = None) -> int:
    """Layers the probe cycles through: >= 1.5x the last-level cache and >= 256 MiB (capped at 1 GiB, 2-48 layers).

    vLLM's TPOT was linear in the depth from 2 to 24 layers here (no cache
    bonus for small models: the host's L3 is shared), so the probe times
    weights streamed from memory, whatever depth it then picks.
    """
    spec = TinyCheckpointSpec.sized(1, hidden_size)
    itemsize = 2 if dtype == "bfloat16" else 4
    per_layer = spec.weight_bytes(itemsize) - 2 * spec.vocab_size * spec.hidden_size * itemsize
    floor = min(1 << 30, max(256 << 20, 3 * (llc if llc is not None else llc_bytes() or 0) // 2))
    return max(2, min(48, math.ceil(floor / per_layer)))


def probe_subprocess(widths: Iterable[int], dtype: str, timeout_s: float = PROBE_TIMEOUT_S) -> list[ProbeFigures]:
    """search_sizes(run_probe, ...) in a child process with one OMP thread (torch imported once there).

    A child: this process's thread count and memory stay untouched, and the
    probe runs with 1 thread as each replica does (configs/local-cpu.yaml).
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "tinymodel.sizing", "search", "--dtype", dtype, "--widths", *map(str, widths)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"tiny model probe failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return [ProbeFigures.model_validate(f) for f in json.loads(done.stdout.strip().splitlines()[-1])]


def probe_width(hidden_size: int, dtype: str) -> ProbeFigures:
    """run_probe at one width, heads and MLP as TinyCheckpointSpec.sized() makes them."""
    spec = TinyCheckpointSpec.sized(None, hidden_size)
    return run_probe(
        spec.hidden_size,
        spec.intermediate_size,
        dtype,
        working_set_layers(spec.hidden_size, dtype),
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
    )


# -- the model of vLLM's TPOT, and the choice ------------------------------------
class TpotLine(BaseModel):
    """Predicted single-stream TPOT of one k as a line in the depth: overhead_ms + layers * per_layer_ms."""

    overhead_ms: float
    per_layer_ms: float

    def at(self, layers: int) -> float:
        return self.overhead_ms + layers * self.per_layer_ms


def predict_lines(figures: ProbeFigures, calibration: dict[str, Any] | None = None) -> dict[int, TpotLine]:
    """TPOT lines of k=1 and k=3 from probe figures (perfect drafts: k + 1 tokens per step).

    step_ms(k, L) = overhead_ops * op_ms [* quota_overhead_factor under a cgroup quota < 1 CPU]
                    + (layer_scale[k] * L + draft_layers * k) * layer_ms(k + 1)
    where layer_ms(rows) is never taken below layer_ms(2) (more rows never cost less; the probe's noise can say so).
    """
    c = calibration or CALIBRATION
    base = figures.layer_ms.get(2) or min(figures.layer_ms.values())
    lines = {}
    for k, scale in c["layer_scale"].items():
        k = int(k)
        rows = k + 1
        layer_ms = figures.layer_ms.get(rows)
        if layer_ms is None:  # the nearest measured row count
            layer_ms = figures.layer_ms[min(figures.layer_ms, key=lambda m: abs(m - rows))]
        layer_ms = max(layer_ms, base)
        fixed = c["overhead_ops"] * figures.op_ms
        if figures.cpu_share < 1 and not figures.cpu_share_declared:
            fixed *= c.get("quota_overhead_factor", 1.0)
        lines[k] = TpotLine(
            overhead_ms=(fixed + c["draft_layers"] * k * layer_ms) / rows,
            per_layer_ms=scale * layer_ms / rows,
        )
    return lines


class LayerChoice(BaseModel):
    layers: int
    tpot_k1_ms: float
    tpot_k3_ms: float
    speedup_k3: float
    in_band: bool
    fast_enough: bool = Field(..., description="k=3 at least min_speedup times faster than k=1")
    verdict: Literal["ok", "thin_margin", "slow_speedup", "too_slow", "too_fast", "quota_depth"]


def choose_layers(
    k1: TpotLine,
    k3: TpotLine,
    target_ms: float = TARGET_TPOT_MS,
    band: tuple[float, float] = BAND_MS,
    layer_range: tuple[int, int] = LAYER_RANGE,
    min_speedup: float = MIN_SPEEDUP_K3 + SPEEDUP_MARGIN,
    floor_speedup: float = MIN_SPEEDUP_K3,
) -> LayerChoice:
    """The depth whose predicted k=1 TPOT is nearest target_ms, in band, with k=3 min_speedup faster.

    Preference: in band and k=3 min_speedup faster (nearest the target); else
    in band and floor_speedup faster ("thin_margin", nearest the target); else
    in band with the best k=3 speedup ("slow_speedup"); else the clamp: the shallowest depth
    when even that is above the band ("too_slow": try a narrower model), the
    deepest when even that is below it ("too_fast").
    """
    lo, hi = layer_range

    def row(n: int) -> LayerChoice:
        t1, t3 = k1.at(n), k3.at(n)
        speedup = t1 / t3 if t3 > 0 else math.inf
        in_band = band[0] <= t1 <= band[1]
        fast = speedup >= min_speedup
        return LayerChoice(
            layers=n,
            tpot_k1_ms=round(t1, 2),
            tpot_k3_ms=round(t3, 2),
            speedup_k3=round(speedup, 2),
            in_band=in_band,
            fast_enough=fast,
            verdict="ok" if in_band and fast else "slow_speedup",
        )

    rows = [row(n) for n in range(lo, hi + 1)]
    good = [r for r in rows if r.in_band and r.fast_enough]
    if good:
        return min(good, key=lambda r: (abs(r.tpot_k1_ms - target_ms), r.layers))
    in_band = [r for r in rows if r.in_band]
    thin = [r for r in in_band if r.speedup_k3 >= floor_speedup]
    if thin:  # fast enough without the margin: nearest the target
        best = min(thin, key=lambda r: (abs(r.tpot_k1_ms - target_ms), r.layers))
        return best.model_copy(update={"verdict": "thin_margin"})
    if in_band:
        return max(in_band, key=lambda r: (r.speedup_k3, -r.layers))
    if rows[0].tpot_k1_ms > band[1]:
        return rows[0].model_copy(update={"verdict": "too_slow"})
    return rows[-1].model_copy(update={"verdict": "too_fast"})


# How choose_size ranks the widths' choices (lower is better; a tie keeps the wider). In band with
# k=3 below MIN_SPEEDUP_K3 ("slow_speedup") ranks below a narrower width that is in band and fast
# enough: the floor is 1.5x. Seen with the replicas at a quarter of a core (benchmarks/hogged.sh,
# MTP_CANARY_CPU_SHARE=0.247, Xeon VM): at width 1024 only 2 layers are in band, where k=3 is predicted
# ~1.3x faster (the fixed per-step work outweighs the layers'); width 512 gave 8 layers at 1.69x
# predicted, and the demo measured TPOT p50 28.2 vs 18.7 ms (1.51x).
VERDICT_RANK = {"ok": 0, "thin_margin": 0, "quota_depth": 0, "slow_speedup": 1, "too_fast": 2, "too_slow": 3}
SEARCH_ON = frozenset({"too_slow", "slow_speedup"})  # verdicts that make search_sizes try the next narrower width

# Under a CPU quota the replicas, the router and Locust draw on one pool of CPU time: an arm
# that needs less CPU per token leaves its share to the other arm, so the measured k=1/k=3
# ratio is compressed toward 1, and more so the larger the fixed per-step work is against the
# layers'. Measured on a 2-core EPYC at a quota of 0.5 CPU (benchmarks/slowed.sh 0.5, the demo's
# 2 streams per replica, 16 tokens): 3 layers (the band's choice there) TPOT 51 vs 45 ms, ratio
# 0.88, decided only at the plan's last look; 8 layers 118 vs 72 ms, ratio 0.61, objective
# passed at look 3. A line through both gives k=3 >= 1.5x from 6 layers on.
QUOTA_MIN_LAYERS = 8


def quota_depth_floor(choice: LayerChoice, k1: TpotLine, k3: TpotLine, cpu_limit: float | None) -> LayerChoice:
    """The choice, deepened to QUOTA_MIN_LAYERS when a CPU quota below one CPU binds the run (see above)."""
    if cpu_limit is None or cpu_limit >= 1 or choice.layers >= QUOTA_MIN_LAYERS:
        return choice
    n = QUOTA_MIN_LAYERS
    t1, t3 = k1.at(n), k3.at(n)
    return choice.model_copy(
        update={
            "layers": n,
            "tpot_k1_ms": round(t1, 2),
            "tpot_k3_ms": round(t3, 2),
            "speedup_k3": round(t1 / t3, 2) if t3 > 0 else math.inf,
            "in_band": BAND_MS[0] <= t1 <= BAND_MS[1],
            "verdict": "quota_depth",
        }
    )


def search_sizes(prober: Callable[[int, str], ProbeFigures], dtype: str, widths: Iterable[int]) -> list[ProbeFigures]:
    """Probe the widths in order until one can reach the band with k=3 fast enough (see SEARCH_ON).

    The widest first (the model of issue 2); a narrower one only when even 2
    layers of the wider are too slow, or k=3 is under MIN_SPEEDUP_K3 at every
    depth in band (a slow machine): a fast machine pays one probe.
    """
    probes: list[ProbeFigures] = []
    for width in widths:
        probes.append(prober(width, dtype))
        if choose_size(probes)[1].verdict not in SEARCH_ON:  # the criterion choose_size then applies
            break
    return probes


def choose_size(probes: list[ProbeFigures]) -> tuple[ProbeFigures, LayerChoice]:
    """The probed width (and its depth) to use: the widest that can reach the band, else the fastest.

    Width changes only when depth cannot help: a narrower model with more
    layers is not preferred for a better k=3 speedup (it is not what was
    calibrated) while the wider one's is at least MIN_SPEEDUP_K3 (thin_margin
    stays); under that floor it is (VERDICT_RANK).
    """
    # The small-op time is the machine's, not the width's: pool it over the probes (their noise is +-20 %).
    op_ms = sorted(f.op_ms for f in probes)[len(probes) // 2] if probes else 0.0

    def rank(choice: LayerChoice) -> tuple[int, float]:
        return VERDICT_RANK[choice.verdict], choice.tpot_k1_ms if choice.verdict == "too_slow" else 0.0

    best = None
    for figures in probes:
        figures = figures.model_copy(update={"op_ms": op_ms})
        lines = predict_lines(figures)
        choice = choose_layers(lines[1], lines[3])
        if best is None or rank(choice) < rank(best[1]):
            best = (figures, choice)
    assert best is not None, "no probe figures"
    return best


# -- the sizing the controller uses ----------------------------------------------
class TinySizing(BaseModel):
    """The tiny checkpoint's size and the engine dtype for this machine, and why (decision.json `prepare.tiny_model`)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    dtype: str
    source: Literal["probe", "explicit", "default"] = Field(
        ..., description="probe: auto-sized here; explicit: num_layers set in the config; default: size 'default'"
    )
    reason: str = Field(..., description="the one line printed at prepare")
    cpu_model: str = ""
    native_bf16: bool = False
    cpu_limit: float | None = Field(None, description="CPUs of this process's cgroup quota (None: no quota)")
    declared_cpu_share: float | None = Field(None, description="MTP_CANARY_CPU_SHARE when set: the probe's times were divided by it")
    probe: list[ProbeFigures] = Field(default_factory=list, description="the probes run, widest first")
    predicted_tpot_ms: dict[str, float] | None = Field(None, description="k1, k3: single stream, perfect drafts")
    predicted_speedup_k3: float | None = None
    verdict: str | None = Field(
        None, description="ok, thin_margin, slow_speedup, too_slow, too_fast (see choose_layers), quota_depth (quota_depth_floor)"
    )
    target_tpot_ms: float = TARGET_TPOT_MS
    band_ms: tuple[float, float] = BAND_MS
    machine_key: str | None = None
    cached: bool = Field(False, description="read from the probe cache (not probed in this call)")
    probe_wall_s: float | None = Field(None, description="seconds the probe took (its subprocess included)")

    def spec_kwargs(self) -> dict[str, int]:
        """The size fields of TinyCheckpointSpec.sized()."""
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size}


def _explicit(options: Any) -> dict[str, Any]:
    """The size fields a TinyModelOptions sets (not None): they win over the probe."""
    if options is None:
        return {}
    dump = options.model_dump() if hasattr(options, "model_dump") else dict(options)
    return {k: dump[k] for k in ("num_layers", "hidden_size", "dtype") if dump.get(k) is not None}


def size_tiny_model(
    cache_dir: str | Path,
    progress: Progress = print,
    *,
    options: Any = None,
    reprobe: bool | None = None,
    cpuinfo: str | None = None,
    prober: Callable[[int, str], ProbeFigures] | None = None,
) -> TinySizing:
    """The tiny model's size and dtype for this machine (one progress line; the answer is cached per machine).

    options: a TinyModelOptions (or None): explicit num_layers / hidden_size /
    dtype win over the probe; size 'default' skips it (TinyCheckpointSpec's
    fixed size). No timing runs when num_layers is explicit: the dtype then
    comes from the CPU flags alone. An explicit hidden_size is the only width probed.
    reprobe (default: env MTP_CANARY_REPROBE=1) ignores a cached answer.
    cpuinfo, prober: for tests (/proc/cpuinfo text; a stand-in for probe_width
    run in this process instead of the subprocess).
    """
    t0 = time.perf_counter()
    model, flags = read_cpu_info(cpuinfo)
    bf16 = native_bf16(flags)
    explicit = _explicit(options)
    size_mode = getattr(options, "size", "auto") if options is not None else "auto"
    dtype = explicit.get("dtype") or choose_dtype(flags)
    dtype_why = "explicit" if "dtype" in explicit else ("native bf16" if bf16 else "no native bf16")
    hidden = explicit.get("hidden_size")
    common = {"cpu_model": model, "native_bf16": bf16}

    if size_mode == "default" or "num_layers" in explicit:
        sizing = _unprobed_sizing(explicit, size_mode, dtype, dtype_why, common)
        progress(f"prepare: tiny model sized: {sizing.reason}")
        return sizing

    cpu_limit = cgroup_cpu_limit()
    declared_share = declared_cpu_share()
    key = machine_key(model, flags, cpu_limit, cpu_share=declared_share)
    request = {"hidden_size": hidden, "dtype": dtype}
    request_key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:8]
    cache_file = Path(cache_dir) / "machine-probe" / f"{key}-{request_key}.json"
    if reprobe is None:
        reprobe = os.environ.get(REPROBE_ENV, "") not in ("", "0")
    cached = None if reprobe else _cached_sizing(cache_file)
    if cached is not None:
        progress(f"prepare: tiny model auto-sized: {cached.reason} [cached: {cache_file.name}]")
        return cached

    widths = [hidden] if hidden else list(HIDDEN_CHOICES)
    probes = probe_subprocess(widths, dtype) if prober is None else search_sizes(prober, dtype, widths)
    figures, choice = choose_size(probes)
    lines = predict_lines(figures)
    choice = quota_depth_floor(choice, lines[1], lines[3], cpu_limit)
    spec = TinyCheckpointSpec.sized(choice.layers, figures.hidden_size)
    limit_note = f", CPU quota {cpu_limit:g}" if cpu_limit is not None and cpu_limit < 1 else ""
    if declared_share is not None:
        limit_note += f", CPU share {declared_share:g} ({CPU_SHARE_ENV})"
    reason = _probed_reason(spec, dtype, dtype_why + limit_note, figures, choice)
    sizing = TinySizing(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        dtype=dtype,
        source="probe",
        reason=reason,
        cpu_limit=cpu_limit,
        declared_cpu_share=declared_share,
        probe=probes,
        predicted_tpot_ms={"k1": choice.tpot_k1_ms, "k3": choice.tpot_k3_ms},
        predicted_speedup_k3=choice.speedup_k3,
        verdict=choice.verdict,
        machine_key=key,
        probe_wall_s=round(time.perf_counter() - t0, 2),
        **common,
    )
    _cache_sizing(cache_file, sizing)
    progress(f"prepare: tiny model auto-sized: {reason}")
    return sizing


def _unprobed_sizing(explicit: dict[str, Any], size_mode: str, dtype: str, dtype_why: str,
                     common: dict[str, Any]) -> TinySizing:
    """The fixed default size, or the config's explicit depth: no timing run."""
    spec = TinyCheckpointSpec.sized(explicit.get("num_layers"), explicit.get("hidden_size"))
    how = "size default" if size_mode == "default" else "depth from the config"
    return TinySizing(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        dtype=dtype,
        source="default" if size_mode == "default" and not explicit else "explicit",
        reason=f"{spec.num_layers} layers x hidden {spec.hidden_size}, {dtype} ({dtype_why}; {how}, no probe)",
        **common,
    )


def _cached_sizing(cache_file: Path) -> TinySizing | None:
    """This machine's earlier answer, or None (none yet, or unreadable: probe again)."""
    if not cache_file.exists():
        return None
    try:
        return TinySizing.model_validate_json(cache_file.read_text()).model_copy(update={"cached": True})
    except ValueError:
        return None


def _cache_sizing(cache_file: Path, sizing: TinySizing) -> None:
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
    tmp.write_text(sizing.model_dump_json(indent=2))
    os.replace(tmp, cache_file)  # atomic: a concurrent sizer reads a whole answer or none


def _probed_reason(spec: TinyCheckpointSpec, dtype: str, why: str, figures: ProbeFigures, choice: LayerChoice) -> str:
    """The one line that says what the probe measured, predicted and chose."""
    note = {
        "ok": "",
        "thin_margin": f"; k=3 {choice.speedup_k3}x faster: under the {SPEEDUP_MARGIN:g} margin above {MIN_SPEEDUP_K3:g}x",
        "slow_speedup": f"; k=3 only {choice.speedup_k3}x faster (< {MIN_SPEEDUP_K3:g}x) at every depth in band",
        "too_slow": "; slower than the band even at the smallest size",
        "too_fast": "; faster than the band even at the largest depth",
        "quota_depth": f"; deepened to {QUOTA_MIN_LAYERS} layers: a CPU quota shares one pool between the arms",
    }[choice.verdict]
    return (
        f"{spec.num_layers} layers x hidden {spec.hidden_size}, {dtype} ({why}; "
        f"probe {figures.layer_ms.get(2, 0):.2f} ms/layer, {figures.op_ms * 1000:.1f} us/op -> predicted k=1 TPOT "
        f"{choice.tpot_k1_ms:.0f} ms, k=3 {choice.tpot_k3_ms:.0f} ms ({choice.speedup_k3:g}x), "
        f"band {BAND_MS[0]:g}-{BAND_MS[1]:g} ms{note})"
    )


def sizing_for_arm(options: Any, sizing: TinySizing | None, cache_dir: str | Path, progress: Progress = print) -> TinySizing | None:
    """The sizing an arm uses: `sizing` when it fits the arm's options, else one sized for them (None for size 'default').

    It fits unless the arm sets a hidden_size or dtype other than the one it was sized at.
    """
    if options is None or getattr(options, "size", "auto") != "auto":
        return None
    explicit = _explicit(options)
    if sizing is not None and all(
        explicit.get(field) in (None, getattr(sizing, attr)) for field, attr in (("hidden_size", "hidden_size"), ("dtype", "dtype"))
    ):
        return sizing
    return size_tiny_model(cache_dir, progress, options=options)


def engine_dtype_for(options: Any, sizing: TinySizing | None, engine_dtype: str) -> str:
    """The arm's engine dtype: tiny_model.dtype if set, else the sizing's when auto-sized, else the engine's own."""
    explicit = _explicit(options)
    if "dtype" in explicit:
        return explicit["dtype"]
    if sizing is not None and getattr(options, "size", "auto") == "auto":
        return sizing.dtype
    return engine_dtype


def tiny_spec_for(options: Any, sizing: TinySizing | None) -> TinyCheckpointSpec:
    """An arm's checkpoint spec: its options (noise, broken, ...), the size from explicit fields, else the sizing's."""
    dump = options.model_dump(exclude_none=True) if options is not None else {}
    kwargs = {k: dump[k] for k in ("draft_noise", "draft_decay", "broken", "mtp_layers", "seed") if k in dump}
    explicit = _explicit(options)
    layers = explicit.get("num_layers")
    hidden = explicit.get("hidden_size")
    if sizing is not None and dump.get("size", "auto") == "auto":
        layers = layers if layers is not None else sizing.num_layers
        hidden = hidden if hidden is not None else sizing.hidden_size
    return TinyCheckpointSpec.sized(layers, hidden, **kwargs)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tinymodel.sizing", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    probe = sub.add_parser("probe", help="time one width (this process; run with OMP_NUM_THREADS=1); prints JSON")
    probe.add_argument("--hidden", type=int, default=1024)
    probe.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    probe.add_argument("--layers", type=int, default=None, help="working set (default: working_set_layers())")
    search = sub.add_parser("search", help="search_sizes with run_probe (what probe_subprocess runs); prints JSON")
    search.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    search.add_argument("--widths", type=int, nargs="+", default=list(HIDDEN_CHOICES))
    size = sub.add_parser("size", help="size the tiny model for this machine (cached); prints JSON")
    size.add_argument("--cache", default=None, help="cache dir (default: MTP_CANARY_CACHE or ~/.cache/mtp-canary)")
    size.add_argument("--reprobe", action="store_true", help="ignore the cached answer")
    args = parser.parse_args(argv)
    if args.cmd in ("probe", "search"):
        import torch

        torch.set_num_threads(1)
    if args.cmd == "probe":
        spec = TinyCheckpointSpec.sized(None, args.hidden)
        layers = args.layers or working_set_layers(spec.hidden_size, args.dtype)
        figures = run_probe(spec.hidden_size, spec.intermediate_size, args.dtype, layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads)
        print(figures.model_dump_json())
        return 0
    if args.cmd == "search":
        probes = search_sizes(probe_width, args.dtype, args.widths)
        print(json.dumps([f.model_dump() for f in probes]))
        return 0
    sizing = size_tiny_model(args.cache or DEFAULT_CACHE, lambda line: print(line, file=sys.stderr), reprobe=args.reprobe)
    print(sizing.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
