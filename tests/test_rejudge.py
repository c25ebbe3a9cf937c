"""`mtp-canary judge` (rollout/commands/judge.py): re-judging request records with the controller's look logic.

tests/data/rejudge/promote is a real run (configs/local-cpu.yaml at a CPU quota of 0.5): its
records in the run's order (only the fields the judge reads) and its decision.json cut to what
the judge reads. The other inputs are made here, with the effect known.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from loadtests.records import RequestRecord
from rollout.commands import cli, judge as judge_command
from rollout.analysis import replay

REPO = Path(__file__).resolve().parents[1]
REAL_RUN = REPO / "tests" / "data" / "rejudge" / "promote"


def judged(capsys, *argv: str) -> tuple[int, list[dict]]:
    code = judge_command.main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, [json.loads(line) for line in out.splitlines() if line.strip()]


def run_config(tmp_path: Path, enabled: list[str] | None) -> Path:
    """configs/local-cpu.yaml (40 requests per look, 600 per arm, a warm-up of one look) with only `enabled` gates."""
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["gates"]["enabled"] = enabled
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def write_records(path: Path, tpot_by_arm: dict[str, np.ndarray], errors: dict[str, np.ndarray] | None = None,
                  ttft_by_arm: dict[str, np.ndarray] | None = None) -> Path:
    """Alternating arms (as the pinning sends them), one pair every 0.5 s, 32 output tokens each."""
    errors, ttft_by_arm = errors or {}, ttft_by_arm or {}
    lines, n = [], len(next(iter(tpot_by_arm.values())))
    for i in range(n):
        for arm, tpot in tpot_by_arm.items():
            failed = bool(errors.get(arm, np.zeros(n, bool))[i])
            ttft = float(ttft_by_arm[arm][i]) if arm in ttft_by_arm else 0.05
            row = {"request_id": f"{arm}-{i}", "tag": "experiment", "worker": "w", "arm": arm, "pinned_arm": arm,
                   "sent_at": 1000.0 + 0.5 * i, "e2e_s": ttft + float(tpot[i]) * 31, "ok": not failed,
                   "status": 500 if failed else 200}
            if not failed:
                row.update(ttft_s=ttft, output_tokens=32)
            lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


# The run was judged before db87ecd (quantile ratios on order-statistic bands widened for blocks): these
# gates' intervals, and so their verdicts, differ now by design; their point estimates must not.
# Re-record the fixture from a run under the current judge to compare them too.
# acceptance_length_floor: the run's records carry no per-request spec-decode counters, and server counters
# alone no longer pass the floor (its interval is clustered by request)
JUDGED_DIFFERENTLY_SINCE_THE_RUN = {"tpot_p50_improvement", "ttft_p95_guard", "acceptance_length_floor"}


def test_a_replay_of_a_real_run_gives_the_verdicts_it_stored(capsys):
    """The replay (stored look boundaries, the run's gates_config, its spec-decode counters) makes the run's
    looks (same requests, same information fractions), the same verdicts at every look and the same
    estimates and intervals for every gate whose judge has not changed since the run, and the same point
    estimates for those whose judge has."""
    stored = json.loads((REAL_RUN / "decision.json").read_text())
    code, [out] = judged(capsys, str(REAL_RUN))
    assert len(out["looks"]) == len(stored["experiment"]["looks"])
    for replayed, original in zip(out["looks"], stored["experiment"]["looks"]):
        assert replayed["requests"] == original["requests"]
        assert replayed["information"] == pytest.approx(original["information"], abs=1e-4)
        same = {k: v for k, v in original["verdicts"].items() if k not in JUDGED_DIFFERENTLY_SINCE_THE_RUN}
        assert {k: replayed["verdicts"][k] for k in same} == same
    final = {g["name"]: g for g in out["gates"]}
    for gate in stored["gates"]:
        mine = final[gate["name"]]
        assert mine["estimate"] == pytest.approx(gate["estimate"], rel=1e-12)
        if gate["name"] not in JUDGED_DIFFERENTLY_SINCE_THE_RUN:
            assert mine["verdict"] == gate["verdict"]
            if gate["name"] != "acceptance_length_floor":  # judged on a bound since this run
                assert mine["interval"] == pytest.approx(gate["interval"], rel=1e-12)
    assert final["sample_ratio"]["verdict"] == "pass"  # a gate the run predates: judged all the same
    if all(final[name]["verdict"] == "pass" for name in JUDGED_DIFFERENTLY_SINCE_THE_RUN):
        assert out["decision"] == stored["decision"] and code == 0
    else:
        assert out["decision"] == "inconclusive" and code == 4


def test_ties_do_not_promote(tmp_path, capsys):
    """Latencies that are all equal between the arms show no improvement: never PROMOTE. The control,
    the same config with a canary 30% faster, promotes (so the ties, not the config, decide)."""
    config = run_config(tmp_path, ["tpot_p50_improvement", "sample_ratio"])
    tie = np.full(200, 0.03)
    records = write_records(tmp_path / "ties.jsonl", {"baseline": tie, "canary": tie})
    code, [out] = judged(capsys, str(records), "--config", str(config))
    assert out["decision"] != "promote" and code != 0
    rng = np.random.default_rng(1)
    n = 640  # the config's warm-up (one look) and its 600 planned per arm
    faster = write_records(tmp_path / "faster.jsonl", {"baseline": rng.lognormal(np.log(0.03), 0.2, n),
                                                       "canary": rng.lognormal(np.log(0.021), 0.2, n)},
                           ttft_by_arm={arm: rng.lognormal(np.log(0.05), 0.3, n) for arm in ("baseline", "canary")})
    code, [out] = judged(capsys, str(faster), "--config", str(config))
    assert out["decision"] == "promote" and code == 0, out["reason"]


def test_a_canary_that_drops_its_slowest_requests_as_errors_does_not_promote(tmp_path, capsys):
    """A canary 6% faster than the baseline (short of the 10% objective) whose slowest 30% of requests
    fail: judged on its successes alone its TPOT p50 ratio is 0.69 (bounds [0.58, 0.83]) and the judge
    before the latency judge's +inf-errors rule promoted it (seen at commit dc03cf1). Errors are the
    slowest possible latency, so it must not PROMOTE. Only the objective is enabled, so the error-rate
    guard cannot stand in for that rule."""
    rng = np.random.default_rng(0)
    baseline = rng.lognormal(np.log(0.030), 0.4, 200)
    canary = rng.lognormal(np.log(0.0282), 0.4, 200)
    dropped = canary >= np.quantile(canary, 0.7)
    records = write_records(tmp_path / "dropped.jsonl", {"baseline": baseline, "canary": canary}, {"canary": dropped})
    config = run_config(tmp_path, ["tpot_p50_improvement"])
    code, [out] = judged(capsys, str(records), "--config", str(config))
    assert out["decision"] != "promote" and code != 0, out["reason"]


def test_a_bare_records_file_cannot_pass_acceptance_or_the_missing_accuracy_gates(tmp_path, capsys):
    """Fail closed: without decision.json there are no spec-decode counters and no eval outcomes, so with the
    default gates the input is INCONCLUSIVE, and the reason names the gates and gates.disabled."""
    rng = np.random.default_rng(3)
    records = write_records(tmp_path / "r.jsonl", {"baseline": rng.lognormal(np.log(0.03), 0.2, 200),
                                                   "canary": rng.lognormal(np.log(0.02), 0.2, 200)})
    code, [out] = judged(capsys, str(records), "--config", str(run_config(tmp_path, None)))
    assert out["decision"] == "inconclusive" and code == 4
    assert {g["name"]: g["verdict"] for g in out["gates"]}["acceptance_length_floor"] == "inconclusive"
    assert "accuracy_noninferiority, output_divergence" in out["reason"] and "gates.disabled" in out["reason"]
    assert any("spec-decode" in note for note in out["notes"])


def test_records_with_their_own_acceptance_are_judged_on_it_look_by_look(tmp_path, capsys):
    """Records of servers with --per-request-spec-decode-metrics carry each request's verify steps: a bare
    records file then judges the acceptance floor on them (passing for good drafts, failing for bad ones)."""
    rng = np.random.default_rng(4)
    config = run_config(tmp_path, ["tpot_p50_improvement", "acceptance_length_floor"])
    for histogram, verdict in (([0, 0, 0, 8], "pass"), ([6, 2, 0, 0], "fail")):
        path = write_records(tmp_path / "r.jsonl", {"baseline": rng.lognormal(np.log(0.03), 0.1, 400),
                                                    "canary": rng.lognormal(np.log(0.02), 0.1, 400)})
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            if row["arm"] == "canary" and row["ok"]:
                row.update(acceptance_histogram=histogram, draft_tokens=3 * sum(histogram))
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        code, [out] = judged(capsys, str(path), "--config", str(config))
        assert {g["name"]: g["verdict"] for g in out["gates"]}["acceptance_length_floor"] == verdict, out
        assert not any("spec-decode" in note for note in out["notes"])


def test_the_cli_routes_judge_and_prints_a_table(capsys):
    code = cli.main(["judge", str(REAL_RUN)])
    out = capsys.readouterr().out
    assert code == judge_command.main([str(REAL_RUN)]) and code in (0, 3, 4)
    assert out.startswith(f"{REAL_RUN}: ") and "sample_ratio" in out and "acceptance_length_floor" in out


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "no such file"),
        ('{"request_id": "a", "tag": "t", "worker": "w", "sent_at": 1, "e2e_s": 1, "ok": true, "status": 200}\n\n{oops\n',
         ":3: not JSON"),
        ('{"request_id": "a", "tag": "t", "worker": "w", "sent_at": 1, "ok": true, "status": 200}\n',
         ":1: not a request record: e2e_s"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, expected):
    path = tmp_path / "records.jsonl"
    if content is not None:
        path.write_text(content)
    assert judge_command.main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], captured.err


def test_a_run_directory_without_its_decision_is_bad_input(tmp_path, capsys):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "records.jsonl").write_text("")
    assert judge_command.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decision.json" in err[0]


def test_without_the_runs_looks_the_boundary_rule_places_them_on_the_records_clock():
    """A bare records file: a look falls at the first record at which every arm has requests_per_look more
    completed requests and window_s has passed on the records' completion clock (LookPlan.look_due)."""
    from loadtests.records import RequestRecord
    from rollout.judge.config import GatesConfig
    from rollout.judge.experiment_looks import LookPlan, replay_looks

    rows = []
    for i in range(60):  # one pair every second, each request 0.5 s long
        for arm in ("baseline", "canary"):
            rows.append(RequestRecord(request_id=f"{arm}{i}", tag="experiment", worker="w", arm=arm, sent_at=float(i),
                                      ttft_s=0.1, e2e_s=0.5, output_tokens=8, ok=True, status=200))
    plan = LookPlan(requests_per_look=10, requests_per_arm=50, min_interval_s=15.0, min_looks=5, max_duration_s=1e9)
    replay = replay_looks(rows, plan, GatesConfig(enabled=["sample_ratio"]), None, False)
    # the window, not the count, is binding: look 1 at baseline 15's end (t=15.5: 16 vs 15 done), look 2 at
    # baseline 30's (t=30.5), ... the information fraction is the least-served arm's share of the plan
    assert [k.requests for k in replay.looks][:2] == [{"baseline": 16, "canary": 15}, {"baseline": 15, "canary": 15}]
    assert [k.information for k in replay.looks][:2] == [pytest.approx(15 / 50), pytest.approx(30 / 50)]
    assert replay.stopped_by in ("information", "end of records")


def _pairs(n: int, ttft_s=lambda i: 0.1) -> list[RequestRecord]:
    """n pairs of completed requests, one pair a second, in arrival order."""
    return [RequestRecord(request_id=f"{arm}{i}", tag="experiment", worker="w", arm=arm, sent_at=float(i),
                          ttft_s=ttft_s(i), e2e_s=0.5, output_tokens=8, ok=True, status=200)
            for i in range(n) for arm in ("baseline", "canary")]


def test_the_warm_up_ends_at_the_record_that_gives_every_arm_its_count():
    from rollout.judge.experiment_looks import LookPlan, warmup_end

    plan = LookPlan(requests_per_look=10, requests_per_arm=30, min_interval_s=0, min_looks=1, max_duration_s=1e9,
                    warmup_requests_per_arm=10)
    rows = _pairs(40)
    assert warmup_end(rows, plan) == 20  # canary 9, the 20th record
    # an arm that lags: the other arm's extra requests before the end are warm-up too, and a
    # cancelled request is no evidence (it counts for neither)
    lagging = [r for r in rows[:40] if r.arm == "baseline"] + [r for r in rows[:40] if r.arm == "canary"]
    lagging[25] = lagging[25].model_copy(update={"cancelled": True})
    assert warmup_end(lagging, plan) == 31  # all 20 baseline, then canary 0..10 with canary 5 cancelled
    assert warmup_end(rows[:19], plan) is None  # not over yet
    assert warmup_end(rows, LookPlan(10, 30, 0, 1, 1e9)) == 0  # no warm-up


def test_a_replay_with_a_warm_up_judges_what_follows_it_as_a_run_without_one():
    from rollout.judge.config import GatesConfig
    from rollout.judge.experiment_looks import LookPlan, replay_looks

    # the warm-up's first-request TTFTs are 20x the rest: judged, they would move the TTFT p95
    rows = _pairs(60, ttft_s=lambda i: 2.0 if i < 10 else 0.1 + 0.001 * (i % 7))
    cfg = GatesConfig(enabled=["ttft_p95_guard", "sample_ratio"], min_requests_per_arm=5)
    warm = LookPlan(10, 40, 0, 4, 1e9, warmup_requests_per_arm=10)
    cold = LookPlan(10, 40, 0, 4, 1e9)
    with_warmup = replay_looks(rows, warm, cfg, None, False)
    after_it = replay_looks(rows[20:], cold, cfg, None, False)
    assert with_warmup.warmup_records == 20 and after_it.warmup_records == 0
    assert [(k.look, k.information, k.requests) for k in with_warmup.looks] == [
        (k.look, k.information, k.requests) for k in after_it.looks]
    assert [g.model_dump() for g in with_warmup.gates] == [g.model_dump() for g in after_it.gates]
    assert with_warmup.looks[0].requests == {"baseline": 10, "canary": 10}
    assert with_warmup.judged_records + with_warmup.unjudged_records + with_warmup.warmup_records == len(rows)
    # the same records judged without the warm-up see the slow first requests
    judged_cold = replay_looks(rows, cold, cfg, None, False)
    assert [g.model_dump() for g in judged_cold.gates] != [g.model_dump() for g in with_warmup.gates]
    # records that end inside the warm-up give no look, and say so
    short = replay_looks(rows[:15], warm, cfg, None, False)
    assert short.looks == [] and "warm-up" in short.stopped_by and short.unjudged_records == 15


def test_a_run_with_a_warm_up_is_replayed_with_it_and_another_warm_up_is_another_plan(tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(REAL_RUN, run)
    doc = json.loads((run / "decision.json").read_text())
    # as if the run had had a warm-up of 20 per arm and stopped at its second look: the stored
    # looks then follow the warm-up's records (this recording holds three looks' worth in all)
    looks = doc["experiment"]["looks"] = doc["experiment"]["looks"][:2]
    doc["experiment"]["warmup_requests_per_arm"] = 20
    (run / "decision.json").write_text(json.dumps(doc))
    inp = replay.load_input(str(run), None)
    assert inp.plan.warmup_requests_per_arm == 20 and inp.stored_counts == [dict(k["requests"]) for k in looks]
    replayed = replay.judge_input(inp).replay
    assert replayed.warmup_records >= 40 and replayed.looks[0].requests == looks[0]["requests"]
    # a --config with no warm-up is another plan: looks by the boundary rule, and a note says so
    config = tmp_path / "no-warmup.yaml"
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["experiment"]["warmup_requests_per_arm"] = 0  # the default is one look's worth
    config.write_text(yaml.safe_dump(data))
    from rollout.config import load_config

    other = replay.load_input(str(run), load_config(config))
    assert other.plan.warmup_requests_per_arm == 0 and other.stored_counts is None
    assert any("look plan differs" in note for note in other.notes)


def _with_prefix_counters(tmp_path: Path, rates: dict[str, list[float]] | None) -> Path:
    """REAL_RUN judged by the prefix-cache gate as well, its looks carrying each arm's cumulative
    (hits, queried tokens) at the given per-look hit rates (None: a run written before looks held them)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(REAL_RUN, run)
    doc = json.loads((run / "decision.json").read_text())
    doc["gates_config"]["prefix_cache_max_drop"] = 0.2
    for i, look in enumerate(doc["experiment"]["looks"]):
        if rates is not None:
            look["prefix_cache"] = {arm: [sum(2000.0 * r for r in per_look[: i + 1]), 2000.0 * (i + 1)]
                                    for arm, per_look in rates.items()}
    (run / "decision.json").write_text(json.dumps(doc))
    return run


@pytest.mark.parametrize(("canary_rates", "verdict"), [([0.58, 0.63, 0.59], "pass"), ([0.11, 0.08, 0.12], "fail")])
def test_the_prefix_cache_gate_is_rejudged_from_the_runs_counters_at_its_looks(tmp_path, capsys, canary_rates, verdict):
    """decision.json keeps each arm's prefix-cache counters at every look, so `judge` judges the gate as the
    run did: a canary hitting as the baseline (~0.6) passes, one hitting ~0.1 fails and rolls back."""
    run = _with_prefix_counters(tmp_path, {"baseline": [0.6, 0.61, 0.6], "canary": canary_rates})
    code, [out] = judged(capsys, str(run))
    gate = next(g for g in out["gates"] if g["name"] == "prefix_cache_guard")
    assert gate["verdict"] == verdict, gate["detail"]
    assert gate["n_baseline"] == gate["n_canary"] == 6000
    if verdict == "fail":
        assert out["decision"] == "rollback" and code == 3


def test_a_run_without_prefix_counters_cannot_pass_the_prefix_cache_gate(tmp_path, capsys):
    run = _with_prefix_counters(tmp_path, None)
    code, [out] = judged(capsys, str(run))
    gate = next(g for g in out["gates"] if g["name"] == "prefix_cache_guard")
    assert gate["verdict"] == "inconclusive" and out["decision"] != "promote" and code != 0
    assert any("no prefix-cache counters" in note for note in out["notes"])
    # counters that are not [hits, queries] are a bad input, named
    run = _with_prefix_counters(tmp_path / "bad", {"baseline": [0.6] * 3, "canary": [0.6] * 3})
    doc = json.loads((run / "decision.json").read_text())
    doc["experiment"]["looks"][1]["prefix_cache"]["canary"] = "many"
    (run / "decision.json").write_text(json.dumps(doc))
    assert judge_command.main([str(run)]) == 2
    assert "experiment.looks[2].prefix_cache.canary: not [hits, queries]" in capsys.readouterr().err
