"""The house rules of the code, checked on its source (nothing is imported or run):

- `rollout` may import `cluster`, `loadtests` and `tinymodel`; those never import `rollout`;
- `rollout/judge` imports nothing else of `rollout`, nor Ray, HTTP clients or SQLite;
- rollout's wings import only downward: commands -> run, calibration -> record -> analysis ->
  the config modules -> judge (no module outside commands/ imports a command);
- no import cycle between the project's modules (type-only imports count too);
- no class over 350 lines, no function over 80, in any package;
- every module says what it owns in a docstring;
- no file in the tree narrates the project's own development history (numbered work sessions,
  "stop N's" runs): the README is a manual, and git keeps history;
- README.md is a manual a newcomer reads in ten minutes (at most 250 lines), whose two commands
  are Makefile targets, and every relative link in README.md and docs/ points at a file (and
  a heading of it, when it names one).

`python -m tests.test_layout` prints the module map of docs/architecture.md from the tree.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("rollout", "cluster", "loadtests", "tinymodel")
MAX_CLASS_LINES = 350
MAX_FUNCTION_LINES = 80
NOT_IN_THE_JUDGE = ("ray", "requests", "aiohttp", "urllib3", "httpx", "sqlite3", "locust", "gevent")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported(path: Path) -> set[str]:
    """Every module name `path` imports, at any depth (function-local and TYPE_CHECKING ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def project_imports() -> dict[str, set[str]]:
    known = modules()
    return {name: {n for n in imported(path) if n in known and n != name} for name, path in known.items()}


def test_the_lower_packages_never_import_rollout():
    for name, path in modules().items():
        if not name.startswith("rollout"):
            bad = sorted(n for n in imported(path) if n == "rollout" or n.startswith("rollout."))
            assert not bad, f"{name} imports {bad}"


def test_the_judge_is_pure():
    for name, path in modules().items():
        if name.startswith("rollout.judge"):
            names = imported(path)
            others = sorted(n for n in names if n.startswith("rollout.") and not n.startswith("rollout.judge"))
            assert not others, f"{name} imports {others}"
            io = sorted(n for n in names if n.split(".")[0] in NOT_IN_THE_JUDGE)
            assert not io, f"{name} imports {io}"


# rollout's wings, low to high: a module imports only its own wing and the ones below it
# (calibration and run stand side by side; neither imports the other).
WING_RANK = {"judge": 0, "config": 1, "analysis": 2, "record": 3, "run": 4, "calibration": 4, "commands": 5}


def wing_of(name: str) -> str | None:
    """The wing of a rollout module: its sub-package, or "config" for the top-level modules."""
    parts = name.split(".")
    if parts[0] != "rollout" or len(parts) < 2 or parts[1] == "__main__":
        return None
    return parts[1] if parts[1] in WING_RANK else "config"


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, deps in graph.items():
        here = wing_of(name)
        for dep in deps:
            there = wing_of(dep)
            if here and there and here != there and WING_RANK[there] >= WING_RANK[here]:
                bad.append(f"{name} ({here}) imports {dep} ({there})")
    return sorted(bad)


def test_the_wings_of_rollout_import_only_downward():
    """No import from a command into the run, from the run into calibration, from the record into the run..."""
    bad = arrows_up(project_imports())
    assert not bad, bad


def test_the_wing_rule_sees_an_arrow_up():
    assert arrows_up({"rollout.run.controller": {"rollout.commands.plan"}}) == [
        "rollout.run.controller (run) imports rollout.commands.plan (commands)"]
    assert arrows_up({"rollout.record.html": {"rollout.analysis.replay", "rollout.config"}}) == []


def test_no_import_cycle():
    graph = project_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_no_class_or_function_is_too_long():
    """In every package: a class over 350 lines or a function over 80 is several nouns or steps in one."""
    too_long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines > {limit})")
    assert not too_long, too_long


def test_every_module_says_what_it_owns():
    missing = [name for name, path in modules().items()
               if path.read_text().strip() and not ast.get_docstring(ast.parse(path.read_text()))]
    assert not missing, missing


def test_the_rules_see_a_cycle_and_a_long_function(tmp_path):
    """The checks above can fail: a two-module cycle and an 81-line function are caught."""
    a = tmp_path / "a.py"
    a.write_text("from b import x\n")
    assert imported(a) == {"b", "b.x"}
    source = "def f():\n" + "    x = 1\n" * 80
    node = ast.parse(source).body[0]
    assert node.end_lineno - node.lineno + 1 == 81 > MAX_FUNCTION_LINES


# The pattern the project's before-stop hook greps for: numbered work sessions and runs of the
# project's own development: the word session and a number, sessions and a range of numbers, or
# stop, a number and 's (examples in test_the_history_check_can_fail, spelled so as not to match).
HISTORY = re.compile(r"\bsession [0-9]+|\bsessions [0-9]+-[0-9]+|\bstop [0-9]+'s", re.IGNORECASE)
NOT_NARRATION = ("tests/data/",)  # recorded runs and fixtures, kept byte for byte
README_MAX_LINES = 250
LINK = re.compile(r"\]\(([^)#\s]+)(?:#([^)\s]*))?\)")


def tree_files() -> list[Path]:
    """Every file of the tree as git sees it: tracked, and untracked ones it does not ignore."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                             cwd=REPO, capture_output=True, check=True).stdout.decode()
        names = sorted({name for name in out.split("\0") if name})
    except (OSError, subprocess.CalledProcessError):  # no git (an unpacked archive): walk the tree
        skip = {".git", ".venv", "runs", ".cache", ".pytest_cache", ".hypothesis", "__pycache__"}
        names = sorted(str(p.relative_to(REPO)) for p in REPO.rglob("*")
                       if p.is_file() and not skip & set(p.relative_to(REPO).parts))
    return [REPO / name for name in names if not name.startswith(NOT_NARRATION) and (REPO / name).is_file()]


def history_lines(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except (UnicodeDecodeError, OSError):  # images, archives
        return []
    return [f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}"
            for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


def test_no_file_narrates_the_projects_development_history():
    found = [hit for path in tree_files() for hit in history_lines(path)]
    assert not found, "the tree speaks of its own development history (git keeps it):\n" + "\n".join(found)


def test_the_history_check_can_fail(tmp_path):
    """The pattern catches the three forms and leaves a workload's sessions and gsm8k's bus stops alone."""
    told = tmp_path / "told.md"
    told.write_text("Measured in " + "session" + " 27.\nThe figures of " + "sessions" + " 23-26.\n"
                    "Stop" + " 37's CI run hung.\n")
    assert len(HISTORY.findall(told.read_text())) == 3
    assert not HISTORY.search("slot 1 of 2: sessions 1, 3, 5; at the first stop, 8 passengers get off")


def test_the_readme_is_a_short_manual_with_the_two_commands():
    readme = (REPO / "README.md").read_text()
    lines = readme.count("\n")
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines (a manual: <= {README_MAX_LINES}; the rest in docs/)"
    makefile = (REPO / "Makefile").read_text()
    for target in ("demo", "test"):  # .ci/run runs the README's test command
        assert re.search(rf"^make {target}\b", readme, re.MULTILINE), f"README.md lost `make {target}`"
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"Makefile has no {target} target"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a markdown page's headings: lower case, punctuation dropped, spaces to -."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_of_the_manual_points_at_a_file_and_heading():
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target, anchor in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            linked = page.parent / target
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(REPO)}: {target}#{anchor}" if anchor else f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def module_map() -> str:
    """docs/architecture.md's module map: every module of the packages, with its docstring's first sentence."""
    rows = []
    for name, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")
        rows.append(f"| `{path.relative_to(REPO)}` | {first} |")
    return "| module | what it owns |\n|---|---|\n" + "\n".join(rows)


if __name__ == "__main__":
    print(module_map())
