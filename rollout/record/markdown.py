"""The run's record for machines and people: decision.json, report.md, report.html (rollout.record.html),
junit.xml and metrics.prom (rollout.record.pipeline_artifacts)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollout.record.atomic_file import write_atomically
from rollout.judge.config import SloConfig
from rollout.judge.names import OBJECTIVE_NAME
from rollout.analysis.load_sweep import crossover_line, promote_up_to_line, sweep_table
from rollout.record.pipeline_artifacts import write_pipeline_artifacts
from rollout.record.document import DecisionDocument, GateRecord
from rollout.record.html import write_html_report
from rollout.record.result import ExperimentSummary, RunResult, decision_document, wholly_ejected_line


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_report(doc: DecisionDocument | Mapping[str, Any]) -> str:
    """report.md: decision.json for people, section by section (a mapping is read as decision.json first)."""
    doc = DecisionDocument.of(doc)
    lines: list[str] = []
    for section in (_arms, _candidates, _gates, _plan, _spec_decode, _latency, _sweep, _progressive, _accuracy, _engine_warnings,
                    _timeline):
        lines += section(doc)
    return "\n".join(lines) + "\n"


def _arms(doc: DecisionDocument) -> list[str]:
    lines = [
        f"# mtp-canary run {doc.run_id}",
        "",
        f"**Decision: {str(doc.decision).upper()}** (exit code {doc.exit_code})",
        "",
        f"{doc.reason}",
        "",
        "## Arms",
        "",
        "| arm | replicas | model | speculative config |",
        "|---|---|---|---|",
    ]
    for arm, info in doc.arms.items():
        engine = info.engine
        lines.append(
            f"| {arm} | {info.replicas} | `{engine['model']}` | `{json.dumps(engine.get('speculative_config'))}` |"
        )
    out = wholly_ejected_line({"wholly_ejected": doc.wholly_ejected})
    if out:
        lines += ["", f"**An arm was out**: {out}."]
    prepare = doc.prepare
    if prepare.tiny_model:
        lines += ["", f"Tiny model: {prepare.tiny_model.get('reason', prepare.tiny_model)}"]
    if prepare.core_sharing:
        lines += ["", f"**Arms share CPU cores**: {prepare.core_sharing}; latencies include their contention."]
    elif any((prepare.cpu_cores or {}).values()):
        lines += ["", "CPU cores per replica: " + ", ".join(f"{n} -> {c}" for n, c in prepare.cpu_cores.items())]
    if prepare.load_placement:
        lines += ["", f"**Load placement**: {prepare.load_placement}."]
    lines += _kv_cache(doc)
    usage = doc.usage
    if usage:
        lines += ["", f"Held: {usage.replicas} replica(s), {usage.gpus} GPU(s), for {usage.held_s / 60:.1f} min "
                      f"(fleet start to decision): {usage.gpu_hours:g} GPU-hours, {usage.replica_hours:g} replica-hours"]
    return lines


def _candidates(doc: DecisionDocument) -> list[str]:
    """A run with candidates: each one's verdict at its share of alpha, and why it won or lost."""
    candidates = doc.candidates
    if not candidates:
        return []
    lines = ["", f"## Candidates (winner: {doc.winner or 'none'})", "",
             "Each candidate is judged against the baseline at alpha / K (Bonferroni); the winner has the lowest "
             "TPOT p50 ratio among those that passed (within 2%: the one drafting fewer tokens).", "",
             "| candidate | speculation | alpha | verdict | TPOT p50 ratio | why |", "|---|---|---|---|---|---|"]
    for c in candidates:
        ratio = next((g.estimate for g in c.gates if g.name == OBJECTIVE_NAME), None)
        lines.append(f"| {c.name} | {c.speculation or f'k={c.speculative_tokens}'} | {_num(c.alpha, 4)} | **{c.decision}** | "
                     f"{_num(ratio)} | {c.reason} |")
    if doc.winner_note:
        lines += ["", f"Note: {doc.winner_note}"]
    for c in candidates:
        lines += ["", f"### {c.name}: gates", ""] + _gate_table(c.gates)
    return lines


def _plan(doc: DecisionDocument) -> list[str]:
    """What the plan could decide (decision.json detectable_effect) and earlier attempts at the comparison."""
    effects, attempts = doc.detectable_effect or {}, doc.attempts
    if not effects and not attempts:
        return []
    lines = ["", "## What the plan could decide", ""]
    lines += [f"- {e.text}" for e in effects.values()]
    lines += [f"- **Warning**: {e.warning}" for e in effects.values() if e.warning]
    if attempts:
        inconclusive = attempts.inconclusive_before
        lines += ["", f"Attempt {attempts.number} at this comparison (arms {attempts.comparison})"
                  + (f", judged INCONCLUSIVE before in {', '.join(inconclusive)}" if inconclusive else "")
                  + f": the attempts together bound a false promote by {attempts.alpha_spent_together:g} "
                  "(the sum of their alphas)."]
    return lines


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _kv_cache(doc: DecisionDocument) -> list[str]:
    """Per arm, the KV cache during the experiment (arms.<arm>.kv); nothing for a run without one."""
    kv = {arm: info.kv for arm, info in doc.arms.items() if info.kv}
    if not kv:
        return []
    lines = ["", "KV cache during the experiment (from each replica's /metrics):", "",
             "| arm | usage peak | usage mean | preemptions | capacity per replica (tokens) | GPU blocks x block size | "
             "prefix-cache hit rate (tokens) | samples |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, k in kv.items():
        blocks = f"{k.num_gpu_blocks:g} x {k.block_size:g}" if k.num_gpu_blocks and k.block_size else "n/a"
        preempted = "n/a" if k.preemptions is None else f"{k.preemptions:g}"
        capacity = "n/a" if k.capacity_tokens is None else f"{k.capacity_tokens:g}"
        # a decision.json written before the prefix-cache counters has none: n/a
        hits, queried = k.prefix_cache_hit_rate, k.prefix_cache_queries
        hit_rate = "n/a" if hits is None else f"{_pct(hits)} of {queried:g}"
        lines.append(f"| {arm} | {_pct(k.usage_peak)} | {_pct(k.usage_mean)} | {preempted} | {capacity} | "
                     f"{blocks} | {hit_rate} | {k.samples} |")
    return lines


def _gates(doc: DecisionDocument) -> list[str]:
    return ["", "## Gates", ""] + _gate_table(doc.gates)


def _gate_table(gates: list[GateRecord]) -> list[str]:
    lines = ["| gate | metric | baseline | canary | estimate | interval | threshold | verdict |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for g in gates:
        interval = f"[{_num(g.interval[0])}, {_num(g.interval[1])}]" if g.interval else "n/a"
        lines.append(
            f"| {g.name} | {g.metric} | {_num(g.baseline)} | {_num(g.canary)} | {_num(g.estimate)} "
            f"| {interval} | {_num(g.threshold)} | **{g.verdict}** |"
        )
    details = [f"- `{g.name}`: {g.detail}" for g in gates if g.detail]
    if details:
        lines += [""] + details
    return lines


def _acceptance_slices(doc: DecisionDocument) -> list[str]:
    """Each speculating arm's acceptance by prompt length and by turn, where it varies (rollout.analysis.acceptance_slices)."""
    rows = []
    for arm, sd in doc.spec_decode.items():
        for slices in (sd.by_prompt_length, sd.by_turn):
            if len(slices) < 2:  # one slice is the arm's own figure again
                continue
            for s in slices:
                per_pos = ", ".join(f"{p:.3f}" for p in s.per_position) or "n/a"
                rows.append(f"| {arm} | {s.slice} | {s.requests} | {_num(s.drafts, 0)} "
                            f"| {_num(s.mean_acceptance_length)} | {per_pos} |")
    if not rows:
        return []
    return ["", "Acceptance by prompt length and by turn (the requests' own counters; descriptive, no gate):", "",
            "| arm | slice | requests | drafts | mean acceptance length | per position |", "|---|---|---|---|---|---|",
            *rows]


def _spec_decode(doc: DecisionDocument) -> list[str]:
    if not doc.spec_decode:
        return []
    sources = {sd.counted_from for sd in doc.spec_decode.values()}
    title = ("the experiment's own requests (vLLM per-request metrics), judged looks" if sources == {"requests"}
             else "server /metrics deltas over the experiment")
    lines = ["", f"## Speculative decoding ({title})", ""]
    lines += ["| arm | acceptance rate | mean acceptance length | per position | drafts |", "|---|---|---|---|---|"]
    for arm, sd in doc.spec_decode.items():
        per_pos = ", ".join(f"{p:.3f}" for p in sd.per_position) if sd.per_position else "n/a"
        lines.append(
            f"| {arm} | {_num(sd.acceptance_rate)} | {_num(sd.mean_acceptance_length)} | {per_pos} | {_num(sd.drafts, 0)} |"
        )
    for arm, sd in doc.spec_decode.items():
        if sd.counted_from == "requests" and sd.server_mean_acceptance_length is not None:
            lines.append(f"\n{arm}'s server counted {_num(sd.server_drafts, 0)} verify steps over the phase "
                         f"(mean acceptance length {_num(sd.server_mean_acceptance_length)}, every client's).")
        if sd.other_traffic:
            lines.append(f"\n**Warning**: {sd.other_traffic}.")
    lines += _acceptance_slices(doc)
    for arm, sd in doc.spec_decode.items():
        if sd.expected_length_by_k:
            by_k = ", ".join(f"k={k}: {_num(v)}" for k, v in sd.expected_length_by_k.items())
            lines.append(f"\nExpected acceptance length of {arm} had it drafted fewer tokens: {by_k}")
    advice = doc.experiment.depth_advice if doc.experiment else None
    if advice:
        lines += ["", "### Which depth (predicted from the acceptance profile and the arms' step costs)", ""]
        lines += ["| k | acceptance length | TPOT p50 predicted (ms) | 95% interval | measured | vs best |",
                  "|---|---|---|---|---|---|"]
        for p in advice.predictions:
            interval = f"[{p.interval_ms[0]:.1f}, {p.interval_ms[1]:.1f}]" if p.interval_ms else "n/a"
            lines.append(f"| {p.k} | {p.acceptance_length:.3f} | {p.tpot_ms:.1f} | {interval} "
                         f"| {_num(p.measured_tpot_ms, 1)} | {p.vs_best:.3f} |")
        lines.append(f"\n{advice.text} (step cost {advice.fixed_step_ms:.1f} ms + {advice.per_draft_ms:.1f} ms "
                     "per draft token; rollout/analysis/depth_advice.py says what the prediction assumes).")
    return lines


def _latency(doc: DecisionDocument) -> list[str]:
    exp = doc.experiment
    if not exp or not exp.latency_ms:
        return []
    lines = ["", "## Latency (client side, ms, per request)", ""]
    lines += ["| arm | requests | TTFT p50 | TTFT p95 | TPOT p50 | TPOT p95 | E2E p50 | E2E p95 | tokens/chunk |"]
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for arm, lat in exp.latency_ms.items():
        lines.append(
            f"| {arm} | {exp.requests.get(arm)} | {_num(lat['ttft_p50'], 1)} | {_num(lat['ttft_p95'], 1)} "
            f"| {_num(lat['tpot_p50'], 2)} | {_num(lat['tpot_p95'], 2)} | {_num(lat['e2e_p50'], 1)} | {_num(lat['e2e_p95'], 1)} "
            f"| {_num(exp.client_tokens_per_chunk.get(arm), 2)} |"
        )
    lines.append(f"\nGenerator send lag p99: {_num(exp.generator_send_lag_p99_ms, 1)} ms")
    lines += _goodput(exp, doc.gates_config)
    if exp.looks:
        lines.append(
            f"\nOne continuous load: {len(exp.looks)} of {exp.planned_looks} planned looks "
            f"(every {exp.requests_per_look} requests per arm; information {_num(exp.information)}), "
            f"stopped by {exp.stopped_by}; duty cycle {_num(exp.duty_cycle)}; "
            f"router received {exp.requests_received} requests, {exp.records_stored} records stored."
        )
    if exp.warmup_requests_per_arm:  # absent from runs without a warm-up: their report reads as before
        counts = ", ".join(f"{arm} {n}" for arm, n in exp.warmup_requests.items())
        lines.append(f"\nWarm-up: the first {exp.warmup_requests_per_arm} completed requests of every arm "
                     f"({counts}) are stored, not judged, and not in the table above.")
    if exp.judged_load:  # absent from runs written before it
        lines.append(f"\nJudged load: {exp.judged_load.text}. The verdict holds at this load.")
    if dep := exp.dependence:
        ac = dep.autocorrelation
        lines.append(
            f"\nDependence across {dep.looks} looks (TPOT p50): lag-1 autocorrelation baseline {_num(ac.get('baseline'))}, "
            f"canary {_num(ac.get('canary'))}, contrast {_num(ac.get('contrast'))}; design effect over independent looks "
            f"{_num(dep.design_effect)}. The intervals hold for look-to-look correlation up to "
            f"{dep.look_correlation_max:g} (gates.look_correlation_max)."
        )
    if exp.generator_warnings:
        lines += ["", "**The load generator limited the load** (latencies include client-side delay):", ""]
        lines += [f"- {w}" for w in exp.generator_warnings]
    return lines


def _goodput(exp: ExperimentSummary, gates_config: dict[str, Any]) -> list[str]:
    """One line per arm: the share of judged requests that met gates.slo (absent without an SLO)."""
    if not exp.goodput:
        return []
    try:
        slo = f": {SloConfig.model_validate(gates_config.get('slo') or {}).text()}"
    except ValidationError:  # a document edited by hand: the counts still stand
        slo = ""
    lines = ["", f"Goodput (judged requests meeting the SLO{slo}; failed requests miss it):"]
    for arm, g in exp.goodput.items():
        lines.append(f"- {arm}: {_num(g.share)} ({g.met} of {g.of} requests)")
    return lines


def _sweep(doc: DecisionDocument) -> list[str]:
    exp = doc.experiment
    if not exp or not exp.sweep:
        return []
    lines = ["", "## Speedup vs load (sweep, no gate)", ""]
    # the sweep's own table and crossover line read rows as decision.json holds them
    lines += sweep_table([row.document() for row in exp.sweep], ("baseline", "canary"))
    lines.append("\nTPOT from usage tokens per request; tokens/chunk is the client's view of the acceptance length.")
    if exp.sweep_crossover:
        lines.append(crossover_line(exp.sweep_crossover.document()))
    if doc.promote_up_to:
        lines.append("\n" + promote_up_to_line(doc.promote_up_to))
    return lines


def _progressive(doc: DecisionDocument) -> list[str]:
    prog = doc.progressive
    if not prog or not prog.observed_split:
        return []
    lines = ["", "## Progressive steps", "", "| step | canary weight | observed canary share (router) | requests routed |",
             "|---|---|---|---|"]
    for s in prog.observed_split:
        share = s.observed_canary_share
        routed = sum(s.routed.values())
        lines.append(f"| {s.step + 1} | {s.canary_weight:g}% | {'n/a' if share is None else f'{share * 100:.1f}%'} | {routed} |")
    if prog.requests_received is not None:
        lines.append(f"\nRequests the router received in the phase: {prog.requests_received}; "
                     f"request records stored: {prog.records_stored}.")
    if prog.advisory:
        lines.append(f"\nThe steps are {prog.advisory}.")
    return lines


def _accuracy(doc: DecisionDocument) -> list[str]:
    acc = doc.accuracy
    if not acc:
        return []
    lines = ["", "## Accuracy", "", f"{acc.items} of {acc.planned_items} {acc.kind} items, greedy, identical for every arm."]
    lines += [""] + [f"- {arm}: accuracy {_num(v)}" for arm, v in acc.accuracy.items()]
    lines += [f"- {arm} vs baseline: outputs differ on {_num(v)} of items" for arm, v in acc.divergence_vs_baseline.items()]
    return lines


def _engine_warnings(doc: DecisionDocument) -> list[str]:
    warnings = {k: v for k, v in (doc.preflight.notable_warnings if doc.preflight else {}).items() if v}
    if not warnings:
        return []
    lines = ["", "## Engine warnings (from the replica logs)", ""]
    for replica, msgs in warnings.items():
        lines += [f"- {replica}: {m}" for m in msgs]
    return lines


def _timeline(doc: DecisionDocument) -> list[str]:
    lines = ["", "## Timeline", "", "| time | phase | canary weight | event | reason |", "|---|---|---|---|---|"]
    for e in doc.timeline:
        when = time.strftime("%H:%M:%S", time.localtime(e.time))
        lines.append(f"| {when} | {e.phase} | {_num(e.canary_weight, 0)} | {e.event} | {e.reason} |")
    return lines


def write_reports(result: RunResult) -> dict[str, Path]:
    run_dir = Path(result.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    doc = decision_document(result)
    decision_path = run_dir / "decision.json"
    write_atomically(decision_path, json.dumps(doc, indent=2, default=str))
    # the renderings read the document as written, typed, as `mtp-canary report` reads it back
    return {"decision": decision_path, **_write_derived(DecisionDocument.of(doc), run_dir)}


def _write_derived(doc: DecisionDocument, run_dir: Path) -> dict[str, Path]:
    """Everything made from decision.json: report.md, junit.xml, metrics.prom, report.html."""
    report_path = run_dir / "report.md"
    write_atomically(report_path, markdown_report(doc))
    pipeline = write_pipeline_artifacts(doc, run_dir)  # junit.xml and metrics.prom, for CI and dashboards
    # last: the page reads the run's records too, and the files above stand whatever it holds
    try:
        html_path = write_html_report(doc, run_dir)
    except Exception as exc:  # noqa: BLE001 - a page that cannot be drawn must not turn a decided run into a crash
        html_path = run_dir / "report.html"
        write_atomically(html_path, plain_html_page(doc, exc))
    return {"report": report_path, **pipeline, "html": html_path}


def plain_html_page(doc: DecisionDocument, exc: BaseException) -> str:
    """report.html when the figures cannot be drawn: the decision, and why the page is bare."""
    from html import escape

    decision = escape(str(doc.decision or "error"))
    reason = escape(str(doc.error or doc.reason or ""))
    cause = escape(f"{type(exc).__name__}: {exc}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(str(doc.run_id))}</title></head>"
            f"<body><h1>{decision.upper()}</h1><p>{reason}</p><p>The figures could not be drawn ({cause}); "
            f"decision.json and report.md hold the whole record.</p></body></html>\n")


def regenerate_reports(run_dir: Path) -> dict[str, Path]:
    """report.md, junit.xml, metrics.prom and report.html again from a run's decision.json (left as it is)."""
    return _write_derived(DecisionDocument.read(Path(run_dir)), Path(run_dir))
