"""A tiny MiMo-V2 checkpoint with constructed weights, loadable by vLLM's real loader.

MiMo-V2.5 needs four H200s; this checkpoint runs the same vLLM code paths
(``MiMoV2ForCausalLM`` + the ``mimo_v2_mtp`` draft model behind
``{"method": "mtp"}``) on a CPU, and its behaviour is known exactly:

* Every ``o_proj`` and ``down_proj`` is zero, so each decoder layer adds nothing
  and the residual stream carries the current token's embedding to the final norm.
* ``lm_head`` row ``j`` is the normalised embedding of ``predecessor(j)`` under a
  fixed random cycle over the ordinary tokens, so the greedy next token is
  ``successor(current token)``: greedy continuations are known in advance
  (``golden.jsonl``) and accuracy is exact.
* The MTP layer's ``eh_proj`` is ``[I + noise, 0]``: it reads the embedding of
  the token it is given and ignores the hidden state, so with no noise it
  predicts the successor too (drafts accepted); noise makes some tokens'
  drafts wrong, deterministically per token, which controls the acceptance rate.
* ``draft_decay`` plays the layer-reuse profile: vLLM runs MTP layer 0 for every
  draft step, feeding it its own output as the hidden state where the layer was
  made for the main model's. Here every embedding carries one shared marker
  direction that the main model's hidden state keeps and the MTP layer's output
  lacks, and ``eh_proj`` adds a fixed push to its output only when the marker is
  missing from the hidden state it is given: the first draft stays exact, each
  later one (given the one before was right) is wrong for a ``draft_decay`` share
  of tokens, so vLLM's per-position acceptance reads about 1, 1 - d, (1 - d)^2.
* ``--broken`` rewires part of ``lm_head`` so greedy outputs differ from the
  unbroken checkpoint (a canary whose outputs are corrupted).

The tokenizer is a byte-level BPE trained here on the vendored gsm8k text, so
the same checkpoint serves gsm8k prompts (its answers are nonsense, but both
arms produce the same nonsense when lossless).

Cache: `checkpoint_dir(cache_dir, spec)` names a directory by the spec and by
`builder_fingerprint()` (this file's source bytes, BUILDER_VERSION and the
versions of the libraries whose output it stores), so a changed builder never
serves a checkpoint an older one wrote. `ensure_checkpoint` builds into a
temporary sibling directory and renames it into place: a reader sees a whole
checkpoint or none, and of two concurrent writers the loser uses the winner's.
The weights are stored in bfloat16 whatever dtype the engine runs them in
(`--dtype float32` widens them exactly), so one checkpoint serves both dtypes.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# the gsm8k text vendored with rollout (its package data; a path, not an import of rollout)
GSM8K_DIR = Path(__file__).parent.parent / "rollout" / "data" / "gsm8k"
# where checkpoints and machine probes are cached
DEFAULT_CACHE = Path(os.environ.get("MTP_CANARY_CACHE", Path.home() / ".cache" / "mtp-canary"))
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN]
ARCHITECTURE = "MiMoV2ForCausalLM"  # the MiMo-V2.5 architecture (fused qkv_proj)
# Bump when what a spec builds changes in a way the source hash would not show
# (e.g. vendored data). The source hash covers every edit of this file.
BUILDER_VERSION = 2
CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors", "golden.jsonl")
STALE_TEMP_S = 3600.0  # a temporary build directory older than this belongs to a dead writer

# A chat template so /v1/chat/completions works; plain role-prefixed turns.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class TinyCheckpointSpec:
    """What to build. Defaults are sized for 2 CPU cores (see the closing notes of issue 2)."""

    draft_noise: float = 0.0
    # share of drafts at positions >= 2 that are wrong (given the one before was right), as vLLM's
    # reuse of MTP layer 0 with its own output makes them; 0: none (the module docstring: how)
    draft_decay: float = 0.0
    broken: bool = False
    broken_fraction: float = 0.5
    mtp_layers: int = 1
    seed: int = 0
    vocab_size: int = 2048
    hidden_size: int = 1024
    num_layers: int = 24
    intermediate_size: int = 4096
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 64
    sliding_window: int = 128
    max_position_embeddings: int = 4096
    golden_prompts: int = 160
    golden_continuation: int = 24
    # config.json's torch_dtype: what `--dtype auto` serves (the weights are stored in bf16 either way).
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.draft_noise < 0:
            raise ValueError("draft_noise must be >= 0")
        if not 0 <= self.draft_decay < 1:
            raise ValueError("draft_decay must be in [0, 1)")
        if self.mtp_layers < 1:
            raise ValueError("mtp_layers must be >= 1")
        if not 0 < self.broken_fraction <= 1:
            raise ValueError("broken_fraction must be in (0, 1]")
        if self.head_dim < 32:
            # vLLM's CPU attention rejects head_dim 16 (measured); 64 works.
            raise ValueError("head_dim must be >= 32 for vLLM's CPU attention")
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError("num_heads * head_dim must equal hidden_size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.torch_dtype not in ("bfloat16", "float32"):
            raise ValueError("torch_dtype must be bfloat16 or float32")

    @classmethod
    def sized(cls, num_layers: int | None = None, hidden_size: int | None = None, **other) -> "TinyCheckpointSpec":
        """A spec of another depth and/or width: heads and MLP width follow hidden_size (head_dim 64, MLP 4x)."""
        if hidden_size is not None and hidden_size != cls.hidden_size:
            heads = hidden_size // cls.head_dim
            other.setdefault("num_heads", heads)
            other.setdefault("num_kv_heads", math.gcd(heads, cls.num_kv_heads) or 1)
            other.setdefault("intermediate_size", 4 * hidden_size)
            other["hidden_size"] = hidden_size
        if num_layers is not None:
            other["num_layers"] = num_layers
        return cls(**other)

    def weight_bytes(self, itemsize: int = 2) -> int:
        """Bytes of the main model's weights at `itemsize` bytes per element (MTP layers excluded)."""
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = (q + 2 * kv) * h + h * q + 2 * inter * h + h * inter
        return (self.num_layers * per_layer + 2 * self.vocab_size * h) * itemsize


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def corpus():
        # Deterministic: the trainer sees the same lines in the same order.
        with open(GSM8K_DIR / "train.jsonl", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= 3000:
                    break
                item = json.loads(line)
                yield item["question"]
                yield item["answer"]

    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


def _config_json(spec: TinyCheckpointSpec, vocab_size: int) -> dict:
    n = spec.num_layers
    # Layer 0 global attention, the rest sliding window, as MiMo-V2 mixes them.
    hybrid_pattern = [0] + [1] * (n - 1)
    return {
        "architectures": [ARCHITECTURE],
        # transformers parses the file with its native MiMo-V2-Flash config; vLLM
        # reads the remote-code field names below (hybrid_layer_pattern, swa_*, ...).
        "model_type": "mimo_v2_flash",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "v_head_dim": spec.head_dim,  # CPU attention needs v_head_dim == head_dim
        "swa_num_attention_heads": spec.num_heads,
        "swa_num_key_value_heads": spec.num_kv_heads,
        "swa_head_dim": spec.head_dim,
        "swa_v_head_dim": spec.head_dim,
        "sliding_window_size": spec.sliding_window,
        "sliding_window": spec.sliding_window,
        "hybrid_layer_pattern": hybrid_pattern,
        "layer_types": ["sliding_attention" if p else "full_attention" for p in hybrid_pattern],
        "moe_layer_freq": [0] * n,
        "mlp_layer_types": ["dense"] * n,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "hidden_act": "silu",
        "attention_bias": False,
        "layernorm_epsilon": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "swa_rope_theta": 10000.0,
        "partial_rotary_factor": 1.0,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_nextn_predict_layers": spec.mtp_layers,
        "tie_word_embeddings": False,
        "torch_dtype": spec.torch_dtype,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "mtp_canary_tiny": asdict(spec),
    }


def _successor_cycle(rng: np.random.Generator, n_special: int, vocab: int) -> np.ndarray:
    """successor[t] for every token: one random cycle over the ordinary tokens.

    One cycle (not any permutation) so greedy chains never fall into short loops.
    Special tokens map to themselves and are never predicted.
    """
    order = rng.permutation(np.arange(n_special, vocab))
    successor = np.arange(vocab)
    successor[order] = np.roll(order, -1)
    return successor


# the marker's share of an embedding (its norm next to the unit-norm token part): large enough that an
# RMS-normalised hidden state shows it plainly, small enough to keep the main model's greedy margins wide
# (every logit gains the same MARKER^2 / (1 + MARKER^2), which moves no argmax)
MARKER = 0.5


def _marked_embeddings(embed, rng: np.random.Generator):
    """(embeddings, marker u, push direction w): each row's token part made orthogonal to u and of norm 1
    (so every row's marker share is the same, which makes the first draft exact), plus MARKER * u;
    w is a unit vector orthogonal to u."""
    import torch

    h = embed.shape[1]
    u = torch.from_numpy(rng.standard_normal(h).astype(np.float32))
    u /= u.norm()
    w = torch.from_numpy(rng.standard_normal(h).astype(np.float32))
    w -= (w @ u) * u
    w /= w.norm()
    token = embed - torch.outer(embed @ u, u)
    token /= token.norm(dim=1, keepdim=True)
    return token + MARKER * u, u, w


def later_draft_right(embed, lm_head, u, w, push: float, successor: np.ndarray, n_special: int) -> np.ndarray:
    """For every ordinary token x, whether a later draft step (the MTP layer given its own output as the
    hidden state) predicts successor(x) when the push is ``push`` (in units of an RMS-normalised
    embedding's token part): argmax of lm_head . (P_u-perp enorm(e_x) + push * |token part| * w)."""
    import torch

    h = embed.shape[1]
    ordinary = torch.arange(n_special, embed.shape[0])
    e = embed[ordinary]
    e_norm = e / (e.norm(dim=1, keepdim=True) / math.sqrt(h))  # RMSNorm (weight 1)
    token_part = e_norm - torch.outer(e_norm @ u, u)
    hidden = token_part + push * token_part.norm(dim=1, keepdim=True) * w
    drafted = (hidden @ lm_head.T).argmax(dim=1).numpy()
    return drafted == successor[ordinary.numpy()]


def push_for_decay(embed, lm_head, u, w, decay: float, successor: np.ndarray, n_special: int) -> float:
    """The push that makes a ``decay`` share of ordinary tokens' later drafts wrong (bisection: the wrong
    share grows with the push, from 0 at no push)."""
    low, high = 0.0, 1.0
    while 1.0 - later_draft_right(embed, lm_head, u, w, high, successor, n_special).mean() < decay:
        low, high = high, high * 2
        if high > 1e4:
            raise ValueError(f"draft_decay {decay}: no push makes that many later drafts wrong")
    for _ in range(40):
        mid = (low + high) / 2
        wrong = 1.0 - later_draft_right(embed, lm_head, u, w, mid, successor, n_special).mean()
        low, high = (mid, high) if wrong < decay else (low, mid)
    return high


def build_weights(spec: TinyCheckpointSpec, vocab_size: int, n_special: int):
    """Constructed tensors (name -> torch tensor) and the greedy successor map."""
    import torch

    rng = np.random.default_rng(spec.seed)
    h, inter = spec.hidden_size, spec.intermediate_size
    q_size = spec.num_heads * spec.head_dim
    kv_size = spec.num_kv_heads * spec.head_dim
    qkv_rows = q_size + 2 * kv_size

    def rand(*shape, scale):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * scale)

    embed = rand(vocab_size, h, scale=1.0 / math.sqrt(h))
    successor = _successor_cycle(rng, n_special, vocab_size)
    if spec.draft_decay > 0:  # a generator of its own: the checkpoints without decay stay as they were
        embed, marker, push_direction = _marked_embeddings(embed, np.random.default_rng([spec.seed, 2]))
    if spec.broken:
        # Reroute a fraction of tokens to another token's successor: the output
        # chain differs from the golden one as soon as it meets such a token.
        ordinary = np.arange(n_special, vocab_size)
        rerouted = rng.choice(ordinary, size=int(len(ordinary) * spec.broken_fraction), replace=False)
        successor[rerouted] = successor[rng.permutation(rerouted)]

    # lm_head row j = scaled unit embedding of every t with successor(t) == j,
    # so logits(x) peak at successor(x). Scale ~15 keeps greedy margins wide.
    unit = embed / embed.norm(dim=1, keepdim=True)
    lm_head = torch.zeros(vocab_size, h)
    logit_scale = 15.0 / math.sqrt(h)
    for t in range(n_special, vocab_size):
        lm_head[successor[t]] += unit[t] * logit_scale

    zeros = torch.zeros
    tensors: dict[str, "torch.Tensor"] = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": lm_head,
    }

    def block(prefix: str) -> None:
        # Attention and MLP do real work (their cost is what speculation saves)
        # but write nothing into the residual stream (o_proj, down_proj zero).
        tensors[f"{prefix}.self_attn.qkv_proj.weight"] = rand(qkv_rows, h, scale=0.02)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = zeros(h, q_size)
        tensors[f"{prefix}.mlp.gate_proj.weight"] = rand(inter, h, scale=0.02)
        tensors[f"{prefix}.mlp.up_proj.weight"] = rand(inter, h, scale=0.02)
        tensors[f"{prefix}.mlp.down_proj.weight"] = zeros(h, inter)

    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        block(p)
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)

    for i in range(spec.mtp_layers):
        p = f"model.mtp.layers.{i}"
        block(p)
        # Layer 0 carries the configured noise; later layers (which vLLM 0.32
        # never loads for MiMo-V2) are exact, as a trained checkpoint's would be.
        noise = spec.draft_noise if i == 0 else 0.0
        e_part = torch.eye(h) + rand(h, h, scale=noise / math.sqrt(h))
        h_part = zeros(h, h)
        if spec.draft_decay > 0 and i == 0:
            # output = P_u-perp enorm(e) + push * w * (u . enorm(e) - u . hnorm(hidden)) / kappa, kappa the
            # marker's share of any RMS-normalised embedding. The main model's hidden state is the current
            # token's embedding, marker and all: the bracket is 0 and the first draft exact. The layer's own
            # output has no marker: the bracket is kappa, and the push moves a later draft off the chain.
            push = push_for_decay(embed, lm_head, marker, push_direction, spec.draft_decay, successor, n_special)
            kappa = math.sqrt(h) * MARKER / math.sqrt(1.0 + MARKER**2)
            token_norm = math.sqrt(h) / math.sqrt(1.0 + MARKER**2)  # |P_u-perp enorm(e)| for every token
            gain = push * token_norm / kappa
            e_part = e_part - torch.outer(marker, marker) + gain * torch.outer(push_direction, marker)
            h_part = -gain * torch.outer(push_direction, marker)
        tensors[f"{p}.eh_proj.weight"] = torch.cat([e_part, h_part], dim=1)
        for norm in ("enorm", "hnorm", "input_layernorm", "pre_mlp_layernorm", "final_layernorm"):
            tensors[f"{p}.{norm}.weight"] = torch.ones(h)

    return {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, successor


def golden_items(spec: TinyCheckpointSpec, successor: np.ndarray, n_special: int) -> list[dict]:
    """Prompts (token ids) and the exact greedy continuation the checkpoint must produce."""
    rng = np.random.default_rng(spec.seed + 1)
    items = []
    for i in range(spec.golden_prompts):
        length = int(rng.integers(6, 24))
        prompt = rng.integers(n_special, len(successor), size=length).tolist()
        expected, token = [], prompt[-1]
        for _ in range(spec.golden_continuation):
            token = int(successor[token])
            expected.append(token)
        items.append({"id": f"golden-{i}", "prompt_token_ids": prompt, "expected_token_ids": expected})
    return items


def fingerprint(source: bytes, libraries: dict[str, str] | None = None) -> str:
    """16 hex digits of (BUILDER_VERSION, builder source bytes, vendored data size, library versions)."""
    digest = hashlib.sha256(f"builder-v{BUILDER_VERSION}\n".encode())
    digest.update(source)
    digest.update((GSM8K_DIR / "train.jsonl").stat().st_size.to_bytes(8, "little"))
    for lib, ver in sorted((libraries or {}).items()):
        digest.update(f"\n{lib}=={ver}".encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def builder_fingerprint() -> str:
    """The fingerprint of this builder: this module's source, BUILDER_VERSION, numpy's and tokenizers' versions."""
    from importlib.metadata import PackageNotFoundError, version

    libraries = {}
    for lib in ("numpy", "tokenizers"):
        try:
            libraries[lib] = version(lib)
        except PackageNotFoundError:
            libraries[lib] = "?"
    return fingerprint(Path(__file__).read_bytes(), libraries)


def checkpoint_key(spec: TinyCheckpointSpec, builder: str | None = None) -> str:
    """12 hex digits naming (spec, builder fingerprint): equal keys build identical checkpoints."""
    payload = json.dumps({"spec": asdict(spec), "builder": builder or builder_fingerprint()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def checkpoint_dir(cache_dir: str | Path, spec: TinyCheckpointSpec) -> Path:
    """Where the cache keeps this spec's checkpoint: readable fields, then the key."""
    readable = (
        f"L{spec.num_layers}-h{spec.hidden_size}-noise{spec.draft_noise:g}-"
        + (f"decay{spec.draft_decay:g}-" if spec.draft_decay else "")
        + f"{'broken' if spec.broken else 'ok'}-mtp{spec.mtp_layers}-s{spec.seed}"
    )
    return Path(cache_dir) / f"tiny-mimo-v2-{readable}-{checkpoint_key(spec)}"


def write_checkpoint(out_dir: str | Path, spec: TinyCheckpointSpec) -> Path:
    """Write config.json, tokenizer files, model.safetensors and golden.jsonl into out_dir (in place)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec.vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    n_special = len(SPECIAL_TOKENS)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS_TOKEN,
                "bos_token": EOS_TOKEN,
                "pad_token": EOS_TOKEN,
                "model_max_length": spec.max_position_embeddings,
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "bos_token_id": 0}))
    tensors, successor = build_weights(spec, vocab_size, n_special)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(out / "golden.jsonl", "w", encoding="utf-8") as f:
        for item in golden_items(spec, successor, n_special):
            item["prompt"] = tokenizer.decode(item["prompt_token_ids"])
            f.write(json.dumps(item) + "\n")
    # config.json last: with it, the directory claims to be a whole checkpoint.
    config = _config_json(spec, vocab_size)
    config["mtp_canary_builder"] = builder_fingerprint()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def is_complete(out_dir: str | Path, spec: TinyCheckpointSpec) -> bool:
    """out_dir holds every file of a checkpoint built from `spec` by this builder."""
    out = Path(out_dir)
    if not all((out / name).is_file() for name in CHECKPOINT_FILES):
        return False
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("mtp_canary_tiny") == asdict(spec) and config.get("mtp_canary_builder") == builder_fingerprint()


def _temp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-"


def _sweep_stale(out: Path) -> None:
    """Remove temporary siblings of out left by writers that died (older than STALE_TEMP_S)."""
    now = time.time()
    for prefix in (_temp_prefix(out), f".{out.name}.old-"):
        for stale in out.parent.glob(prefix + "*"):
            try:
                if now - stale.stat().st_mtime > STALE_TEMP_S:
                    shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                continue


def _replaceable(out: Path) -> bool:
    """An existing out_dir may be replaced only if it holds nothing but checkpoint files."""
    try:
        return all(entry.name in CHECKPOINT_FILES for entry in out.iterdir())
    except NotADirectoryError:
        return False


def ensure_checkpoint(out_dir: str | Path, spec: TinyCheckpointSpec) -> Path:
    """out_dir, holding a checkpoint of `spec` by this builder: reused if there, else built atomically.

    The build goes into a temporary sibling directory that is renamed onto
    out_dir, so out_dir is never half-written. If another writer renamed its
    build into place first, that one is used (same key, same contents). A
    checkpoint of another spec or an older builder at out_dir (a fixed path,
    e.g. the tests' one) is moved aside and replaced; a directory holding other
    files is refused rather than deleted.
    """
    out = Path(out_dir)
    if is_complete(out, spec):
        return out
    if out.exists() and not _replaceable(out):
        raise FileExistsError(f"{out} holds files that are not a tiny checkpoint; not replacing it")
    out.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out), dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a checkpoint is readable as a mkdir'd one was
        write_checkpoint(tmp, spec)
        _publish(tmp, out, spec)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _publish(tmp: Path, out: Path, spec: TinyCheckpointSpec) -> None:
    """Rename the finished build tmp onto out (absent or empty: one atomic rename)."""
    try:
        os.rename(tmp, out)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if is_complete(out, spec):
        return  # a concurrent writer won the race: its checkpoint is ours
    # out holds another build (older builder, other spec, or a half-written one
    # from the in-place writer of old): move it aside, then rename ours in.
    aside = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(out, aside)
    except FileNotFoundError:
        pass
    try:
        os.rename(tmp, out)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not is_complete(out, spec):
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
