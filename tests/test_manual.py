"""The manual names every command the CLI has: README's command table and docs/cli.md's usage lines
follow `mtp-canary --help`, so a command added or renamed cannot go missing from them."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def cli_commands() -> list[str]:
    """The subcommands `mtp-canary --help` lists (its `{run,resume,...}` choices)."""
    out = subprocess.run([sys.executable, "-m", "rollout", "--help"], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    choices = re.search(r"\{([a-z,-]+)\}", out)
    assert choices, out
    return choices.group(1).split(",")


def test_readme_and_cli_doc_name_every_command():
    commands = cli_commands()
    assert "run" in commands and "submit" in commands
    readme = (REPO / "README.md").read_text()
    cli_doc = (REPO / "docs" / "cli.md").read_text()
    missing_readme = [c for c in commands if not re.search(rf"^\| `{c}\b|/ `{c}\b", readme, re.MULTILINE)]
    missing_doc = [c for c in commands if f"usage: mtp-canary {c} " not in cli_doc]
    assert not missing_readme, f"README.md's command table lacks {missing_readme}"
    assert not missing_doc, f"docs/cli.md lacks the usage of {missing_doc} (paste `mtp-canary CMD --help`'s usage)"
