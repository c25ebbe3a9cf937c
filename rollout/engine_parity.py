"""Engine parity: do the arms differ only in the fields under test?

A canary comparison is fair only when the arms run the same engine except for what the run
judges (by default the whole `speculative_config`: method, k, drafter, verification, or none at
all; `experiment.under_test` names others). A canary that also changes `--max-num-seqs`, prefix
caching, the dtype or the checkpoint would be judged as if speculation made the difference.
This module owns that comparison, as pure functions over plain data:

- `engine_fields`: an arm's engine as {field name: value}, every setting that changes what the
  engine does (model, device, dtype, max_model_len, tensor_parallel_size, speculative_config,
  enforce_eager, trust_remote_code, each `extra_args` flag, each `env` name, cpu limits, the
  tiny checkpoint's options); not what only names, places or times it (served_model_name,
  startup_timeout_s, replicas, cpus_per_replica) nor the server's auth key (--api-key,
  $VLLM_API_KEY: who may call it, not what it computes);
- `parse_engine_args`: `extra_args` read the way vLLM's FlexibleArgumentParser spells them;
- `engine_differences` and `parity_error`: the fields two arms differ in, and the one-line
  refusal for those not under test (`experiment.under_test`, checked by `under_test_error`);
- `parse_non_default_args` / `parse_vllm_version`: what a replica's log says the server really
  ran with (vLLM's "non-default args" line and its version banner), for the record.

Field names (the spelling `experiment.under_test` takes): an engine field as in the engine spec
(`dtype`), a cpu limit or a tiny-model option dotted (`cpu.omp_threads`, `tiny_model.draft_noise`),
a flag as `extra_args:--max-num-seqs` (any spelling vLLM reads as that flag: `--max_num_seqs`,
`--no-...` for its negation), an environment variable as `env:NAME`. A group name (`extra_args`,
`env`, `cpu`, `tiny_model`) covers everything in it.

Secret values never leave here: a secret-bearing flag's value (cluster.engine_spec.is_secret_flag)
and every env value are shown as REDACTED (rollout.record.redact treats every env value as secret).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from cluster.engine_spec import API_KEY_ENV, REDACTED, RESERVED_ARGS, CpuLimits, EngineSpec, is_secret_flag, split_api_key

DEFAULT_UNDER_TEST = ("speculative_config",)
ENGINE_FIELDS = (
    "model",
    "device",
    "dtype",
    "max_model_len",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "speculative_config",
    "enforce_eager",
    "trust_remote_code",
)
CPU_FIELDS = tuple(CpuLimits.model_fields)  # every limit (worker_process too: it changes vLLM's executor)
EXTRA_ARGS = "extra_args"
ENV = "env"
TINY_MODEL = "tiny_model"
GROUPS = (EXTRA_ARGS, ENV, "cpu", TINY_MODEL)
UNSET = "unset"
# vLLM reads `-O3`, `-O=3` and `-O 3` as --optimization-level 3 (FlexibleArgumentParser)
OPTIMIZATION_LEVEL = "--optimization-level"
_NUMBER = re.compile(r"^-\.?[0-9]")  # argparse reads "-1" and "-.5" as values, not flags
# The error line is capped (rollout.config: 400 characters, its file name included): past
# VALUES_BUDGET the remaining fields are named without their values, past NAMES_BUDGET only
# counted, so that the line still ends with what is under test.
VALUES_BUDGET = 160
NAMES_BUDGET = 260
VALUE_CHARS = 60


class EngineDifference(BaseModel):
    """One field two arms' engines differ in, with both values as they may be printed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    field: str  # e.g. "dtype", "extra_args:--max-num-seqs", "env:HF_TOKEN", "tiny_model.broken"
    baseline: str
    candidate: str

    def describe(self, candidate_name: str, with_values: bool = True) -> str:
        label = self.field.replace(f"{EXTRA_ARGS}:", f"{EXTRA_ARGS} ", 1).replace(f"{ENV}:", f"{ENV} ", 1)
        if not with_values:
            return label
        return f"{label} (baseline: {_clip(self.baseline)}, {candidate_name}: {_clip(self.candidate)})"


# -- extra_args as vLLM reads them -----------------------------------------------------------


def _respelt(arg: str) -> str:
    """The option name of a flag token as vLLM's parser respells it: the text after '=' dropped,
    '_' read as '-' between '--' and the first '.' (a dotted `--x.y` keeps its path)."""
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        head, dot, path = name[2:].partition(".")
        name = "--" + head.replace("_", "-") + dot + path
    return name


def _negated(arg: str) -> bool:
    """`--no-x` (BooleanOptionalAction's negation of --x), in any spelling vLLM accepts."""
    name = _respelt(arg)
    return name.startswith("--no-") and "." not in name


def flag_key(arg: str) -> str:
    """The option a flag token sets, as this module names it: `_respelt`, and `--no-x` named `--x`."""
    return "--" + _respelt(arg)[len("--no-"):] if _negated(arg) else _respelt(arg)


def _is_flag(token: str) -> bool:
    return token.startswith("-") and not _NUMBER.match(token) and token != "-"


def _canonical(value: str) -> str:
    """A value as compared: JSON re-dumped with sorted keys (`0.90` is `0.9`, key order and spaces
    of a JSON config do not count); anything else as written."""
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return value
    if isinstance(parsed, str):
        return value  # '"x"' stays as written: vLLM gets the quotes too
    return json.dumps(parsed, sort_keys=True, separators=(",", ":"))


def _tokens(args: list[str]) -> list[str]:
    """args with vLLM's -O spellings made --optimization-level (and --api-key taken out)."""
    out: list[str] = []
    rest = split_api_key(list(args))[0]
    for i, arg in enumerate(rest):
        if arg.startswith("-O") and arg != "-O":
            out += [OPTIMIZATION_LEVEL, arg[3:] if arg[2:3] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(rest) and rest[i + 1] in {"0", "1", "2", "3"}:
            out.append(OPTIMIZATION_LEVEL)
        else:
            out.append(arg)
    return out


def parse_engine_args(args: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """`extra_args` as {flag: one value per occurrence}: `--x v`, `--x=v` and `--x_y v` are one
    flag; a bare flag is "true", its `--no-` form "false"; several values after one flag are
    one value joined by spaces. A flag given twice keeps both occurrences (argparse keeps the
    last for most flags and all of them for appending ones: telling those apart takes vLLM's
    parser, so two spellings of one setting are reported as a difference, never missed).
    Abbreviations (`--max-num-se`) are compared as written."""
    parsed: dict[str, list[str]] = {}
    # one occurrence being read: its flag, the value a bare flag means, the values seen so far
    current: tuple[str, str, list[str]] | None = None
    for token in _tokens(list(args)):
        if _is_flag(token):
            if current is not None:
                _add_occurrence(parsed, *current)
            current = (flag_key(token), "false" if _negated(token) else "true", [token.split("=", 1)[1]] if "=" in token else [])
        elif current is not None:
            current[2].append(token)
        else:  # a value before any flag (vLLM would read it as the model tag)
            parsed.setdefault("", []).append(token)
    if current is not None:
        _add_occurrence(parsed, *current)
    return {flag: tuple(occurrences) for flag, occurrences in parsed.items()}


def _add_occurrence(parsed: dict[str, list[str]], flag: str, bare: str, values: list[str]) -> None:
    parsed.setdefault(flag, []).append(" ".join(_canonical(v) for v in values) if values else bare)


# -- an arm's engine as fields ---------------------------------------------------------------

Shown = tuple[Any, str]  # (value compared, value printed)


def _show(value: Any) -> str:
    if value is None:
        return UNSET
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _core_count(cores: str | None) -> int | None:
    if cores is None:
        return None
    total = 0
    for part in cores.split(","):
        first, _, last = part.partition("-")
        total += int(last or first) - int(first) + 1
    return total


def engine_fields(engine: EngineSpec, tiny_model: BaseModel | Mapping[str, Any] | None = None) -> dict[str, Shown]:
    """{field name: (value compared, value printed)} of one arm's engine (see the module doc)."""
    fields: dict[str, Shown] = {}
    for name in ENGINE_FIELDS:
        value = getattr(engine, name)
        fields[name] = (value, _show(value))
    if tiny_model is not None:
        options = tiny_model.model_dump(mode="json") if isinstance(tiny_model, BaseModel) else dict(tiny_model)
        # engine.model is ignored when the arm serves the tiny checkpoint: its options pick the weights
        fields["model"] = ("<tiny_model>", "the tiny_model checkpoint")
        for name, value in options.items():
            fields[f"{TINY_MODEL}.{name}"] = (value, _show(value))
    for name in CPU_FIELDS:
        value = getattr(engine.cpu, name)
        if name == "cores":
            # which cores is placement (each replica gets its own); how many is engine config
            fields["cpu.cores"] = (_core_count(value), f"{_core_count(value)} ({value})" if value else UNSET)
        else:
            fields[f"cpu.{name}"] = (value, _show(value))
    for flag, occurrences in parse_engine_args(engine.extra_args).items():
        secret = is_secret_flag(flag)
        shown = ", then ".join(REDACTED if secret else value for value in occurrences)
        fields[f"{EXTRA_ARGS}:{flag}"] = (occurrences, shown)
    for name, value in engine.env.items():
        if name != API_KEY_ENV:
            fields[f"{ENV}:{name}"] = (value, REDACTED)
    return fields


def engine_differences(
    baseline: EngineSpec,
    candidate: EngineSpec,
    baseline_tiny: BaseModel | Mapping[str, Any] | None = None,
    candidate_tiny: BaseModel | Mapping[str, Any] | None = None,
) -> list[EngineDifference]:
    """Every field the two engines differ in (a field one arm lacks is "unset" there), in a
    stable order: engine fields first, then the rest by name."""
    ours = engine_fields(baseline, baseline_tiny)
    theirs = engine_fields(candidate, candidate_tiny)
    if (baseline_tiny is None) != (candidate_tiny is None):
        # one arm serves the tiny checkpoint, the other a model path: `model` says so; each
        # option of the checkpoint as a difference of its own would only repeat it
        ours = {n: v for n, v in ours.items() if not n.startswith(f"{TINY_MODEL}.")}
        theirs = {n: v for n, v in theirs.items() if not n.startswith(f"{TINY_MODEL}.")}
    order = {name: i for i, name in enumerate(ENGINE_FIELDS)}
    names = sorted(set(ours) | set(theirs), key=lambda n: (order.get(n, len(order)), n))
    missing: Shown = (None, UNSET)
    return [
        EngineDifference(field=name, baseline=ours.get(name, missing)[1], candidate=theirs.get(name, missing)[1])
        for name in names
        if ours.get(name, missing)[0] != theirs.get(name, missing)[0]
    ]


# -- what is under test ------------------------------------------------------------------------


def normalize_under_test(name: str) -> str:
    """The canonical spelling of an under_test name (`extra_args:--max_num_seqs` is
    `extra_args:--max-num-seqs`); other names as given."""
    group, sep, rest = name.partition(":")
    if sep and group == EXTRA_ARGS and rest.startswith("-"):
        tokens = _tokens([rest])
        return f"{EXTRA_ARGS}:{flag_key(tokens[0])}"
    return name


def under_test_error(name: str, tiny_model_fields: Iterable[str]) -> str | None:
    """Why `name` names no engine field (one line), or None when it does."""
    known = ", ".join((*ENGINE_FIELDS, "cpu.<limit>", "tiny_model.<option>", "extra_args:--<flag>", "env:<NAME>"))
    group, sep, rest = name.partition(":")
    if sep:
        if group == EXTRA_ARGS:
            if not _is_flag(rest) or not rest.strip("-"):
                return f"{name!r}: a flag starts with '-' (extra_args:--max-num-seqs)"
            flag = normalize_under_test(name).partition(":")[2]
            if flag in RESERVED_ARGS:
                return f"{name!r}: {flag} is set by its own field; name that field ({RESERVED_ARGS[flag]})"
            return None
        if group == ENV:
            return None if rest.strip() else f"{name!r}: name the variable (env:HF_HOME)"
        return f"unknown field {name!r} (one of {known})"
    head, dot, tail = name.partition(".")
    if name in ENGINE_FIELDS or name in GROUPS:
        return None
    if dot and head == "cpu" and tail in CPU_FIELDS:
        return None
    if dot and head == TINY_MODEL and tail in set(tiny_model_fields):
        return None
    if re.fullmatch(r"[a-z][a-z0-9_-]*", name):  # max_num_seqs: most likely a vLLM flag
        return f"unknown field {name!r} (a vLLM flag is named extra_args:--{name.replace('_', '-')}; fields: {known})"
    return f"unknown field {name!r} (one of {known})"


def is_under_test(field: str, under_test: Iterable[str]) -> bool:
    """Is `field` (an EngineDifference.field) declared under test, itself or by its group?"""
    for name in under_test:
        if field == name or field.startswith((f"{name}.", f"{name}:")):
            return True
    return False


def parity_error(
    differences: Mapping[str, list[EngineDifference]], under_test: Iterable[str]
) -> str | None:
    """The one-line refusal naming every difference not under test, each with both values
    (past VALUES_BUDGET names only, past NAMES_BUDGET a count); None when there is none.
    `differences`: candidate arm name -> its differences from the baseline."""
    declared = list(under_test)
    parts: list[str] = []
    for arm, found in differences.items():
        beyond = [d for d in found if not is_under_test(d.field, declared)]
        if not beyond:
            continue
        named: list[str] = []
        used = 0
        for i, difference in enumerate(beyond):
            full = difference.describe(arm)
            text = full if used + len(full) <= VALUES_BUDGET else difference.describe(arm, with_values=False)
            if used + len(text) > NAMES_BUDGET:
                named.append(f"and {len(beyond) - i} more")
                break
            named.append(text)
            used += len(text) + 2
        parts.append(f"{arm} differs from baseline in {', '.join(named)}")
    if not parts:
        return None
    return f"engine parity: {'; '.join(parts)}, not under test (experiment.under_test: [{', '.join(declared)}])"


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 3] + "..."


# -- what the server says it ran with ----------------------------------------------------------

NON_DEFAULT_ARGS = "non-default args: "
# what a replica's log is searched for (cluster.fleet.Fleet.log_lines_with): the args line,
# the start banner and the engine core's first line
SERVER_LOG_NEEDLES = (NON_DEFAULT_ARGS, " version ", "LLM engine (v")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# the start banner (logo or plain) and the engine core's first line; no other "version" line
_VERSIONS = (
    re.compile(r"(?:█|vLLM (?:API )?server)\s+version\s+v?([0-9]+\.[0-9]+[0-9A-Za-z.+\-]*)"),
    re.compile(r"Initializing a V[0-9]+ LLM engine \(v([0-9]+\.[0-9]+[0-9A-Za-z.+\-]*)\)"),
)


class EngineRun(BaseModel):
    """What one replica's server logged about itself: its vLLM version and its non-default
    args (vLLM's own names: max_num_seqs, speculative_config), secret-named values REDACTED.
    `unparsed`: the line's text when it was no Python literal (kept, clipped, for a person)."""

    model_config = ConfigDict(extra="forbid")

    vllm_version: str | None = None
    non_default_args: dict[str, Any] | None = None
    unparsed: str | None = None


def parse_vllm_version(line: str) -> str | None:
    """The version in vLLM's start banner (`... version 0.32.0`, colour codes or not, or
    `vLLM server version 0.32.0, serving model ...`), else None."""
    text = _ANSI.sub("", line)
    for pattern in _VERSIONS:
        match = pattern.search(text)
        if match:
            return match.group(1).rstrip(",.")
    return None


def _redact_args(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_flag("--" + str(k)) else _redact_args(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_args(v) for v in value]
    return value


def parse_non_default_args(line: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the args dict, None) of a "non-default args: {...}" log line, secret-named keys REDACTED;
    (None, the text) when it is no Python literal (a repr of an object); (None, None) when the
    line is no such line."""
    _, found, text = line.partition(NON_DEFAULT_ARGS)
    if not found:
        return None, None
    text = _ANSI.sub("", text).strip()
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # TypeError: {[1]: 2}
        return None, text[:500]
    if not isinstance(value, dict):
        return None, text[:500]
    return _redact_args({str(k): _jsonable(v) for k, v in value.items()}), None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def engine_run_from_log(lines: Iterable[str]) -> EngineRun:
    """An EngineRun from a server's log lines (the last banner and args line win: a replica's
    log holds every restart of its server)."""
    run = EngineRun()
    for line in lines:
        if NON_DEFAULT_ARGS in line:
            args, unparsed = parse_non_default_args(line)
            run.non_default_args, run.unparsed = args, unparsed
        elif version := parse_vllm_version(line):
            run.vllm_version = version
    return run
