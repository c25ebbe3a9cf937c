"""junit.xml beside decision.json: a run's gates as test cases a CI test reporter reads.

One <testsuite name="mtp-canary"> (GitLab, Jenkins and GitHub's reporters all read this
shape): one <testcase> per gate of decision.json `gates`, named by the gate, and one
"decision" case for the run as a whole. A passed gate passes; a failed gate is a <failure>
carrying the gate's detail; an inconclusive gate, or a verdict this file does not know, is an
<error>: a pipeline must never read "not decided" as a pass, and reporters that show skips as
green would do exactly that. The decision case passes only on promote, fails on rollback and
errors on inconclusive or an infrastructure error.

A run with several candidates adds one "candidate NAME" case each (classname
mtp-canary.candidates), its message the reason it won or lost: with a winner, every
candidate passes (losing to a better candidate is the selection working; the winner's gates
are the run's `gates`); without one, each candidate's case carries its own verdict.

A run with a load sweep adds two properties: `promote_up_to_streams_per_replica` (the load up to
which the candidate is shown to pay, rollout.judge.load_curve; "none": not even the lowest level
swept) and `promote_up_to_reason`. They qualify the decision case, they are not a case: the curve
decides nothing.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rollout.record.atomic_file import write_atomically
from rollout.record.document import DecisionDocument, GateRecord

SUITE = "mtp-canary"
JUNIT_FILE = "junit.xml"


def _gate_message(gate: GateRecord) -> str:
    """One line: verdict, estimate vs threshold, and the gate's own detail."""
    parts = [f"{gate.verdict or 'missing'}"]
    if gate.estimate is not None:
        parts.append(f"estimate {gate.estimate:.4g}")
    if gate.interval:
        lo, hi = gate.interval
        parts.append(f"interval [{lo:.4g}, {hi:.4g}]")
    if gate.threshold is not None:
        parts.append(f"threshold {gate.threshold:.4g}")
    head = ", ".join(parts)
    detail = " ".join(str(gate.detail or "").split())
    return f"{head}: {detail}" if detail else head


def _case(suite: ET.Element, name: str, classname: str, outcome: str, message: str) -> str:
    """Append one testcase; `outcome` is 'passed', 'failure' or 'error'. Returns the outcome."""
    case = ET.SubElement(suite, "testcase", name=name, classname=classname, time="0")
    if outcome != "passed":
        # ElementTree escapes attribute values and text (&, <, ", newlines in attributes)
        child = ET.SubElement(case, outcome, message=message, type=outcome)
        child.text = message
    else:
        ET.SubElement(case, "system-out").text = message
    return outcome


def junit_xml(doc: DecisionDocument | Mapping[str, Any]) -> str:
    """decision.json as JUnit XML text (see the module docstring for the mapping); a mapping is read as
    decision.json first (rollout.record.document)."""
    doc = DecisionDocument.of(doc)
    run_id = str(doc.run_id or "unknown")
    suite = ET.Element("testsuite", name=SUITE)
    # the schema puts <properties> before the cases
    properties = ET.SubElement(suite, "properties")
    ET.SubElement(properties, "property", name="run_id", value=run_id)
    if doc.promote_up_to is not None:
        claim = doc.promote_up_to.streams_per_replica
        ET.SubElement(properties, "property", name="promote_up_to_streams_per_replica",
                      value="none" if claim is None else f"{claim:g}")
        ET.SubElement(properties, "property", name="promote_up_to_reason", value=doc.promote_up_to.reason)
    outcomes = []
    for gate in doc.gates:
        outcome = {"pass": "passed", "fail": "failure"}.get(gate.verdict, "error")
        phase = (gate.model_extra or {}).get("phase") or gate.metric or "gate"
        outcomes.append(_case(suite, str(gate.name or "unnamed gate"), f"{SUITE}.{phase}", outcome, _gate_message(gate)))
    for candidate in doc.candidates or []:
        own = {"promote": "passed", "rollback": "failure"}.get(candidate.decision, "error")
        outcome = "passed" if doc.winner and doc.decision == "promote" else own
        message = f"{candidate.decision} at alpha {candidate.alpha}: {candidate.reason}"
        outcomes.append(_case(suite, f"candidate {candidate.name}", f"{SUITE}.candidates", outcome, message))
    reason = " ".join(str(doc.reason or "").split())
    message = f"{doc.decision or 'error'} (exit {doc.exit_code}) run {run_id}: {reason}".rstrip(": ")
    decided = {"promote": "passed", "rollback": "failure"}.get(doc.decided(), "error")
    outcomes.append(_case(suite, "decision", f"{SUITE}.run", decided, message))
    suite.set("id", run_id)
    suite.set("tests", str(len(outcomes)))
    suite.set("failures", str(outcomes.count("failure")))
    suite.set("errors", str(outcomes.count("error")))
    suite.set("skipped", "0")
    if doc.started_at is not None:
        started = datetime.fromtimestamp(doc.started_at, tz=timezone.utc)
        suite.set("timestamp", started.strftime("%Y-%m-%dT%H:%M:%S"))
    ET.indent(suite)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def write_junit(doc: DecisionDocument | Mapping[str, Any], run_dir: Path) -> Path:
    """run_dir/junit.xml, whole or absent (rollout.record.atomic_file)."""
    path = Path(run_dir) / JUNIT_FILE
    write_atomically(path, junit_xml(doc))
    return path
