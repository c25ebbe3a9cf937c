"""Engine parity (rollout.engine_parity): the arms may differ only in the fields under test.

The diff over every kind of field, the flag spellings vLLM reads as one flag, secrets that are
named but never printed, `experiment.under_test` overriding per field or group, the refusal
through the real CLI before anything starts (and the same config running once the field is
declared), and the parser of what a replica's log says its server ran with. No vLLM here.
"""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from cluster.engine_spec import REDACTED, EngineSpec
from rollout.commands import cli
from rollout.commands import run as run_command
from rollout.config import ConfigError, TinyModelOptions, parse_config
from rollout.engine_parity import (
    EngineDifference,
    engine_differences,
    engine_run_from_log,
    parity_error,
    parse_engine_args,
    parse_non_default_args,
    parse_vllm_version,
)
from tests.conftest import REPO

K1 = {"method": "mtp", "num_speculative_tokens": 1}
K3 = {"method": "mtp", "num_speculative_tokens": 3}


def engine(**fields) -> EngineSpec:
    return EngineSpec(**{"model": "/models/m", "device": "cpu", "speculative_config": K1, **fields})


def fields_of(differences: list[EngineDifference]) -> list[str]:
    return [d.field for d in differences]


def local_cpu() -> dict:
    return yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())


# -- the diff ----------------------------------------------------------------------------------


def test_identical_engines_differ_in_nothing_and_speculation_alone_is_under_test_by_default():
    assert engine_differences(engine(), engine()) == []
    found = engine_differences(engine(), engine(speculative_config=K3))
    assert found == [EngineDifference(field="speculative_config", baseline='{"method":"mtp","num_speculative_tokens":1}',
                                      candidate='{"method":"mtp","num_speculative_tokens":3}')]
    assert parity_error({"canary": found}, ["speculative_config"]) is None
    assert "speculative_config" in parity_error({"canary": found}, [])


@pytest.mark.parametrize(
    "change, field, shown",
    [
        ({"model": "/models/other"}, "model", ("/models/m", "/models/other")),
        ({"device": "gpu"}, "device", ("cpu", "gpu")),
        ({"dtype": "float32"}, "dtype", ("auto", "float32")),
        ({"max_model_len": 2048}, "max_model_len", ("unset", "2048")),
        ({"enforce_eager": True}, "enforce_eager", ("false", "true")),
        ({"trust_remote_code": True}, "trust_remote_code", ("false", "true")),
        ({"cpu": {"omp_threads": 2}}, "cpu.omp_threads", ("1", "2")),
        ({"cpu": {"kv_cache_gb": 4}}, "cpu.kv_cache_gb", ("1.0", "4.0")),
        ({"cpu": {"preload_iomp": False}}, "cpu.preload_iomp", ("true", "false")),
        ({"cpu": {"worker_process": True}}, "cpu.worker_process", ("false", "true")),  # another executor
        ({"extra_args": ["--max-num-seqs", "8"]}, "extra_args:--max-num-seqs", ("unset", "8")),
        ({"env": {"OMP_PROC_BIND": "close"}}, "env:OMP_PROC_BIND", ("unset", REDACTED)),
    ],
)
def test_each_kind_of_engine_field_is_compared(change, field, shown):
    found = engine_differences(engine(), engine(**change))
    assert [(d.field, d.baseline, d.candidate) for d in found] == [(field, *shown)]


def test_what_only_names_places_or_times_an_engine_is_not_compared():
    other = engine(served_model_name="other", startup_timeout_s=10, extra_args=["--api-key", "k1"],
                   env={"VLLM_API_KEY": "k2"})
    assert engine_differences(engine(), other) == []


def test_which_cores_is_placement_how_many_is_engine_config():
    assert engine_differences(engine(cpu={"cores": "0"}), engine(cpu={"cores": "1"})) == []
    assert engine_differences(engine(cpu={"cores": "0-1"}), engine(cpu={"cores": "2,3"})) == []
    found = engine_differences(engine(cpu={"cores": "0"}), engine(cpu={"cores": "1-2"}))
    assert [(d.field, d.baseline, d.candidate) for d in found] == [("cpu.cores", "1 (0)", "2 (1-2)")]


def test_tiny_checkpoints_are_compared_option_by_option_and_engine_model_is_ignored_for_them():
    tiny, noisy = TinyModelOptions(), TinyModelOptions(draft_noise=16.0)
    assert engine_differences(engine(model="a"), engine(model="b"), tiny, tiny) == []
    found = engine_differences(engine(), engine(), tiny, noisy)
    assert [(d.field, d.baseline, d.candidate) for d in found] == [("tiny_model.draft_noise", "0.0", "16.0")]
    broken = engine_differences(engine(), engine(), {"broken": False}, {"broken": True})
    assert fields_of(broken) == ["tiny_model.broken"]
    # one arm on the tiny checkpoint, the other on a model path: one difference, the model
    mixed = engine_differences(engine(), engine(), tiny, None)
    assert [(d.field, d.baseline, d.candidate) for d in mixed] == [("model", "the tiny_model checkpoint", "/models/m")]


# -- flag spellings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling",
    [
        ["--max_num_seqs", "8"],
        ["--max-num-seqs=8"],
        ["--max_num_seqs=8"],
        ["--gpu-memory-utilization", "0.9", "--max-num-seqs", "8"],  # order of flags does not count
    ],
)
def test_spellings_vllm_reads_as_one_flag_are_one_flag(spelling):
    reference = engine(extra_args=["--max-num-seqs", "8", "--gpu-memory-utilization=0.90"])
    other = engine(extra_args=[*spelling, *([] if "--gpu-memory-utilization" in spelling else ["--gpu_memory_utilization", "0.90"])])
    assert engine_differences(reference, other) == []


def test_values_are_compared_as_vllm_reads_them():
    assert parse_engine_args(["--max-num-seqs=8"]) == parse_engine_args(["--max-num-seqs", "8"]) == {"--max-num-seqs": ("8",)}
    # JSON values: key order and spaces do not count; a number is a number
    assert parse_engine_args(["--compilation-config", '{"level": 3, "cudagraph_mode": "NONE"}']) == parse_engine_args(
        ["--compilation-config={\"cudagraph_mode\":\"NONE\",\"level\":3}"])
    # -O3, -O=3 and -O 3 are --optimization-level 3 (FlexibleArgumentParser)
    assert parse_engine_args(["-O3"]) == parse_engine_args(["-O=3"]) == parse_engine_args(["-O", "3"]) == {
        "--optimization-level": ("3",)}
    # a negative number is a value, not a flag; several values are one value
    assert parse_engine_args(["--seed", "-1", "--allowed-origins", "a", "b"]) == {
        "--seed": ("-1",), "--allowed-origins": ("a b",)}
    # a dotted flag keeps its path (its underscores too: only the part before the dot is respelt)
    assert parse_engine_args(["--compilation_config.cudagraph_mode", "NONE"]) == {
        "--compilation-config.cudagraph_mode": ("NONE",)}


def test_a_bare_flag_and_its_no_form_are_one_field_with_two_values():
    assert parse_engine_args(["--enable-prefix-caching"]) == {"--enable-prefix-caching": ("true",)}
    assert parse_engine_args(["--no-enable-prefix-caching"]) == {"--enable-prefix-caching": ("false",)}
    found = engine_differences(engine(extra_args=["--enable-prefix-caching"]),
                               engine(extra_args=["--no_enable_prefix_caching"]))
    assert [(d.field, d.baseline, d.candidate) for d in found] == [("extra_args:--enable-prefix-caching", "true", "false")]


def test_a_flag_given_twice_is_never_taken_as_the_same_setting_silently():
    # argparse keeps the last of a store flag but all of an appending one: without vLLM's parser
    # the two cannot be told apart, so the difference is reported (fail closed), never missed
    found = engine_differences(engine(extra_args=["--max-num-seqs", "8"]),
                               engine(extra_args=["--max-num-seqs", "4", "--max-num-seqs", "8"]))
    assert [(d.field, d.baseline, d.candidate) for d in found] == [("extra_args:--max-num-seqs", "8", "4, then 8")]


# -- secrets -----------------------------------------------------------------------------------


def test_secret_values_are_compared_but_never_printed():
    ours = engine(extra_args=["--hf-token=hf_aaaa1111"], env={"HF_TOKEN": "hf_bbbb2222", "HOME_DIR": "/home/me"})
    theirs = engine(extra_args=["--hf-token", "hf_cccc3333"], env={"HF_TOKEN": "hf_dddd4444", "HOME_DIR": "/home/you"})
    found = engine_differences(ours, theirs)
    assert fields_of(found) == ["env:HF_TOKEN", "env:HOME_DIR", "extra_args:--hf-token"]
    message = parity_error({"canary": found}, ["speculative_config"])
    assert all(d.baseline == d.candidate == REDACTED for d in found) and REDACTED in message
    for secret in ("hf_aaaa1111", "hf_bbbb2222", "hf_cccc3333", "hf_dddd4444", "/home/me", "/home/you"):
        assert secret not in message and all(secret not in (d.baseline + d.candidate) for d in found)
    # the same secret on both arms is no difference
    assert engine_differences(ours, ours) == []


# -- under_test ------------------------------------------------------------------------------


def canary_with(data: dict, **engine_fields) -> dict:
    data = copy.deepcopy(data)
    data["canary"]["engine"] = {**data["canary"]["engine"], **engine_fields}
    return data


def test_a_field_declared_under_test_may_differ_in_any_spelling_and_a_group_covers_its_fields():
    data = canary_with(local_cpu(), extra_args=["--max-num-seqs", "8"], max_model_len=2048)
    with pytest.raises(ConfigError, match=r"extra_args --max-num-seqs \(baseline: unset, canary: 8\)"):
        parse_config(data)
    for declared in (["speculative_config", "extra_args:--max_num_seqs", "max_model_len"],
                     ["speculative_config", "extra_args:--max-num-seqs=", "max_model_len"],
                     ["speculative_config", "extra_args", "max_model_len"]):
        data["experiment"]["under_test"] = declared
        assert parse_config(data).canary.engine.max_model_len == 2048
    data["experiment"]["under_test"] = ["speculative_config", "extra_args:--max_num_seqs"]
    assert parse_config({**data, "canary": {**data["canary"], "engine": {**data["canary"]["engine"], "max_model_len": 1024}}})
    assert parse_config(data | {"experiment": data["experiment"] | {"under_test": ["speculative_config", "extra_args:--max_num_seqs", "max_model_len"]}}).experiment.under_test == [
        "speculative_config", "extra_args:--max-num-seqs", "max_model_len"]
    tiny = copy.deepcopy(local_cpu())
    tiny["canary"]["tiny_model"] = {"draft_noise": 8.0, "seed": 3}
    for declared in (["speculative_config", "tiny_model"], ["speculative_config", "tiny_model.draft_noise", "tiny_model.seed"]):
        tiny["experiment"]["under_test"] = declared
        assert parse_config(tiny).canary.tiny_model.draft_noise == 8.0
    tiny["experiment"]["under_test"] = ["speculative_config", "tiny_model.draft_noise"]
    with pytest.raises(ConfigError, match=r"tiny_model.seed \(baseline: 0, canary: 3\)"):
        parse_config(tiny)


def test_an_empty_under_test_asks_for_identical_engines():
    data = local_cpu()
    data["experiment"]["under_test"] = []
    with pytest.raises(ConfigError, match=r"speculative_config .*not under test \(experiment.under_test: \[\]\)"):
        parse_config(data)
    data["canary"]["engine"]["speculative_config"] = K1
    assert parse_config(data).experiment.under_test == []


@pytest.mark.parametrize(
    "name, cause",
    [
        ("speculative", "unknown field 'speculative'"),
        ("max_num_seqs", "extra_args:--max-num-seqs"),
        ("cpu.threads", "unknown field 'cpu.threads'"),
        ("tiny_model.noise", "unknown field 'tiny_model.noise'"),
        ("extra_args:max-num-seqs", "a flag starts with '-'"),
        ("extra_args:--", "a flag starts with '-'"),
        ("extra_args:-sc", "name that field (speculative_config)"),
        ("env:", "name the variable"),
        ("args:--x", "unknown field 'args:--x'"),
    ],
)
def test_an_unknown_under_test_name_is_one_line_naming_it(name, cause):
    data = local_cpu()
    data["experiment"]["under_test"] = ["speculative_config", name]
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert "experiment.under_test" in str(err.value) and cause in str(err.value) and "\n" not in str(err.value)


def test_many_differences_are_named_on_one_line_that_still_says_what_is_under_test():
    data = canary_with(local_cpu(), max_model_len=4096, dtype="float32", enforce_eager=False,
                       extra_args=[f"--flag-{i}={'v' * 80}" for i in range(2)], env={f"VAR_{i}": "x" for i in range(2)})
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    message = str(err.value)
    assert "\n" not in message and len(message) <= 400
    for field in ("dtype (baseline: bfloat16, canary: float32)", "max_model_len", "enforce_eager", "env VAR_1",
                  "extra_args --flag-0", "extra_args --flag-1"):
        assert field in message, field
    assert "v" * 61 not in message  # long values are clipped
    assert message.endswith("not under test (experiment.under_test: [speculative_config])")
    # more than a line can name: counted, and the line still ends with what is under test
    data["canary"]["engine"]["extra_args"] = [f"--flag-{i}=1" for i in range(40)]
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    message = str(err.value)
    assert len(message) <= 400 and re.search(r", and [0-9]+ more, not under test", message)
    assert message.endswith("not under test (experiment.under_test: [speculative_config])")


# -- through the command, before anything starts ---------------------------------------------


def test_the_cli_refuses_a_second_engine_change_and_runs_it_once_declared(tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(run_command, "start_run", lambda config, args: started.append(config) or 0)
    data = canary_with(local_cpu(), extra_args=["--no-enable-prefix-caching"])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    runs = tmp_path / "runs"
    assert cli.main(["run", str(path), "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "extra_args --enable-prefix-caching (baseline: unset, canary: false)" in err
    assert not started and not runs.exists()
    data["experiment"]["under_test"] = ["speculative_config", "extra_args:--enable-prefix-caching"]
    path.write_text(yaml.safe_dump(data))
    assert cli.main(["run", str(path), "--runs-dir", str(runs)]) == 0
    assert started and started[0].canary.engine.extra_args == ["--no-enable-prefix-caching"]


def test_the_shipped_configs_pass_parity_and_the_default_is_speculation_alone():
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        assert "speculative_config" in parse_config(yaml.safe_load(path.read_text())).experiment.under_test


# -- what the servers really ran with ----------------------------------------------------------

# captured from a replica log of this project (vLLM 0.32.0 CPU, tiny checkpoint, k=3)
BANNER = "(APIServer pid=7835) INFO 12-01 22:41:50 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0"
ARGS = ("(APIServer pid=7835) INFO 12-01 22:41:50 [api_utils.py:286] non-default args: {'host': '127.0.0.1', "
        "'port': 53931, 'model': '/root/.cache/mtp-canary/tiny-mimo-v2-L4-h1024-noise0-ok-mtp1-s0-e155c2e9d290', "
        "'dtype': 'bfloat16', 'max_model_len': 1024, 'enforce_eager': True, 'served_model_name': ['tiny-mimo-v2'], "
        "'speculative_config': {'method': 'mtp', 'num_speculative_tokens': 3}}")
ENGINE = ("(EngineCore pid=7912) INFO 12-01 22:42:46 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
          "model='/root/.cache/x', show_hidden_metrics_for_version=None, seed=0")


def test_the_non_default_args_line_is_parsed_into_vllm_s_own_names():
    args, unparsed = parse_non_default_args(ARGS)
    assert unparsed is None
    assert args["speculative_config"] == K3 and args["max_model_len"] == 1024 and args["enforce_eager"] is True
    assert args["served_model_name"] == ["tiny-mimo-v2"]
    assert parse_non_default_args(BANNER) == (None, None)


def test_secret_args_in_the_log_line_are_redacted_and_an_object_repr_is_kept_as_text():
    line = ("INFO [api_utils.py:286] non-default args: {'hf_token': 'hf_leak5555', 'api_key': '***', "
            "'max_num_seqs': 8, 'compilation_config': {'mode': 0}}")
    args, _ = parse_non_default_args(line)
    assert args == {"hf_token": REDACTED, "api_key": REDACTED, "max_num_seqs": 8, "compilation_config": {"mode": 0}}
    odd = "INFO non-default args: {'compilation_config': {'mode': <CompilationMode.NONE: 0>}}"
    args, unparsed = parse_non_default_args(odd)
    assert args is None and unparsed.startswith("{'compilation_config'")


@pytest.mark.parametrize(
    "line, version",
    [
        (BANNER, "0.32.0"),
        ("INFO 01-02 03:04:05 [api_utils.py:347]  \x1b[93m▄▄\x1b[0m \x1b[94m▄█\x1b[0m \x1b[1m█     █     █ ▀▄▀ █\x1b[0m"
         "  version \x1b[1m0.33.1rc1\x1b[0m", "0.33.1rc1"),
        ("INFO [api_utils.py:340] vLLM server version 0.34.0+cu129, serving model tiny", "0.34.0+cu129"),
        ("INFO vLLM API server version 0.10.1", "0.10.1"),
        (ENGINE, "0.32.0"),
        ("INFO transformers version 4.57.0 is installed", None),
        (ARGS, None),
    ],
)
def test_the_vllm_version_comes_from_the_banner_only(line, version):
    assert parse_vllm_version(line) == version


def test_a_log_with_a_restart_gives_the_last_server_s_record():
    first = ARGS.replace("'num_speculative_tokens': 3", "'num_speculative_tokens': 2")
    run = engine_run_from_log(["noise", BANNER.replace("0.32.0", "0.31.0"), first, "--", BANNER, ARGS, ENGINE])
    assert run.vllm_version == "0.32.0" and run.non_default_args["speculative_config"] == K3
    empty = engine_run_from_log(["Triton is installed, but doesn't include CPU backend."])
    assert empty.vllm_version is None and empty.non_default_args is None and empty.unparsed is None


def test_a_replica_reads_its_own_launch_s_lines_and_preflight_records_them_per_arm(tmp_path):
    from types import SimpleNamespace

    from cluster.replica import VLLMReplicaServer
    from rollout.engine_parity import SERVER_LOG_NEEDLES
    from rollout.run.phases.preflight import Preflight

    replica = VLLMReplicaServer("canary-0", "canary", engine(), str(tmp_path))
    earlier = BANNER.replace("0.32.0", "0.31.0") + "\n" + ARGS.replace("'port': 53931", "'port': 1") + "\n"
    (tmp_path / "canary-0.log").write_text(earlier)
    replica._log_offset = len(earlier.encode())  # what launch() sets: this launch starts here
    with open(tmp_path / "canary-0.log", "a") as log:
        log.write("Triton is installed\n" + BANNER + "\n" + ARGS + "\n" + ENGINE + "\nINFO Route: /version, Methods: GET\n")
    lines = replica.log_lines_with(SERVER_LOG_NEEDLES)
    assert lines == [BANNER, ARGS, ENGINE]

    fleet = SimpleNamespace(
        replicas=[SimpleNamespace(name="baseline-0", arm="baseline"), SimpleNamespace(name="canary-0", arm="canary")],
        log_lines_with=lambda needles: {"canary-0": replica.log_lines_with(needles)},  # baseline-0 not read
        environments=lambda: {"baseline-0": replica.environment()},  # canary-0's actor did not answer
    )
    ctx = SimpleNamespace(fleet=fleet, result=SimpleNamespace(arms={"baseline": {"replicas": 1}, "canary": {"replicas": 1}}))
    Preflight._record_servers(ctx)
    assert "servers" not in ctx.result.arms["baseline"]  # missing is missing, never made up
    server = ctx.result.arms["canary"]["servers"]["canary-0"]
    assert server["vllm_version"] == "0.32.0" and server["non_default_args"]["port"] == 53931
    assert server["non_default_args"]["speculative_config"] == K3 and server["unparsed"] is None
    # the node and packages each replica read on its node, also only where it answered
    assert "environment" not in ctx.result.arms["canary"]
    env = ctx.result.arms["baseline"]["environment"]["baseline-0"]
    assert env["packages"]["vllm"] and env["gpu_ids"] is None and env["cpu_model"]


def test_every_cpu_limit_can_be_declared_under_test():
    data = local_cpu()
    data["canary"]["engine"]["cpu"] = {**data["canary"]["engine"].get("cpu", {}), "worker_process": True}
    data.setdefault("experiment", {})["under_test"] = ["speculative_config", "cpu.worker_process"]
    assert parse_config(data).canary.engine.cpu.worker_process is True


def test_a_log_line_that_is_no_plain_literal_is_kept_as_text_not_a_crash():
    args, text = parse_non_default_args("INFO 12-02 01:00:00 [utils.py:1] non-default args: {[1]: 2}")
    assert args is None and text == "{[1]: 2}"


def test_arms_laid_out_over_other_pipeline_stages_differ_in_it():
    """A replica's pipeline stages change its GPUs and its speed: a difference the parity check names."""
    found = engine_differences(engine(device="gpu"), engine(device="gpu", pipeline_parallel_size=2))
    assert [(d.field, d.baseline, d.candidate) for d in found] == [("pipeline_parallel_size", "1", "2")]


@pytest.mark.parametrize("other", [
    None,  # no speculation
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    {"method": "suffix"},
    {"method": "dflash", "model": "z-lab/drafter", "num_speculative_tokens": 15},
    {"method": "mtp", "num_speculative_tokens": 1, "rejection_sample_method": "block"},
])
def test_the_whole_speculative_config_is_the_field_under_test(other):
    """Rule: arms that differ in method, drafter, verification or in speculating at all differ in one field,
    speculative_config, under test by default; anything else beside it is still refused."""
    found = engine_differences(engine(), engine(speculative_config=other))
    assert fields_of(found) == ["speculative_config"]
    assert parity_error({"ngram": found}, ["speculative_config"]) is None
    beside = engine_differences(engine(), engine(speculative_config=other, dtype="float32"))
    assert fields_of(beside) == ["dtype", "speculative_config"]
    assert "dtype" in parity_error({"ngram": beside}, ["speculative_config"])
