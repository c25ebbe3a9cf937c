"""The files beside decision.json that pipelines read rather than people: junit.xml, metrics.prom.

One call for the report writer, so a new pipeline format is added here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout.record.document import DecisionDocument
from rollout.record.junit import write_junit
from rollout.record.prometheus import write_metrics


def write_pipeline_artifacts(doc: DecisionDocument | Mapping[str, Any], run_dir: Path) -> dict[str, Path]:
    """Write run_dir/junit.xml and run_dir/metrics.prom from a decision document (a mapping is read as
    decision.json first, once for both); their paths."""
    doc = DecisionDocument.of(doc)
    return {"junit": write_junit(doc, run_dir), "metrics": write_metrics(doc, run_dir)}
