"""The house rules of the code, checked on its source (nothing is imported or run):

- `rollout` may import `cluster`, `loadtests` and `tinymodel`; those never import `rollout`;
- `rollout/judge` imports nothing else of `rollout`, nor Ray, HTTP clients or SQLite;
- no import cycle between the project's modules (type-only imports count too);
- no class in `rollout/` over 350 lines, no function over 80;
- every module says what it owns in a docstring.
"""

from __future__ import annotations

import ast
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


def test_no_class_or_function_in_rollout_is_too_long():
    too_long = []
    for name, path in modules().items():
        if not name.startswith("rollout"):
            continue
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
