"""`mtp-canary config-schema`: the schema is the validator's, and the committed reference is current."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from rollout.config import load_config
from rollout.commands.config_schema import config_schema, markdown_reference, reference_rows
from tests.conftest import REPO


def test_the_committed_reference_is_what_the_schema_prints():
    committed = (REPO / "docs" / "config-reference.md").read_text()
    assert committed == markdown_reference(), "regenerate: python -m rollout config-schema --markdown > docs/config-reference.md"


def test_every_key_of_every_shipped_config_is_in_the_reference():
    paths = {row[0] for row in reference_rows(config_schema())}

    def keys(node, prefix=""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            yield path
            if isinstance(value, dict) and not path.endswith(("env", "speculative_config")):  # free-form maps
                yield from keys(value, f"{path}.")

    configs = sorted((REPO / "configs").rglob("*.yaml"))
    assert configs
    for path in configs:
        load_config(path)  # each one is valid
        missing = [k for k in keys(yaml.safe_load(path.read_text())) if k not in paths]
        assert not missing, (path, missing)


def test_the_command_prints_a_json_schema_that_refuses_unknown_keys():
    out = subprocess.run([sys.executable, "-m", "rollout", "config-schema"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    assert schema["additionalProperties"] is False and "experiment" in schema["properties"]
    assert schema["$defs"]["ExperimentConfig"]["additionalProperties"] is False
