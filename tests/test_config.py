from pathlib import Path

import pytest

from rollout.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted((REPO / "configs").rglob("*.yaml"))


def minimal(**overrides) -> dict:
    arm = {"tiny_model": {}, "engine": {"device": "cpu", "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}}
    data = {"name": "t", "baseline": arm, "canary": {**arm, "engine": {**arm["engine"], "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}}}
    data.update(overrides)
    return data


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    # the canary, or with candidates the deepest of them (k=3; the DFlash recipe's k=7)
    deepest = max([cfg.canary, *cfg.candidates], key=lambda a: a.engine.num_speculative_tokens)
    assert deepest.engine.num_speculative_tokens == (7 if path.name.startswith("mimo-v2.6-dflash") else 3)
    # k=1 baselines, but for those asking whether speculation is lossless under sampling, or pays at all
    plain = {"local-sampled.yaml", "mimo-v2.6-dflash-vs-no-speculation.yaml"}
    assert cfg.baseline.engine.num_speculative_tokens == (0 if path.name in plain else 1)


def test_the_gpu_target_config_is_mimo_v25_at_tensor_parallel_4():
    cfg = load_config(REPO / "configs" / "mimo-v2.5-mtp.yaml")
    assert cfg.canary.engine.model == "XiaomiMiMo/MiMo-V2.5"
    assert cfg.canary.engine.tensor_parallel_size == 4
    assert cfg.canary.engine.trust_remote_code
    assert "--no-async-scheduling" in cfg.baseline.engine.extra_args
    assert cfg.accuracy.kind == "gsm8k"


@pytest.mark.parametrize(
    "data, names",
    [
        (minimal(unknown_key=1), "unknown_key"),
        (minimal(canary={"replicas": 2, "tiny_model": {}, "engine": {"device": "cpu"}}), "replicas"),
        (minimal(experiment={"window_s": 0}), "experiment.window_s"),
        (minimal(experiment={"requests_per_look": 200, "requests_per_arm": 100}), "requests_per_look"),
        (minimal(experiment={"requests_per_look": 5, "requests_per_arm": 1000}), "at most 50"),
        (minimal(experiment={"max_duration_s": 0}), "experiment.max_duration_s"),
        (minimal(experiment={"min_looks": 9}), "min_looks"),
        (minimal(gates={"alpha": 2}), "gates.alpha"),
        (minimal(name="bad name"), "name"),
        (minimal(baseline={"engine": {"device": "cpu"}}), "baseline.engine.model"),
        (minimal(experiment={"worker_placement": "everywhere"}), "experiment.worker_placement"),
        (minimal(experiment={"worker_placement": "node:"}), "experiment.worker_placement"),
        (minimal(experiment={"workers": 0}), "worker_placement: local"),
        (minimal(experiment={"sweep": {"levels": [1, 0]}}), "experiment.sweep.levels"),
        (minimal(lease_s=1), "lease_s"),
    ],
)
def test_bad_configs_get_one_line_naming_the_field(data, names):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    message = str(err.value)
    assert names in message
    assert "\n" not in message


def test_yaml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbaseline: [unclosed\n")
    with pytest.raises(ConfigError, match="line"):
        load_config(bad)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_worker_placements_that_validate():
    for placement in ("local", "spread", "pack", "node:10.0.0.2", "label:zone=a", "resource:locust=1"):
        assert parse_config(minimal(experiment={"worker_placement": placement})).experiment.worker_placement == placement
    assert parse_config(minimal(experiment={"workers": 0, "worker_placement": "local"})).experiment.workers == 0


def test_every_model_of_the_config_refuses_unknown_keys():
    import typing

    from pydantic import BaseModel

    from rollout.config import RolloutConfig

    seen: set[type] = set()

    def models_in(annotation) -> list[type]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        return [m for arg in typing.get_args(annotation) for m in models_in(arg)]

    todo = [RolloutConfig]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        assert model.model_config.get("extra") == "forbid", model.__name__
        for field in model.model_fields.values():
            todo += models_in(field.annotation)
    assert len(seen) >= 10


def test_anchors_and_merge_keys_still_work(tmp_path):
    # local-cpu.yaml's canary merges the baseline engine (<<: *engine) and overrides one key of it
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "local-cpu.yaml")
    assert cfg.canary.engine.enforce_eager and cfg.canary.engine.num_speculative_tokens == 3
    many = tmp_path / "many-aliases.yaml"
    many.write_text(
        "name: t\nbaseline: &arm {tiny_model: &tm {}, engine: &e {device: cpu, speculative_config: {method: mtp}}}\n"
        "canary: {tiny_model: *tm, engine: {<<: *e, speculative_config: {method: mtp, num_speculative_tokens: 3}}}\n"
        "x_refs: [*arm, *arm, *arm]\n"
    )
    with pytest.raises(ConfigError, match="x_refs: Extra inputs"):  # composed fine; only the key is wrong
        load_config(many)


def test_a_non_finite_number_is_refused_wherever_it_is():
    with pytest.raises(ConfigError, match=r"gates\.alpha: must be a finite number"):
        parse_config(minimal(gates={"alpha": float("nan")}))
    with pytest.raises(ConfigError, match=r"progressive\.steps\.0\.canary_weight: must be a finite"):
        parse_config(minimal(progressive={"enabled": True, "steps": [{"canary_weight": float("inf")}]}))


def test_an_error_line_stays_one_line_whatever_the_key():
    with pytest.raises(ConfigError) as err:
        parse_config(minimal(**{"evil\nkey\x1b[2J" + "k" * 500: 1}))
    message = str(err.value)
    assert "\n" not in message and "\x1b" not in message and len(message) <= 400


def test_the_workload_reaches_every_phases_load(tmp_path):
    from rollout.run.context import TrafficPlan

    trace = REPO / "loadtests" / "data" / "traces" / "mooncake_sample.jsonl"
    cfg = parse_config(minimal(experiment={"dataset": "trace", "dataset_path": str(trace), "trace_format": "mooncake",
                                           "trace_speedup": 3.0}))
    options = TrafficPlan(cfg, "tiny").pinned(tmp_path / "records.jsonl", arm_pin="baseline,canary")
    assert (options.dataset, options.trace_format, options.trace_speedup, options.open_loop) == ("trace", "mooncake", 3.0, True)
    cfg = parse_config(minimal(experiment={"dataset": "multi_turn", "turns": 5}))
    options = TrafficPlan(cfg, "tiny").pinned(tmp_path / "records.jsonl")
    assert (options.dataset, options.turns, options.temperature) == ("multi_turn", 5, 0.0)
    # sampled load: the temperature goes to every request (Locust's --mtp-temperature)
    options = TrafficPlan(parse_config(minimal(experiment={"temperature": 0.7})), "tiny").pinned(tmp_path / "r.jsonl")
    assert options.temperature == 0.7 and "--mtp-temperature" in options.to_cli_args()
    # read as the config says: the Mooncake file is no trace of this project's format
    with pytest.raises(ConfigError, match=r"mooncake_sample.jsonl:1: input_tokens must be a positive integer"):
        parse_config(minimal(experiment={"dataset": "trace", "dataset_path": str(trace)}))
    trace = trace.with_name("sample.jsonl")
    with pytest.raises(ConfigError, match="no sweep"):
        parse_config(minimal(experiment={"dataset": "trace", "dataset_path": str(trace), "sweep": {"levels": [1, 2]}}))
    with pytest.raises(ConfigError, match="progressive.rate"):
        parse_config(minimal(experiment={"dataset": "trace", "dataset_path": str(trace)},
                             progressive={"enabled": True, "rate": 2.0, "steps": [{"canary_weight": 50}]}))


def test_sampled_accuracy_items_need_the_divergence_gate_disabled():
    """Sampled outputs differ between arms by chance: a divergence gate on them would roll back a lossless
    canary, so accuracy.temperature > 0 asks for gates.disabled to name it (one line naming both fields)."""
    with pytest.raises(ConfigError) as err:
        parse_config(minimal(accuracy={"temperature": 1.0}))
    message = str(err.value)
    assert "accuracy.temperature 1" in message and "gates.disabled" in message and "\n" not in message
    cfg = parse_config(minimal(accuracy={"temperature": 1.0}, gates={"disabled": ["output_divergence"]}))
    assert cfg.accuracy.temperature == 1.0
    # greedy items (the default), or no accuracy phase: nothing to ask
    assert parse_config(minimal()).accuracy.temperature == 0.0
    parse_config(minimal(accuracy={"temperature": 1.0, "enabled": False}))
    with pytest.raises(ConfigError, match="accuracy.temperature"):
        parse_config(minimal(accuracy={"temperature": -0.5}))
