"""Weight staging: a hub model downloaded once per node into the run's `model_cache`, before any
replica of it starts there, so that every engine then starts offline from a local directory.

Why: each vLLM server would otherwise download into its own node's `~/.cache/huggingface`
(ephemeral on a KubeRay pod), with its download progress disabled (vLLM's DisabledTqdm), so
a 295 GB MiMo-V2.5 start looks stalled for 20+ minutes and a second replica on the node
downloads it again.

- `model_dir(cache, model)`: where a model lives in a cache (`CACHE/<org>--<name>`); `cache`
  is read on the node, `$VARS` and `~` expanded there (nodes may mount their disks apart).
- `stage_model` (runs on the node): under a file lock (a shared cache is downloaded by one
  node, the others wait and find it cached), fills the directory through a `Source` and
  writes a marker listing every file and its size last; `cached_weights` trusts a directory
  only when that marker is there and every file it lists has its size.
- `stage_on_nodes` (the driver): one task per node, pinned there
  (NodeAffinitySchedulingStrategy, soft=False), with a progress line every `every_s` naming
  node, model, files and bytes so far; a failure names the node and the cause.
- Sources: `hub_source` (production: huggingface_hub's `snapshot_download`, its token and
  endpoint from the job's runtime environment, HF_TOKEN / HF_ENDPOINT, never from a config
  field) and `DirectorySource` (a local directory acting as the hub, for tests and air-gapped
  mirrors).

A local model path (the tiny checkpoint, a pre-mounted directory) is never staged.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

MARKER = ".mtp-canary-staged.json"
LOCK_SUFFIX = ".lock"
PROGRESS_EVERY_S = 30.0
STAGING_TIMEOUT_S = 4 * 3600.0  # 295 GB at 200 MB/s is ~25 min; a slow mirror takes hours

Source = Callable[[str, Path], None]  # (model id, target directory): fills the directory
Progress = Callable[[str], None]


class StagedWeights(BaseModel):
    """One model on one node, as staging left it (decision.json prepare.weights)."""

    model: str
    node_id: str
    node_ip: str
    path: str  # the directory the node's engines load (`--model`), offline
    files: int
    bytes: int
    cached: bool  # it was there already: nothing was downloaded
    seconds: float


class StagingError(RuntimeError):
    """A model could not be staged on a node; the message names the node and the cause."""


def is_local_model(model: str) -> bool:
    """A path (served as it is, never staged), not a hub id (`org/name`)."""
    return model.startswith(("/", "./", "../", "~")) or Path(model).exists()


def hub_models(models: Iterable[str]) -> list[str]:
    return sorted({m for m in models if not is_local_model(m)})


def expand_cache(cache: str) -> Path:
    """The cache directory as this node sees it ($VARS and ~ expanded here)."""
    return Path(os.path.expanduser(os.path.expandvars(cache)))


def model_dir(cache: str, model: str) -> Path:
    return expand_cache(cache) / model.replace("/", "--")


def _files(path: Path) -> dict[str, int]:
    """Relative file -> size, without the marker and the hub's own bookkeeping (.cache/)."""
    found: dict[str, int] = {}
    if not path.is_dir():
        return found
    for item in path.rglob("*"):
        rel = item.relative_to(path).as_posix()
        if item.is_file() and rel != MARKER and not rel.startswith(".cache/"):
            found[rel] = item.stat().st_size
    return found


def usage_so_far(cache: str, model: str) -> tuple[int, int]:
    """(files, bytes) under the model's directory now, partial downloads (.cache/) included."""
    path = model_dir(cache, model)
    files = total = 0
    if path.is_dir():
        for item in path.rglob("*"):
            if item.is_file() and item.name != MARKER:
                files += 0 if ".cache" in item.relative_to(path).parts else 1
                total += item.stat().st_size
    return files, total


def cached_weights(cache: str, model: str) -> dict | None:
    """The marker of a complete staging ({"files": {name: size}, ...}) when every file it lists
    is there with its size; None otherwise (never staged, interrupted, or files since removed)."""
    path = model_dir(cache, model)
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    present = _files(path)
    listed = marker.get("files", {})
    if not listed or any(present.get(name) != size for name, size in listed.items()):
        return None
    return marker


def _where() -> tuple[str, str]:
    import ray

    if not ray.is_initialized():
        return "", "127.0.0.1"
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def stage_model(model: str, cache: str, source: Source) -> StagedWeights:
    """On this node: the model's directory in `cache`, downloaded through `source` unless a
    complete copy is there. Raises StagingError naming this node and the cause."""
    node_id, node_ip = _where()
    started = time.monotonic()
    path = model_dir(cache, model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # one download per cache: on a shared one (NFS, a PVC) the other nodes wait here and find it done
        with open(path.parent / (path.name + LOCK_SUFFIX), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            marker = cached_weights(cache, model)
            cached = marker is not None
            if not cached:
                (path / MARKER).unlink(missing_ok=True)
                source(model, path)
                files = _files(path)
                if not files:
                    raise StagingError("the source left no file")
                marker = {"model": model, "files": files, "staged_at": time.time(), "node_ip": node_ip}
                (path / MARKER).write_text(json.dumps(marker, sort_keys=True))
    except Exception as exc:
        raise StagingError(
            f"staging {model} into {path} on node {node_ip} ({node_id[:12]}) failed: {type(exc).__name__}: {exc}"[:600]
        ) from None
    return StagedWeights(model=model, node_id=node_id, node_ip=node_ip, path=str(path), files=len(marker["files"]),
                         bytes=sum(marker["files"].values()), cached=cached, seconds=round(time.monotonic() - started, 3))


def hub_source(model: str, target: Path) -> None:
    """huggingface_hub's snapshot_download into `target`, with its own tqdm bars (Ray forwards
    the node's stderr to the job's log). Token, endpoint and proxy come from the job's runtime
    environment (HF_TOKEN, HF_ENDPOINT, HTTPS_PROXY): nothing of them passes through here."""
    from huggingface_hub import snapshot_download

    snapshot_download(repo_id=model, local_dir=str(target))


@dataclass(frozen=True)
class DirectorySource:
    """A local directory acting as the hub: `root/<org>--<name>/` is the snapshot of `org/name`.
    Tests count its downloads by the lines it appends to `calls` (one per download, naming the node)."""

    root: str
    calls: str | None = None
    pause_s: float = 0.0  # after each file: a download that lasts long enough to be watched

    def __call__(self, model: str, target: Path) -> None:
        snapshot = Path(self.root) / model.replace("/", "--")
        if not snapshot.is_dir():
            raise FileNotFoundError(f"no snapshot of {model} at {snapshot}")
        if self.calls:
            with open(self.calls, "a") as f:
                f.write(f"{_where()[0]} {model}\n")
        for item in sorted(snapshot.rglob("*")):
            if item.is_file():
                dest = target / item.relative_to(snapshot)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(item, dest)
                time.sleep(self.pause_s)


def _pinned(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def probe_cached(nodes: Iterable[str], models: Iterable[str], cache: str) -> dict[str, dict[str, dict | None]]:
    """node id -> model -> {"path", "files", "bytes"} when a complete copy is cached there, else None
    (`mtp-canary plan`: one task pinned to each node)."""
    import ray

    def look(models: list[str], cache: str) -> dict[str, dict | None]:
        out: dict[str, dict | None] = {}
        for model in models:
            marker = cached_weights(cache, model)
            out[model] = None if marker is None else {
                "path": str(model_dir(cache, model)), "files": len(marker["files"]), "bytes": sum(marker["files"].values())}
        return out

    task = ray.remote(num_cpus=0)(look)
    wanted = list(models)
    refs = {node: task.options(scheduling_strategy=_pinned(node)).remote(wanted, cache) for node in nodes}
    return {node: ray.get(ref, timeout=120) for node, ref in refs.items()}


def free_bytes(cache: str) -> tuple[str, int]:
    """(the directory measured, bytes free on its filesystem): the cache itself, else its nearest
    existing parent (staging creates it there)."""
    path = expand_cache(cache)
    while not path.exists() and path != path.parent:
        path = path.parent
    return str(path), shutil.disk_usage(path).free


def probe_free(nodes: Iterable[str], cache: str) -> dict[str, tuple[str, int]]:
    """node id -> free_bytes(cache) there (`mtp-canary plan`: one task pinned to each node)."""
    import ray

    task = ray.remote(num_cpus=0)(free_bytes)
    refs = {node: task.options(scheduling_strategy=_pinned(node)).remote(cache) for node in nodes}
    return {node: tuple(ray.get(ref, timeout=120)) for node, ref in refs.items()}


def stage_on_nodes(
    jobs: dict[str, list[str]],
    cache: str,
    source: Source = hub_source,
    progress: Progress = print,
    every_s: float = PROGRESS_EVERY_S,
    timeout_s: float = STAGING_TIMEOUT_S,
) -> dict[tuple[str, str], StagedWeights]:
    """Stage each node's models (node id -> hub models), one task per node pinned there, all
    nodes at once; (node id, model) -> what it staged. Raises StagingError naming the node."""
    import ray

    # num_cpus=0: on a GPU node every CPU may sit in the replicas' bundles, held already
    stage = ray.remote(num_cpus=0, max_retries=0)(_stage_all)
    look = ray.remote(num_cpus=0)(_usage_all)
    ips = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    pending = {stage.options(scheduling_strategy=_pinned(node)).remote(models, cache, source): node
               for node, models in jobs.items() if models}
    staged: dict[tuple[str, str], StagedWeights] = {}
    started = time.monotonic()
    for node, models in jobs.items():
        if models:
            progress(f"weights: staging {', '.join(models)} on node {ips.get(node, '?')} into {cache}")
    while pending:
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=every_s)
        for ref in done:
            node = pending.pop(ref)
            try:
                results = ray.get(ref)
            except ray.exceptions.RayError as exc:
                for other in pending:  # the other nodes' downloads would go on holding the cache lock
                    ray.cancel(other, force=True)
                if isinstance(exc, ray.exceptions.RayTaskError):
                    cause = exc.cause if isinstance(exc.cause, StagingError) else exc
                    raise StagingError(str(cause).strip().splitlines()[-1][:600]) from None
                raise StagingError(f"staging on node {ips.get(node, '?')} ({node[:12]}) did not run: "
                                   f"{type(exc).__name__}: {exc}"[:600]) from None
            for weights in results:
                staged[(node, weights.model)] = weights
                how = "already cached" if weights.cached else f"downloaded in {weights.seconds:.0f} s"
                progress(f"weights: {weights.model} on node {weights.node_ip}: {how}, {weights.files} files, "
                         f"{weights.bytes / 1e9:.2f} GB at {weights.path}")
        if not pending:
            break
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise StagingError(f"staging did not finish within {timeout_s:g} s (staging_timeout_s) on node(s) "
                               + ", ".join(ips.get(n, "?") for n in pending.values()))
        for node in pending.values():
            try:
                usage = ray.get(look.options(scheduling_strategy=_pinned(node)).remote(jobs[node], cache), timeout=30)
            except ray.exceptions.RayError:
                continue
            for model, (files, size) in usage.items():
                progress(f"weights: {model} on node {ips.get(node, '?')}: {files} files, {size / 1e9:.2f} GB so far "
                         f"({elapsed:.0f} s)")
    return staged


def _stage_all(models: list[str], cache: str, source: Source) -> list[StagedWeights]:
    return [stage_model(model, cache, source) for model in models]


def _usage_all(models: list[str], cache: str) -> dict[str, tuple[int, int]]:
    return {model: usage_so_far(cache, model) for model in models}
