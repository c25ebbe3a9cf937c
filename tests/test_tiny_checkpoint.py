"""The tiny MiMo-V2 checkpoint does what its construction promises (checked on the tensors);
its size and dtype follow the machine (tinymodel/sizing.py); its cache is keyed and written atomically."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout.config import TinyModelOptions
from tinymodel import checkpoint as tiny_checkpoint
from tinymodel import sizing as tiny_sizing
from tinymodel.checkpoint import (
    TinyCheckpointSpec,
    checkpoint_dir,
    checkpoint_key,
    ensure_checkpoint,
    fingerprint,
    is_complete,
    write_checkpoint,
)
from tinymodel.sizing import (
    ProbeFigures,
    TinySizing,
    TpotLine,
    choose_dtype,
    choose_layers,
    choose_size,
    engine_dtype_for,
    machine_key,
    native_bf16,
    predict_lines,
    read_cpu_info,
    search_sizes,
    size_tiny_model,
    sizing_for_arm,
    tiny_spec_for,
)

SMALL = dict(vocab_size=512, hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64, golden_prompts=20)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def greedy_next(tensors) -> torch.Tensor:
    """Main model: zeroed o_proj/down_proj leave the embedding in the residual stream."""
    embed = tensors["model.embed_tokens.weight"].float()
    logits = _rms(embed) @ tensors["lm_head.weight"].float().T
    return logits.argmax(-1)


def mtp_draft(tensors, layer: int = 0) -> torch.Tensor:
    """MTP layer: eh_proj reads the embedding of the token it is given; attention and MLP add nothing."""
    embed = tensors["model.embed_tokens.weight"].float()
    eh = tensors[f"model.mtp.layers.{layer}.eh_proj.weight"].float()
    h = torch.cat([_rms(embed), torch.zeros_like(embed)], dim=1) @ eh.T
    return (_rms(h) @ tensors["lm_head.weight"].float().T).argmax(-1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}
    for name, extra in {"ok": {}, "noisy": {"draft_noise": 8.0}, "broken": {"broken": True}}.items():
        path = write_checkpoint(tmp_path_factory.mktemp(name), TinyCheckpointSpec(**SMALL, **extra, mtp_layers=3))
        out[name] = (path, load_file(str(path / "model.safetensors")))
    return out


def test_files_and_config_that_vllm_reads(built):
    path, _ = built["ok"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors", "golden.jsonl"):
        assert (path / name).exists(), name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["MiMoV2ForCausalLM"]
    assert config["model_type"] == "mimo_v2_flash"
    assert len(config["hybrid_layer_pattern"]) == config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 3
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(path).model_type == "mimo_v2_flash"


def test_greedy_next_token_is_the_successor_and_golden_follows_it(built):
    path, tensors = built["ok"]
    nxt = greedy_next(tensors)
    ordinary = torch.arange(1, nxt.numel())
    # One cycle over the ordinary tokens: a permutation with no fixed point.
    assert sorted(nxt[ordinary].tolist()) == ordinary.tolist()
    assert not (nxt[ordinary] == ordinary).any()
    for line in (path / "golden.jsonl").read_text().splitlines():
        item = json.loads(line)
        token, chain = item["prompt_token_ids"][-1], []
        for _ in item["expected_token_ids"]:
            token = int(nxt[token])
            chain.append(token)
        assert chain == item["expected_token_ids"]


def test_mtp_drafts_are_right_without_noise_and_degrade_with_it(built):
    _, ok = built["ok"]
    _, noisy = built["noisy"]
    target = greedy_next(ok)[1:]
    assert (mtp_draft(ok)[1:] == target).float().mean() == 1.0
    noisy_rate = (mtp_draft(noisy)[1:] == greedy_next(noisy)[1:]).float().mean()
    assert noisy_rate < 0.5
    # Later MTP layers (which vLLM 0.32 does not load) are exact.
    assert (mtp_draft(noisy, layer=2)[1:] == greedy_next(noisy)[1:]).float().mean() == 1.0


def draft_chain_acceptance(tensors, depth: int) -> list[float]:
    """Per-position acceptance of `depth` drafts from every ordinary token, drafted as vLLM runs MTP layer 0
    for every step: the first with the main model's hidden state (the residual: the current token's
    embedding), each later one with the layer's own (normalised) output; position i counts only when
    every earlier draft was right, as vLLM's per-position counters do."""
    embed = tensors["model.embed_tokens.weight"].float()
    lm_head = tensors["lm_head.weight"].float()
    eh = tensors["model.mtp.layers.0.eh_proj.weight"].float()
    nxt = greedy_next(tensors)
    tokens = torch.arange(1, embed.shape[0])
    hidden, token, truth = embed[tokens], nxt[tokens], nxt[tokens]  # the token just sampled, its successor next
    alive = torch.ones(tokens.numel(), dtype=torch.bool)
    rates = []
    for _ in range(depth):
        out = _rms(torch.cat([_rms(embed[token]), _rms(hidden)], dim=1) @ eh.T)
        draft, truth = (out @ lm_head.T).argmax(-1), nxt[truth]
        alive &= draft == truth
        rates.append(alive.float().mean().item())
        hidden, token = out, draft
    return rates


def test_a_decaying_profile_keeps_the_first_draft_and_loses_a_share_of_each_later_one(built, tmp_path):
    """draft_decay d: the main model and its golden chains as without it (same seed), the first draft exact,
    each later one right for ~1 - d of the tokens that reached it (vLLM's layer reuse, constructed)."""
    _, ok = built["ok"]
    assert draft_chain_acceptance(ok, 3) == [1.0, 1.0, 1.0]  # perfect drafts at every position
    for decay in (0.3, 0.6):
        path = write_checkpoint(tmp_path / f"decay{decay}", TinyCheckpointSpec(**SMALL, draft_decay=decay))
        tensors = load_file(str(path / "model.safetensors"))
        assert torch.equal(greedy_next(tensors), greedy_next(ok))
        assert (path / "golden.jsonl").read_text() == (built["ok"][0] / "golden.jsonl").read_text()
        first, second, third = draft_chain_acceptance(tensors, 3)
        assert first == 1.0
        assert second == pytest.approx(1 - decay, abs=0.05), (decay, second)
        assert third == pytest.approx((1 - decay) ** 2, abs=0.06), (decay, third)
    with pytest.raises(ValueError, match="draft_decay"):
        TinyCheckpointSpec(draft_decay=1.0)


def test_broken_checkpoint_changes_most_golden_continuations(built):
    ok_path, _ = built["ok"]
    _, broken = built["broken"]
    nxt = greedy_next(broken)
    differ = 0
    lines = (ok_path / "golden.jsonl").read_text().splitlines()
    for line in lines:
        item = json.loads(line)
        token, chain = item["prompt_token_ids"][-1], []
        for _ in item["expected_token_ids"]:
            token = int(nxt[token])
            chain.append(token)
        differ += chain != item["expected_token_ids"]
    assert differ / len(lines) > 0.9


def test_bad_spec_is_rejected():
    with pytest.raises(ValueError, match="head_dim"):
        TinyCheckpointSpec(head_dim=16, num_heads=64)
    with pytest.raises(ValueError, match="draft_noise"):
        TinyCheckpointSpec(draft_noise=-1)


# -- sizing for the machine (tinymodel/sizing.py) and the checkpoint cache ----------------

SPR_FLAGS = "fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8"
EPYC_FLAGS = "fpu sse2 avx avx2 fma bmi2 sha_ni"
CPUINFO_EPYC = f"processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: {EPYC_FLAGS}\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: {EPYC_FLAGS}\n"
CPUINFO_SPR = f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: {SPR_FLAGS}\n"


def test_dtype_is_bf16_only_with_native_bf16():
    assert choose_dtype(SPR_FLAGS.split()) == "bfloat16"
    assert choose_dtype(EPYC_FLAGS.split()) == "float32"
    assert choose_dtype(["avx2", "avx512f", "avx512_bf16"]) == "bfloat16"  # Zen 4: AVX512-BF16, no AMX
    assert choose_dtype(["avx2", "amx_bf16"]) == "bfloat16"
    assert choose_dtype(["avx2", "avx512f", "avx512bw"]) == "float32"  # AVX-512 alone emulates bf16
    assert choose_dtype(["fp", "asimd", "bf16"]) == "bfloat16"  # aarch64 Features
    assert choose_dtype([]) == "float32"
    model, flags = read_cpu_info(CPUINFO_EPYC)
    assert model == "AMD EPYC 7B13" and "avx2" in flags and not native_bf16(flags)
    assert choose_dtype(read_cpu_info(CPUINFO_SPR)[1]) == "bfloat16"


# Probe figures of this repo's calibration machine (1 thread) and of a 4x slower one.
FAST = ProbeFigures(
    dtype="bfloat16", hidden_size=1024, intermediate_size=4096, working_set_layers=21,
    layer_ms={2: 4.78, 4: 4.58}, op_ms=0.00275, kernel="vllm-onednn", wall_s=3.0,
)


# The probe of a 2-vCPU Xeon VM with AMX: 14 layers at width 1024 predicted k=1 25 ms.
SEEN_HERE = FAST.model_copy(update={"layer_ms": {2: 2.3808, 4: 2.4479}, "op_ms": 0.000911, "working_set_layers": 25})


def _scaled(figures: ProbeFigures, factor: float, hidden: int | None = None, **update) -> ProbeFigures:
    hidden = hidden or figures.hidden_size
    width = (hidden / figures.hidden_size) ** 2
    return figures.model_copy(
        update={
            "hidden_size": hidden,
            "intermediate_size": 4 * hidden,
            "layer_ms": {m: v * factor * width for m, v in figures.layer_ms.items()},
            "op_ms": figures.op_ms * factor,
            **update,
        }
    )


def test_layers_from_probe_figures_land_in_band_and_clamp():
    lines = predict_lines(FAST)
    choice = choose_layers(lines[1], lines[3])
    assert choice.verdict == "ok" and choice.in_band and choice.fast_enough
    assert 15 <= choice.tpot_k1_ms <= 40 and choice.speedup_k3 >= 1.6
    # The calibration machine: vLLM measured k=1 TPOT 14.9 / 33.6 / 81.4 ms at 2 / 8 / 24 layers.
    assert 12 <= lines[1].at(2) <= 18 and 28 <= lines[1].at(8) <= 40 and 70 <= lines[1].at(24) <= 92
    assert 4 <= choice.layers <= 8
    # A machine 2x slower: fewer layers, still in band.
    slower = choose_layers(*predict_lines(_scaled(FAST, 2.0)).values())
    assert slower.layers < choice.layers and slower.in_band
    # Pure function over the lines: nearest the target among in band and fast enough.
    assert choose_layers(TpotLine(overhead_ms=5, per_layer_ms=1), TpotLine(overhead_ms=1, per_layer_ms=0.5)).layers == 20
    # Too slow even at 2 layers: the shallowest, flagged; too fast even at 48: the deepest, flagged.
    too_slow = choose_layers(TpotLine(overhead_ms=50, per_layer_ms=5), TpotLine(overhead_ms=20, per_layer_ms=2))
    assert (too_slow.layers, too_slow.verdict) == (2, "too_slow")
    too_fast = choose_layers(TpotLine(overhead_ms=1, per_layer_ms=0.1), TpotLine(overhead_ms=0.5, per_layer_ms=0.05))
    assert (too_fast.layers, too_fast.verdict) == (48, "too_fast")
    # k=3 1.5x but not 1.6x faster in band: nearest the target anyway, flagged thin_margin.
    thin = choose_layers(TpotLine(overhead_ms=5, per_layer_ms=1), TpotLine(overhead_ms=3.2, per_layer_ms=0.65))
    assert thin.verdict == "thin_margin" and 1.5 <= thin.speedup_k3 < 1.6 and thin.layers == 20
    # In band but k=3 never 1.5x faster: the in-band depth with the best speedup.
    flat = choose_layers(TpotLine(overhead_ms=10, per_layer_ms=1), TpotLine(overhead_ms=9, per_layer_ms=0.9))
    assert flat.verdict == "slow_speedup" and flat.in_band
    # Clamped to the range asked for.
    assert choose_layers(TpotLine(overhead_ms=5, per_layer_ms=1), TpotLine(overhead_ms=1, per_layer_ms=0.5), layer_range=(2, 12)).layers == 12


def test_more_rows_never_predicted_cheaper_and_a_quota_raises_the_overhead():
    noisy = FAST.model_copy(update={"layer_ms": {2: 4.8, 4: 3.0}})  # the probe's noise can say 4 rows are cheaper
    assert predict_lines(noisy)[3].per_layer_ms == pytest.approx(predict_lines(FAST.model_copy(update={"layer_ms": {2: 4.8, 4: 4.8}}))[3].per_layer_ms)
    quota = FAST.model_copy(update={"cpu_share": 0.25})
    assert predict_lines(quota)[1].overhead_ms > 1.5 * predict_lines(FAST)[1].overhead_ms
    # a declared share (CPU hogs that outrank the replicas, not a quota): the probe's times, as they are
    declared = quota.model_copy(update={"cpu_share_declared": True})
    assert predict_lines(declared)[1].overhead_ms == pytest.approx(predict_lines(FAST)[1].overhead_ms)


def test_slow_machine_search_narrows_the_model_fast_machine_probes_once():
    calls = []

    def prober(fast_factor):
        def probe(width, dtype):
            calls.append(width)
            return _scaled(FAST, fast_factor, hidden=width, dtype=dtype)

        return probe

    probes = search_sizes(prober(1.0), "bfloat16", (1024, 512, 256))
    assert calls == [1024] and choose_size(probes)[0].hidden_size == 1024
    calls.clear()
    probes = search_sizes(prober(6.0), "float32", (1024, 512, 256))
    assert calls[0] == 1024 and len(calls) >= 2
    figures, choice = choose_size(probes)
    assert figures.hidden_size < 1024 and choice.layers >= 2 and choice.tpot_k1_ms <= 40
    # In band at 1024 with k=3 short of the margin but above the 1.5x floor (a probe seen here): 1024
    # stays, 512 is not preferred.
    wide = FAST.model_copy(update={"layer_ms": {2: 2.6, 4: 3.1}, "op_ms": 0.0016})
    assert choose_size([wide])[1].verdict == "thin_margin"
    figures, choice = choose_size([wide, _scaled(wide, 1.0, hidden=512)])
    assert figures.hidden_size == 1024 and choice.in_band and choice.verdict == "thin_margin"
    calls.clear()
    assert len(search_sizes(lambda w, d: calls.append(w) or _scaled(wide, 1.0, hidden=w), "bfloat16", (1024, 512))) == 1
    # A replica at a quarter of a core (benchmarks/hogged.sh: work that outranks it on every core): at
    # 1024 only the shallowest depths are in band and k=3 is under 1.5x there; 512 is in band and fast
    # enough, so the search goes on to it and takes it.
    quarter = lambda width, dtype: _scaled(SEEN_HERE, 4.0, hidden=width, cpu_share=0.25, cpu_share_declared=True)  # noqa: E731
    wide_choice = choose_size([quarter(1024, "bfloat16")])[1]
    assert wide_choice.verdict == "slow_speedup" and wide_choice.in_band and wide_choice.speedup_k3 < 1.5
    probes = search_sizes(quarter, "bfloat16", (1024, 512, 256))
    figures, choice = choose_size(probes)
    assert [p.hidden_size for p in probes] == [1024, 512] and figures.hidden_size == 512
    assert choice.verdict in ("ok", "thin_margin") and choice.speedup_k3 >= 1.5 and choice.layers > wide_choice.layers
    # When nothing reaches the band, the smallest model there is, flagged.
    figures, choice = choose_size([_scaled(FAST, 40.0, hidden=w) for w in (1024, 512, 256)])
    assert (figures.hidden_size, choice.layers, choice.verdict) == (256, 2, "too_slow")


def _counting_prober(factor=1.0):
    calls = []

    def probe(width, dtype):
        calls.append((width, dtype))
        return _scaled(FAST, factor, hidden=width, dtype=dtype)

    probe.calls = calls
    return probe


def test_size_is_cached_per_machine_and_the_same_for_both_calls(tmp_path):
    prober = _counting_prober()
    lines = []
    first = size_tiny_model(tmp_path, lines.append, cpuinfo=CPUINFO_SPR, prober=prober, reprobe=False)
    second = size_tiny_model(tmp_path, lines.append, cpuinfo=CPUINFO_SPR, prober=prober, reprobe=False)
    assert len(prober.calls) == 1 and second.cached and not first.cached
    assert (first.num_layers, first.hidden_size, first.dtype) == (second.num_layers, second.hidden_size, second.dtype)
    assert first.source == "probe" and first.dtype == "bfloat16" and first.predicted_tpot_ms["k1"] <= 40
    assert len(lines) == 2 and all(line.startswith("prepare: tiny model auto-sized: ") for line in lines)
    assert f"{first.num_layers} layers x hidden 1024, bfloat16" in lines[0] and "band 15-40 ms" in lines[0]
    assert first.model_dump()["probe"][0]["layer_ms"]  # what decision.json stores
    # Another CPU (model or flags): another cache entry, probed at its dtype.
    other = size_tiny_model(tmp_path, lines.append, cpuinfo=CPUINFO_EPYC, prober=prober, reprobe=False)
    assert len(prober.calls) == 2 and prober.calls[-1] == (1024, "float32") and other.dtype == "float32"
    assert "no native bf16" in other.reason
    size_tiny_model(tmp_path, lines.append, cpuinfo=CPUINFO_SPR, prober=prober, reprobe=True)
    assert len(prober.calls) == 3
    key = machine_key("AMD EPYC 7B13", EPYC_FLAGS.split(), None, "2.13.0")
    assert key != machine_key("AMD EPYC 7B13", EPYC_FLAGS.split(), 0.25, "2.13.0")
    assert key != machine_key("AMD EPYC 7B13", EPYC_FLAGS.split(), None, "2.14.0")
    assert key != machine_key("AMD EPYC 7B13", EPYC_FLAGS.split() + ["avx512f"], None, "2.13.0")


def test_explicit_options_win_over_the_probe(tmp_path):
    def no_probe(width, dtype):
        raise AssertionError("probed although num_layers is explicit")

    say = []
    explicit = size_tiny_model(tmp_path, say.append, options=TinyModelOptions(num_layers=3), cpuinfo=CPUINFO_EPYC, prober=no_probe)
    assert (explicit.num_layers, explicit.hidden_size, explicit.dtype, explicit.source) == (3, 1024, "float32", "explicit")
    assert say == ["prepare: tiny model sized: 3 layers x hidden 1024, float32 (no native bf16; depth from the config, no probe)"]
    default = size_tiny_model(tmp_path, say.append, options=TinyModelOptions(size="default"), cpuinfo=CPUINFO_EPYC, prober=no_probe)
    assert (default.num_layers, default.source) == (24, "default")
    # An explicit width is the only one probed; an explicit dtype is the one probed.
    prober = _counting_prober(factor=6.0)
    sized = size_tiny_model(tmp_path, say.append, options=TinyModelOptions(hidden_size=512, dtype="bfloat16"), cpuinfo=CPUINFO_EPYC, prober=prober)
    assert prober.calls == [(512, "bfloat16")] and sized.hidden_size == 512 and sized.dtype == "bfloat16"

    auto = TinySizing(num_layers=6, hidden_size=512, intermediate_size=2048, dtype="float32", source="probe", reason="test")
    # Depth and width from the sizing unless the options set them; noise etc. always from the options.
    spec = tiny_spec_for(TinyModelOptions(draft_noise=2.0), auto)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.intermediate_size, spec.draft_noise) == (6, 512, 8, 2048, 2.0)
    assert tiny_spec_for(TinyModelOptions(num_layers=3), auto).num_layers == 3
    assert tiny_spec_for(TinyModelOptions(size="default"), auto).num_layers == 24
    # The engine's dtype follows the sizing when auto-sized, an explicit dtype always, else the engine's own.
    assert engine_dtype_for(TinyModelOptions(), auto, "bfloat16") == "float32"
    assert engine_dtype_for(TinyModelOptions(dtype="bfloat16"), auto, "auto") == "bfloat16"
    assert engine_dtype_for(TinyModelOptions(size="default"), None, "bfloat16") == "bfloat16"
    # A sizing made for another width is not used for an arm that sets its own.
    assert sizing_for_arm(TinyModelOptions(), auto, tmp_path, say.append) is auto
    assert sizing_for_arm(TinyModelOptions(size="default"), auto, tmp_path, say.append) is None
    with pytest.raises(ValueError):
        TinyModelOptions(hidden_size=300)
    with pytest.raises(ValueError):
        TinyModelOptions(dtype="float16")
    with pytest.raises(ValueError):
        TinyModelOptions(size="large")


def test_resolve_arm_engine_gives_both_arms_the_sizing_and_its_dtype(tmp_path):
    from rollout.config import ArmConfig
    from rollout.run.phases.setup import resolve_arm_engine

    engine = {"device": "cpu", "dtype": "bfloat16", "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
    baseline = ArmConfig.model_validate({"tiny_model": {}, "engine": engine})
    canary = ArmConfig.model_validate({"tiny_model": {"draft_noise": 0.0}, "engine": {**engine, "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}})
    sizing = TinySizing(num_layers=2, hidden_size=256, intermediate_size=1024, dtype="float32", source="probe", reason="test")
    say = []
    a = resolve_arm_engine(baseline, tmp_path, say.append, sizing=sizing)
    b = resolve_arm_engine(canary, tmp_path, say.append, sizing=sizing)
    assert a.model == b.model and a.dtype == b.dtype == "float32"
    config = json.loads((Path(a.model) / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 256)
    assert Path(a.model).parent == tmp_path and is_complete(a.model, tiny_spec_for(baseline.tiny_model, sizing))
    # An explicit tiny_model.dtype wins over the sizing's.
    pinned = ArmConfig.model_validate({"tiny_model": {"dtype": "bfloat16", "num_layers": 2, "hidden_size": 256}, "engine": engine})
    assert resolve_arm_engine(pinned, tmp_path, say.append, sizing=sizing).dtype == "bfloat16"


SMALL_SPEC = TinyCheckpointSpec(**{**SMALL, "golden_prompts": 4})


def test_cache_key_changes_with_the_builder_source(monkeypatch, tmp_path):
    source = Path(tiny_checkpoint.__file__).read_bytes()
    assert fingerprint(source) != fingerprint(source + b"\n# edited\n")
    assert fingerprint(source, {"numpy": "2.3.5"}) != fingerprint(source, {"numpy": "2.4.0"})
    assert checkpoint_key(SMALL_SPEC, "a" * 16) != checkpoint_key(SMALL_SPEC, "b" * 16)
    assert checkpoint_key(SMALL_SPEC) != checkpoint_key(TinyCheckpointSpec(**{**SMALL, "golden_prompts": 4, "draft_noise": 1.0}))
    before = checkpoint_dir(tmp_path, SMALL_SPEC)
    built = ensure_checkpoint(tmp_path / "fixed", SMALL_SPEC)
    assert is_complete(built, SMALL_SPEC)
    monkeypatch.setattr(tiny_checkpoint, "builder_fingerprint", lambda: "0123456789abcdef")
    assert checkpoint_dir(tmp_path, SMALL_SPEC) != before
    # A checkpoint an older builder wrote at a fixed path is not reused: it is rebuilt in place.
    assert not is_complete(built, SMALL_SPEC)
    ensure_checkpoint(tmp_path / "fixed", SMALL_SPEC)
    assert json.loads((built / "config.json").read_text())["mtp_canary_builder"] == "0123456789abcdef"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fixed"]  # no temp or moved-aside dirs left


def test_atomic_write_survives_stale_temp_dirs_and_half_written_checkpoints(tmp_path):
    out = tmp_path / "ckpt"
    stale_old = tmp_path / ".ckpt.tmp-deadbeef"
    stale_old.mkdir()
    (stale_old / "model.safetensors").write_bytes(b"partial")
    old = time.time() - 2 * tiny_checkpoint.STALE_TEMP_S
    os.utime(stale_old, (old, old))
    fresh_other = tmp_path / ".ckpt.tmp-inflight"  # another writer's build in progress: left alone
    fresh_other.mkdir()
    # A half-written checkpoint at out (the in-place writer of old died): replaced.
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    assert ensure_checkpoint(out, SMALL_SPEC) == out and is_complete(out, SMALL_SPEC)
    assert not stale_old.exists() and fresh_other.exists()
    assert {p.name for p in tmp_path.iterdir()} == {"ckpt", ".ckpt.tmp-inflight"}
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    # Reused as is (no rebuild) when complete.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    ensure_checkpoint(out, SMALL_SPEC)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # A writer that loses the race uses the winner's checkpoint and drops its own build.
    loser = tmp_path / ".ckpt.tmp-loser"
    tiny_checkpoint.write_checkpoint(loser, SMALL_SPEC)
    tiny_checkpoint._publish(loser, out, SMALL_SPEC)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # A directory holding anything else is refused, not deleted.
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        ensure_checkpoint(precious, SMALL_SPEC)
    assert (precious / "notes.txt").read_text() == "keep"


def test_the_probe_runs_in_seconds_and_reports_per_layer_times():
    start = time.perf_counter()
    figures = tiny_sizing.run_probe(256, 1024, "float32", working_set_layers=2, block_s=0.02, blocks=2)
    assert time.perf_counter() - start < 30
    assert set(figures.layer_ms) == {2, 4} and all(v > 0 for v in figures.layer_ms.values())
    assert figures.op_ms > 0 and figures.kernel in ("vllm-onednn", "torch")
    assert tiny_sizing.working_set_layers(1024, "bfloat16", llc=300 << 20) * 29 << 20 >= 400 << 20
    assert 2 <= tiny_sizing.working_set_layers(256, "float32", llc=None) <= 48


def test_a_declared_cpu_share_divides_the_probes_times_and_keys_its_cache(tmp_path, monkeypatch):
    """MTP_CANARY_CPU_SHARE: work that outranks the replicas on every core (CPU time cannot see it)."""
    from tinymodel.sizing import CPU_SHARE_ENV, declared_cpu_share, replica_cpu_share

    assert declared_cpu_share({}) is None and declared_cpu_share({CPU_SHARE_ENV: "0.25"}) == 0.25
    for bad in ("0", "-1", "1.01", "nan", "quarter"):
        with pytest.raises(ValueError, match=CPU_SHARE_ENV):
            declared_cpu_share({CPU_SHARE_ENV: bad})
    assert replica_cpu_share(None, None) == 1.0 and replica_cpu_share(0.5, None) == 0.5
    assert replica_cpu_share(4.0, None) == 1.0 and replica_cpu_share(0.5, 0.25) == 0.25
    # the key of a machine without it is unchanged; with it, another cache entry
    plain = machine_key("AMD EPYC 7B13", EPYC_FLAGS.split(), None, "2.13.0")
    assert plain == machine_key("AMD EPYC 7B13", EPYC_FLAGS.split(), None, "2.13.0", cpu_share=None)
    assert plain != machine_key("AMD EPYC 7B13", EPYC_FLAGS.split(), None, "2.13.0", cpu_share=0.25)
    # the probe divides its CPU times by the share and says it came from the environment
    monkeypatch.setenv(CPU_SHARE_ENV, "0.5")
    figures = tiny_sizing.run_probe(256, 1024, "float32", working_set_layers=2, block_s=0.02, blocks=2)
    assert figures.cpu_share == 0.5 and figures.cpu_share_declared
    # the sizing says it, records it and caches it apart from the undeclared answer
    lines = []
    declared = size_tiny_model(tmp_path, lines.append, cpuinfo=CPUINFO_SPR, prober=_counting_prober(), reprobe=False)
    assert declared.declared_cpu_share == 0.5 and f"CPU share 0.5 ({CPU_SHARE_ENV})" in declared.reason
    monkeypatch.delenv(CPU_SHARE_ENV)
    plain_sizing = size_tiny_model(tmp_path, lines.append, cpuinfo=CPUINFO_SPR, prober=_counting_prober(), reprobe=False)
    assert not plain_sizing.cached and plain_sizing.declared_cpu_share is None and "CPU share" not in plain_sizing.reason
    assert len(list((tmp_path / "machine-probe").iterdir())) == 2


def test_a_cpu_quota_deepens_a_shallow_choice_and_nothing_else():
    from tinymodel.sizing import QUOTA_MIN_LAYERS, quota_depth_floor

    k1, k3 = TpotLine(overhead_ms=30, per_layer_ms=2), TpotLine(overhead_ms=20, per_layer_ms=1)
    shallow = choose_layers(k1, k3, band=(15.0, 40.0))
    assert shallow.layers < QUOTA_MIN_LAYERS
    # no quota, or a quota of a whole CPU or more: the band's choice stands
    assert quota_depth_floor(shallow, k1, k3, None) == shallow
    assert quota_depth_floor(shallow, k1, k3, 2.0) == shallow
    deeper = quota_depth_floor(shallow, k1, k3, 0.5)
    assert (deeper.layers, deeper.verdict) == (QUOTA_MIN_LAYERS, "quota_depth")
    assert deeper.tpot_k1_ms == pytest.approx(k1.at(QUOTA_MIN_LAYERS)) and deeper.speedup_k3 > shallow.speedup_k3
    # already deep enough: unchanged
    deep = choose_layers(TpotLine(overhead_ms=5, per_layer_ms=1), TpotLine(overhead_ms=1, per_layer_ms=0.5))
    assert quota_depth_floor(deep, k1, k3, 0.5) == deep
