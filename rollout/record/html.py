"""report.html: decision.json for a person with a minute, with its evidence drawn.

One self-contained file beside decision.json: the decision and why in one sentence at
the top, then the gates and, where the run holds the data, the plots behind them
(latency ECDFs per arm, the objective's interval look by look, acceptance per draft
position, speedup vs load, the progressive timeline). Plots are matplotlib SVG inlined
in the page, so it opens from a file, an artifact store or a mail without any network.

Data come from decision.json (`doc`, the typed rollout.record.document.DecisionDocument) and, for what it does not hold, the run
directory's request records: the experiment's (ECDFs; the looks re-judged with the
controller's own replay, `mtp-canary judge`) and the sweep's (intervals of the speedup).
A missing or unreadable records file costs its plots only: the page says so.

Every string from the run (model names, reasons, engine warnings, config values) is
user input and goes through `html.escape`; the page carries no script.
"""

from __future__ import annotations

import html
import io
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from loadtests.records import RequestRecord, read_records
from rollout.record.atomic_file import write_atomically
from rollout.record.document import DecisionDocument
from rollout.record.result import wholly_ejected_line
from rollout.judge.latency import latency_samples_from_records
from rollout.judge.names import ACCURACY_NAME, DIVERGENCE_NAME, OBJECTIVE_NAME
from rollout.judge.stats import mover_log_ratio_bounds, quantile_band
from rollout.analysis.load_sweep import promote_up_to_line
from rollout.analysis.replay import BadInput, judge_input, load_input

__all__ = ["html_report", "write_html_report", "expected_lengths"]

EXPERIMENT_RECORDS = Path("experiment") / "records.jsonl"
SWEEP_RECORDS = Path("sweep") / "records.jsonl"
ARM_COLORS = {"baseline": "#1f77b4", "canary": "#d62728"}
VERDICT_COLORS = {"pass": "#2ca02c", "fail": "#d62728", "inconclusive": "#ff7f0e"}
SWEEP_LEVEL = 0.025  # each side: the sweep's intervals are 95% two-sided, per level (no gate reads them)
_WINDOW = re.compile(r"^window (\d+) step (\d+): (.*)$")
_DISCORDANT = re.compile(r"discordant (\d+) vs (\d+)")

STYLE = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:1em auto;padding:0 1em;color:#222}
#decision{font-size:1.25em;padding:.6em .8em;border-left:6px solid #888;background:#f5f5f5}
#decision.promote{border-color:#2ca02c}#decision.rollback{border-color:#d62728}
#decision.inconclusive,#decision.error{border-color:#ff7f0e}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;font-size:.9em}
td.pass{color:#2ca02c;font-weight:bold}td.fail{color:#d62728;font-weight:bold}td.inconclusive{color:#b35900}
figure{margin:.5em 0}figure svg{max-width:100%;height:auto}.note{color:#555}
"""


# -- numbers and text -------------------------------------------------------------------------
def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def _one_line(text: Any, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], verdict_col: int | None = None) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = f' class="{_esc(cell)}"' if i == verdict_col and cell in VERDICT_COLORS else ""
            cells.append(f"<td{cls}>{_esc(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _note(text: str) -> str:
    return f'<p class="note">{_esc(text)}</p>'


def _figure(fig_id: str, fig: Figure, caption: str) -> str:
    """The figure as inline SVG: text stays text (svg.fonttype none keeps it small), ids fixed per page."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": fig_id}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline SVG takes neither
    return f'<figure id="{_esc(fig_id)}">{svg}<figcaption>{_esc(caption)}</figcaption></figure>'


def _arms(doc: DecisionDocument) -> list[str]:
    """The arms that took the experiment's load (with candidates, the canary's seat is the winner's
    arm again: its records carry the candidate's name)."""
    arms = list(doc.arms) or ["baseline", "canary"]
    return [a for a in arms if a != "canary"] if doc.candidates else arms


# -- the decision, one sentence -----------------------------------------------------------------
def decision_sentence(doc: DecisionDocument | Mapping[str, Any]) -> str:
    """Decision, why, how the evidence stopped, and the gates that decided it (failing, else open)."""
    doc = DecisionDocument.of(doc)
    decision = str(doc.decision or "error").upper()
    parts = [f"{decision} (exit code {doc.exit_code}): {_one_line(doc.reason or '')}"]
    exp = doc.experiment
    if exp and exp.looks:
        parts.append(f"the experiment stopped by {exp.stopped_by} at look {len(exp.looks)} of {exp.planned_looks}")
    gates = doc.gates
    deciding = [g for g in gates if g.verdict == "fail"]
    if not deciding and doc.decision != "promote":
        deciding = [g for g in gates if g.verdict == "inconclusive"]
    if not deciding and doc.decision == "promote":
        deciding = [g for g in gates if g.name == OBJECTIVE_NAME]
    for g in deciding:
        interval = g.interval
        bounds = f" [{_num(interval[0])}, {_num(interval[1])}]" if interval else ""
        parts.append(f"{g.name} {g.verdict}: {g.metric} {_num(g.estimate)}{bounds} "
                     f"vs threshold {_num(g.threshold)}")
    return "; ".join(parts) + "."


def _decision(doc: DecisionDocument, run_dir: Path) -> list[str]:
    cls = doc.decision or "error"
    out = wholly_ejected_line({"wholly_ejected": doc.wholly_ejected})
    return [f'<h1>mtp-canary run {_esc(doc.run_id)} ({_esc(doc.name)})</h1>',
            f'<p id="decision" class="{_esc(cls)}">{_esc(decision_sentence(doc))}</p>'] + ([_note(f"An arm was out: {out}.")] if out else [])


def _candidates(doc: DecisionDocument, run_dir: Path) -> list[str]:
    """A run with candidates: each one's verdict at alpha / K, its TPOT p50 ratio, and why it won or lost."""
    candidates = doc.candidates or []
    if not candidates:
        return []
    rows = [[c.name, c.speculation or f"k={c.speculative_tokens}", _num(c.alpha, 4),
             _num(next((g.estimate for g in c.gates if g.name == OBJECTIVE_NAME), None)),
             c.reason, c.decision] for c in candidates]
    return [f'<h2 id="candidates">Candidates (winner: {_esc(doc.winner or "none")})</h2>',
            _note("Each candidate is judged against the baseline at alpha / K (Bonferroni); the winner has the lowest "
                  "TPOT p50 ratio among those that passed (within 2%: the one drafting fewer tokens)."),
            _table(["candidate", "speculation", "alpha", "TPOT p50 ratio", "why", "verdict"], rows, 5)] + (
        [_note(doc.winner_note)] if doc.winner_note else [])


def _plan(doc: DecisionDocument, run_dir: Path) -> list[str]:
    """What the plan could decide (detectable_effect) and earlier attempts at the comparison (attempts)."""
    effects, attempts = doc.detectable_effect or {}, doc.attempts
    if not effects and not attempts:
        return []
    out = ['<h2 id="plan">What the plan could decide</h2>']
    out += [_note(e.text) for e in effects.values()]
    out += [_note(f"Warning: {e.warning}") for e in effects.values() if e.warning]
    if attempts:
        out.append(_note(f"Attempt {attempts.number} at this comparison; the attempts together bound a false promote "
                         f"by {attempts.alpha_spent_together:g}; INCONCLUSIVE before: "
                         f"{', '.join(attempts.inconclusive_before) or 'none'}."))
    return out


def _load_placement(doc: DecisionDocument, run_dir: Path) -> list[str]:
    """A GPU run whose load shared GPU nodes with the replicas (decision.json prepare.load_placement)."""
    shared = doc.prepare.load_placement
    return [f'<p id="load-placement" class="note">Load placement: {_esc(shared)}.</p>'] if shared else []


def _gates(doc: DecisionDocument, run_dir: Path) -> list[str]:
    gates = doc.gates
    if not gates:
        return []
    rows = []
    for g in gates:
        interval = f"[{_num(g.interval[0])}, {_num(g.interval[1])}]" if g.interval else "n/a"
        rows.append([g.name, g.metric, _num(g.baseline), _num(g.canary), _num(g.estimate),
                     interval, _num(g.threshold), g.verdict])
    details = "".join(f"<li><b>{_esc(g.name)}</b>: {_esc(g.detail)}</li>" for g in gates if g.detail)
    return ['<h2 id="gates">Gates</h2>',
            _table(["gate", "metric", "baseline", "canary", "estimate", "interval", "threshold", "verdict"], rows, 7),
            f'<ul class="note">{details}</ul>' if details else ""]


# -- request records ----------------------------------------------------------------------------
class _Records:
    """A records file read once: the records, or why there are none (missing, or the first bad line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[RequestRecord] | None = None
        self.problem: str | None = None
        try:
            self.records = read_records(path)
        except FileNotFoundError:
            self.problem = f"{path.name} is absent ({path})"
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            self.problem = _one_line(f"{path} is unreadable: {exc}")


def _latency(doc: DecisionDocument, run_dir: Path) -> list[str]:
    exp = doc.experiment
    path = run_dir / EXPERIMENT_RECORDS
    if not exp and not path.exists():
        return []
    out = ['<h2 id="latency">Latency per request (client side)</h2>']
    if exp and exp.latency_ms:
        rows = [[arm, exp.requests.get(arm), *(_num(lat.get(k), 1) for k in
                ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "e2e_p50", "e2e_p95"))]
                for arm, lat in exp.latency_ms.items()]
        out.append(_table(["arm", "requests", "TTFT p50 ms", "TTFT p95 ms", "TPOT p50 ms", "TPOT p95 ms",
                           "E2E p50 ms", "E2E p95 ms"], rows))
    got = _Records(path)
    if got.records is None:
        return out + [_note(f"The request records were unreadable, so no distributions: {got.problem}.")]
    records = got.records
    samples = {arm: latency_samples_from_records(records, [1] * len(records), arm) for arm in _arms(doc)}
    fig = Figure(figsize=(11, 3.2))
    axes = fig.subplots(1, 3)
    for ax, (field, title) in zip(axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"))):
        for arm, s in samples.items():
            values = getattr(s, field) * 1000.0
            if values.size:
                ax.ecdf(values, label=f"{arm} (n={values.size})", color=ARM_COLORS.get(arm))
        ax.set_xlabel(f"{title} ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize="small")
    failed = ", ".join(f"{arm} {s.n_errors} of {s.n_total}" for arm, s in samples.items())
    out.append(_figure("fig-latency", fig, "ECDF of each arm's successful requests, both arms on one axis."))
    out.append(_note(f"Failed requests are not latencies and are left out of the curves: failed {failed} "
                     "(cancelled requests are neither)."))
    return out


# -- the looks ------------------------------------------------------------------------------------
def _replayed_objective(run_dir: Path) -> tuple[list[tuple[int, float, Any]], str | None]:
    """(look, information, objective gate) per look, re-judged from the records as `mtp-canary judge` does."""
    try:
        outcome = judge_input(load_input(str(run_dir), None))
    except BadInput as exc:
        return [], str(exc)
    rows = []
    for look in outcome.replay.looks:
        gate = next((g for g in look.gates if g.name == OBJECTIVE_NAME), None)
        if gate is not None:
            rows.append((look.look, look.information, gate))
    return rows, None


def _looks(doc: DecisionDocument, run_dir: Path) -> list[str]:
    exp = doc.experiment
    looks = exp.looks if exp else []
    if not looks:
        return []
    out = ['<h2 id="looks">Looks (one continuous load)</h2>']
    names = list(dict.fromkeys(name for k in looks for name in k.verdicts))
    rows = [[k.look, _num(k.information), ", ".join(f"{a} {n}" for a, n in k.requests.items()),
             *(k.verdicts.get(name, "") for name in names)] for k in looks]
    out.append(_table(["look", "information", "new requests", *names], rows))
    if load := exp.judged_load:
        out.append(_note(f"Judged load: {load.text}. The verdict holds at this load."))
    if dep := exp.dependence:
        ac = dep.autocorrelation
        out.append(_note(
            f"Dependence across {dep.looks} looks (TPOT p50): lag-1 autocorrelation baseline {_num(ac.get('baseline'))}, "
            f"canary {_num(ac.get('canary'))}, contrast {_num(ac.get('contrast'))}; design effect over independent looks "
            f"{_num(dep.design_effect)}; intervals hold for look-to-look correlation up to {dep.look_correlation_max:g}."))
    if doc.candidates:
        return out + [_note("Several candidates: each look's verdicts are above, per candidate; the replay that draws "
                            "the objective's interval at every look judges one canary and is not drawn here.")]
    if not (run_dir / EXPERIMENT_RECORDS).exists():
        return out + [_note("The request records are absent, so the objective's interval at every look is not drawn.")]
    replayed, problem = _replayed_objective(run_dir)
    if problem is not None or not replayed:
        return out + [_note(f"The request records were unreadable, so the looks were not re-judged: {problem or 'no look'}.")]
    fig = Figure(figsize=(7, 3.4))
    ax = fig.subplots()
    threshold = None
    for look, information, g in replayed:
        threshold = g.threshold if g.threshold is not None else threshold
        if g.estimate is None:
            continue
        color = VERDICT_COLORS.get(g.verdict.value, "#777")
        if g.interval is not None:
            lo, hi = g.interval  # an unbounded side is drawn to the edge of what is shown
            ax.vlines(look, lo if math.isfinite(lo) else 0.0, hi if math.isfinite(hi) else 2.0 * max(g.estimate, 1.0),
                      color=color, lw=2)
        ax.plot([look], [g.estimate], "o", color=color)
    if threshold is not None:
        ax.axhline(threshold, color="k", ls="--", lw=1, label=f"bar {threshold:g}")
        ax.legend(fontsize="small")
    ax.set_xticks([look for look, _, _ in replayed],
                  [f"{look}\n{information:.2f}" for look, information, _ in replayed])
    ax.set_xlabel("look (information fraction)")
    ax.set_ylabel("TPOT p50 ratio canary/baseline")
    ax.grid(alpha=0.3)
    out.append(_figure("fig-looks", fig, "The objective at every look: estimate and repeated confidence interval "
                       "(group-sequential, intersected over looks), coloured by verdict; it passes once the upper "
                       "bound is under the bar. Re-judged from the records by the controller's replay (mtp-canary judge)."))
    return out


# -- speculative decoding -------------------------------------------------------------------------
def expected_lengths(per_position: Sequence[float]) -> tuple[list[float | None], list[float]]:
    """(conditional acceptance per position, E[acceptance length] for k' = 1..k).

    ``per_position[i-1]`` is P(draft accepted up to position i), as cluster.metrics defines
    it (accepted at position i / drafts). The conditional rate a_i = p_i / p_(i-1) is
    P(accept i | accepted i-1); a k'-token draft gains position i only when all earlier
    ones were accepted, so E[len](k') = 1 + sum_(i<=k') prod_(j<=i) a_j.
    """
    conditional: list[float | None] = []
    previous = 1.0
    for p in per_position:
        conditional.append(p / previous if previous > 0 else None)
        previous = p
    lengths, total, chain = [], 1.0, 1.0
    for a in conditional:
        chain = chain * a if a is not None else 0.0
        total += chain
        lengths.append(total)
    return conditional, lengths


def _acceptance(doc: DecisionDocument, run_dir: Path) -> list[str]:
    spec = {arm: sd for arm, sd in doc.spec_decode.items() if sd.per_position}
    if not spec:
        return []
    out = ['<h2 id="acceptance">Speculative decoding: acceptance per draft position</h2>']
    rows = []
    fig = Figure(figsize=(10, 3.2))
    ax_pos, ax_len = fig.subplots(1, 2)
    width = 0.8 / len(spec)
    for n, (arm, sd) in enumerate(spec.items()):
        per_position = sd.per_position
        conditional, lengths = expected_lengths(per_position)
        positions = np.arange(1, len(per_position) + 1)
        ax_pos.bar(positions + (n - (len(spec) - 1) / 2) * width, per_position, width, label=arm, color=ARM_COLORS.get(arm))
        ax_len.plot(positions, lengths, "o-", label=arm, color=ARM_COLORS.get(arm))
        for i, (p, a, e) in enumerate(zip(per_position, conditional, lengths), start=1):
            rows.append([arm, i, _num(p), _num(a), _num(e), _num(sd.mean_acceptance_length) if i == len(per_position) else ""])
    ax_pos.set_xlabel("draft position")
    ax_pos.set_ylabel("P(accepted up to position)")
    ax_pos.set_ylim(0, 1.05)
    ax_len.set_xlabel("tokens drafted k'")
    ax_len.set_ylabel("expected acceptance length")
    for ax in (ax_pos, ax_len):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    out.append(_figure("fig-acceptance", fig, "Left: share of drafts accepted up to each position, per arm. Right: "
                       "the expected acceptance length had the arm drafted only k' tokens."))
    out.append(_table(["arm", "position i", "P(accepted up to i)", "P(accept i | i-1 accepted)",
                       "E[length] drafting k'=i", "measured mean length"], rows))
    advice = doc.experiment.depth_advice if doc.experiment else None
    if advice:
        out.append('<h3 id="depth-advice">Which depth: TPOT predicted from the acceptance profile and the step costs</h3>')
        out.append(_table(
            ["k", "acceptance length", "TPOT p50 predicted (ms)", "95% interval (ms)", "measured (ms)", "vs best"],
            [[p.k, _num(p.acceptance_length), _num(p.tpot_ms),
              f"[{_num(p.interval_ms[0])}, {_num(p.interval_ms[1])}]" if p.interval_ms else "n/a",
              _num(p.measured_tpot_ms), _num(p.vs_best)] for p in advice.predictions],
        ))
        out.append(f"<p>{html.escape(advice.text)}.</p>")
    return out


# -- speedup vs load --------------------------------------------------------------------------------
def _median_ratio_interval(baseline: Sequence[float], canary: Sequence[float]) -> tuple[float, float] | None:
    """95% interval of the canary/baseline TPOT median ratio (exact order-statistic bands, MOVER; requests independent)."""
    if len(baseline) < 2 or len(canary) < 2:
        return None
    b = quantile_band(np.sort(np.asarray(baseline, dtype=float)), 0.5, SWEEP_LEVEL)
    c = quantile_band(np.sort(np.asarray(canary, dtype=float)), 0.5, SWEEP_LEVEL)
    _, lower, upper = mover_log_ratio_bounds(b, c)
    return math.exp(lower), math.exp(upper)


def _sweep(doc: DecisionDocument, run_dir: Path) -> list[str]:
    rows = (doc.experiment.sweep if doc.experiment else None) or []
    if not rows:
        return []
    base, canary = "baseline", "canary"  # the sweep's two arms (with candidates, the canary is the winner)
    out = ['<h2 id="sweep">Speedup vs load (sweep, no gate)</h2>']
    got = _Records(run_dir / SWEEP_RECORDS)
    intervals: dict[float, tuple[float, float] | None] = {}
    if got.records is not None:
        for row in rows:
            at = [r for r in got.records if r.level == row.level and r.ok and not r.cancelled and r.tpot_s is not None]
            tpot = {arm: [r.tpot_s for r in at if (r.arm or r.pinned_arm) == arm] for arm in (base, canary)}
            intervals[row.level] = _median_ratio_interval(tpot[base], tpot[canary])
    fig = Figure(figsize=(6, 3.2))
    ax = fig.subplots()
    drawn = [r for r in rows if r.tpot_ratio is not None]
    levels = [r.level for r in drawn]
    ratios = [r.tpot_ratio for r in drawn]
    ax.plot(levels, ratios, "o-", color=ARM_COLORS.get(canary), label=f"{canary}/{base} TPOT p50")
    for level, ratio in zip(levels, ratios):
        interval = intervals.get(level)
        if interval is not None and all(map(math.isfinite, interval)):
            ax.vlines(level, interval[0], interval[1], color=ARM_COLORS.get(canary), lw=2)
    ax.axhline(1.0, color="k", ls="--", lw=1, label="no speedup")
    claim = doc.promote_up_to
    if claim is not None and claim.streams_per_replica is not None:  # C: shown to pay at every swept load up to it
        ax.axvline(claim.streams_per_replica, color=VERDICT_COLORS["pass"], ls=":", lw=1.5,
                   label=f"pays up to {claim.streams_per_replica:g} (judged)")
    ax.set_xlabel("streams per replica")
    ax.set_ylabel("TPOT p50 ratio")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    out.append(_figure("fig-sweep", fig, "Canary/baseline TPOT median ratio at each load level, with 95% intervals "
                       "from the sweep's records (exact median bands per arm, requests taken as independent)."))
    if got.records is None:
        out.append(_note(f"The sweep's request records were unreadable, so no intervals: {got.problem}."))
    if claim is not None:
        out.append(f'<p id="promote-up-to">{_esc(promote_up_to_line(claim))}</p>')
    table_rows = [[r.level, _num(r.arms[base].tpot_p50_ms, 2), _num(r.arms[canary].tpot_p50_ms, 2),
                   _num(r.tpot_ratio),
                   "n/a" if intervals.get(r.level) is None else f"[{intervals[r.level][0]:.3f}, {intervals[r.level][1]:.3f}]",
                   f"{r.arms[base].requests}/{r.arms[canary].requests}"] for r in rows]
    out.append(_table(["streams per replica", f"TPOT p50 {base} ms", f"TPOT p50 {canary} ms", "ratio", "95% interval",
                       "requests per arm"], table_rows))
    return out


# -- accuracy -----------------------------------------------------------------------------------------
def _accuracy(doc: DecisionDocument, run_dir: Path) -> list[str]:
    acc = doc.accuracy
    if not acc:
        return []
    out = ['<h2 id="accuracy">Accuracy</h2>',
           _note(f"{acc.items} of {acc.planned_items} {acc.kind} items, greedy, identical for every arm.")]
    gates = {g.name: g for g in doc.gates}
    acc_gate, div_gate = gates.get(ACCURACY_NAME), gates.get(DIVERGENCE_NAME)
    flips = _DISCORDANT.search((acc_gate.detail if acc_gate else None) or "")
    if flips:
        lost, gained = int(flips.group(1)), int(flips.group(2))
        n = int(acc_gate.n_canary or acc.items or 0)
        out.append(_table(["items", "same outcome on both arms", "canary lost (baseline right, canary wrong)",
                           "canary gained (baseline wrong, canary right)", "verdict"],
                          [[n, n - lost - gained, lost, gained, acc_gate.verdict]], 4))
    rows = [[arm, _num(value), _num(acc.request_errors.get(arm), 0)] for arm, value in acc.accuracy.items()]
    out.append(_table(["arm", "accuracy", "request errors"], rows))
    for arm, value in acc.divergence_vs_baseline.items():
        floor = "no twin baseline ran: judged against the absolute cap"
        if div_gate and div_gate.baseline is not None:
            floor = f"A/A floor (a twin baseline vs the baseline) {_num(div_gate.baseline)}"
        cap = f", cap {_num(div_gate.threshold)}, verdict {div_gate.verdict}" if div_gate else ""
        out.append(_note(f"{arm} outputs differ from the baseline's on {_num(value)} of items; {floor}{cap}."))
    return out


# -- progressive timeline --------------------------------------------------------------------------------
def _progressive(doc: DecisionDocument, run_dir: Path) -> list[str]:
    events = [e for e in doc.timeline if e.phase == "progressive" or e.event == "weights"]
    windows = []
    for e in events:
        match = _WINDOW.match(e.reason or "") if e.event == "window" else None
        if match:
            verdicts = dict(part.split("=", 1) for part in match.group(3).split(", ") if "=" in part)
            windows.append((e, int(match.group(1)), int(match.group(2)), verdicts))
    weights = [e for e in events if e.event == "weights"]
    if not windows and not doc.progressive:
        return []
    out = ['<h2 id="progressive">Progressive rollout</h2>']
    start = min(e.time for e in events) if events else 0.0
    fig = Figure(figsize=(9, 3.2))
    ax = fig.subplots()
    if weights:
        times = [e.time - start for e in weights] + [max(e.time for e in events) - start]
        values = [e.canary_weight for e in weights] + [weights[-1].canary_weight]
        ax.step(times, values, where="post", color=ARM_COLORS["canary"], label="canary weight %")
    for e in events:
        if e.event in ("controller_resume", "abort", "pause"):  # what interrupted the steps, where
            ax.axvline(e.time - start, color="#777", ls=":", lw=1)
            ax.annotate(str(e.event), (e.time - start, 104), fontsize="x-small", color="#555", ha="center")
    for e, index, step, verdicts in windows:
        worst = "fail" if "fail" in verdicts.values() else "inconclusive" if "inconclusive" in verdicts.values() else "pass"
        ax.plot([e.time - start], [e.canary_weight or 0.0], "s", color=VERDICT_COLORS[worst], ms=8)
        ax.annotate(str(index), (e.time - start, e.canary_weight or 0.0), textcoords="offset points", xytext=(0, 7),
                    ha="center", fontsize="small")
    ax.set_xlabel("seconds since the progressive phase began")
    ax.set_ylabel("canary weight %")
    ax.set_ylim(-5, 110)
    ax.grid(alpha=0.3)
    out.append(_figure("fig-progressive", fig, "Canary weight over time; each square is a guard window (numbered), "
                       "green when every guard passed, orange when one was inconclusive, red when one failed; "
                       "dotted lines: a controller resume, a pause or an abort."))
    if windows:
        names = list(dict.fromkeys(name for *_, verdicts in windows for name in verdicts))
        rows = [[index, step, time.strftime("%H:%M:%S", time.localtime(e.time)), _num(e.canary_weight, 0),
                 *(verdicts.get(name, "") for name in names)] for e, index, step, verdicts in windows]
        out.append(_table(["window", "step", "time", "canary weight %", *names], rows))
    return out


def _engine_warnings(doc: DecisionDocument, run_dir: Path) -> list[str]:
    warnings = {k: v for k, v in (doc.preflight.notable_warnings if doc.preflight else {}).items() if v}
    if not warnings:
        return []
    items = "".join(f"<li>{_esc(replica)}: {_esc(m)}</li>" for replica, msgs in warnings.items() for m in msgs)
    return ['<h2 id="engine-warnings">Engine warnings (from the replica logs)</h2>', f"<ul>{items}</ul>"]


def _arms_section(doc: DecisionDocument, run_dir: Path) -> list[str]:
    arms = doc.arms
    if not arms:
        return []
    rows = [[arm, info.replicas, info.engine.get("served_model_name"), info.engine.get("model"),
             str(info.engine.get("speculative_config"))] for arm, info in arms.items()]
    return ['<h2 id="arms">Arms</h2>', _table(["arm", "replicas", "served model", "model", "speculative config"], rows)]


SECTIONS: tuple[Callable[[DecisionDocument, Path], list[str]], ...] = (
    _decision, _load_placement, _candidates, _gates, _plan, _looks, _latency, _acceptance, _sweep, _accuracy, _progressive, _engine_warnings, _arms_section,
)


def html_report(doc: DecisionDocument | Mapping[str, Any], run_dir: Path) -> str:
    """report.html's text: each section only where the run holds its data (a mapping is read as decision.json first)."""
    doc = DecisionDocument.of(doc)
    run_dir = Path(run_dir)
    body: list[str] = []
    for section in SECTIONS:
        body += section(doc, run_dir)
    title = _esc(f"mtp-canary {doc.run_id}: {str(doc.decision or 'error').upper()}")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_html_report(doc: DecisionDocument | Mapping[str, Any], run_dir: Path) -> Path:
    """Write run_dir/report.html in one step (a reader never sees half a page)."""
    path = Path(run_dir) / "report.html"
    write_atomically(path, html_report(doc, run_dir))
    return path
