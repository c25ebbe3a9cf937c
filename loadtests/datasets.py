"""Seeded prompt sources: what the simulated users ask.

Every source gives random access by position (`prompt(i)`), so the global request
sequence is a pure function of (source, seed): workers take interleaved positions
(slot, slot + n, ...) and both arms of a comparison get the same prompts in the same
order, however the load is partitioned.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

DatasetKind = Literal["synthetic", "gsm8k", "jsonl", "shared_prefix", "multi_turn", "trace"]
TraceFormat = Literal["jsonl", "mooncake", "burstgpt"]


@dataclass(frozen=True)
class Prompt:
    """One request's input: a completion prompt or a chat conversation."""

    index: int
    text: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    # exact output length for this item (synthetic data); None: the run's --mtp-max-tokens
    max_tokens: int | None = None
    ignore_eos: bool | None = None
    # multi-turn sessions: which conversation this turn belongs to, and which turn it is (0 first)
    session: int | None = None
    turn: int | None = None
    # trace replay: when it is due, in seconds after the replay starts (before any speed-up)
    trace_offset_s: float | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


class PromptSource(Protocol):
    name: str

    @property
    def has_chats(self) -> bool:
        """True when some items are conversations (they need the chat endpoint)."""
        ...

    def prompt(self, index: int) -> Prompt: ...


# Bounds on what a dataset or a length may ask for: a request of more tokens than any model's
# context (1e7 words would build a 60 MB prompt per request), and a file larger than a load
# test needs in memory (each file is read whole, then sampled), are refused with their name.
MAX_REQUEST_TOKENS = 1 << 20
MAX_DATASET_BYTES = 1 << 30
MAX_LINE_BYTES = 16 << 20
_DISTRIBUTION = re.compile(r"^(?:(?P<kind>fixed|uniform|normal|lognormal):)?(?P<args>[0-9.:]+)$")


@dataclass(frozen=True)
class LengthDistribution:
    """A token-length distribution, written `128`, `fixed:128`, `uniform:64:256`,
    `normal:MEAN:STD` or `lognormal:MEDIAN:SIGMA` (sigma of the log). Samples are
    rounded and clipped to at least 1 (and at most `upper` when given)."""

    kind: Literal["fixed", "uniform", "normal", "lognormal"]
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str | int) -> LengthDistribution:
        text = str(spec).strip()
        match = _DISTRIBUTION.match(text)
        if not match:
            raise ValueError(f"not a length distribution: {spec!r} (e.g. 128, uniform:64:256, normal:128:16)")
        kind = match["kind"] or "fixed"
        numbers = [float(part) for part in match["args"].split(":")]
        expected = 1 if kind == "fixed" else 2
        if len(numbers) != expected:
            raise ValueError(f"{kind} length distribution takes {expected} number(s): {spec!r}")
        if any(n < 0 for n in numbers) or (kind != "normal" and numbers[0] <= 0):
            raise ValueError(f"length distribution needs positive numbers: {spec!r}")
        if any(not math.isfinite(n) or n > MAX_REQUEST_TOKENS for n in numbers):
            raise ValueError(f"length distribution beyond {MAX_REQUEST_TOKENS} tokens: {spec!r}")
        if kind == "uniform" and numbers[1] < numbers[0]:
            raise ValueError(f"uniform length distribution needs low <= high: {spec!r}")
        return cls(kind, numbers[0], numbers[1] if expected == 2 else 0.0)  # type: ignore[arg-type]

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(math.ceil(self.a), math.floor(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = rng.lognormvariate(math.log(self.a), self.b)
        return max(1, min(MAX_REQUEST_TOKENS, round(min(value, MAX_REQUEST_TOKENS))))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


# Short common English words: each is close to one token for BPE tokenizers (with its
# leading space), which keeps "input tokens approximated by words" honest.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter mother "
    "answer found study still learn should world high every near add food between own below country plant "
    "last school father keep tree never start city earth eye light thought head under story saw left few "
    "while along might close something seem next hard open example begin life always those both paper "
    "together got group often run important until children side feet car mile night walk white sea began grow"
).split()


class SyntheticPrompts:
    """Random-word prompts of a drawn length, each asking for an exact output length.

    Output lengths are exact because every request carries `max_tokens` = the drawn
    length and `ignore_eos`; input lengths are approximate (words, not tokens).
    """

    name = "synthetic"
    has_chats = False

    def __init__(self, input_tokens: LengthDistribution, output_tokens: LengthDistribution, seed: int = 0) -> None:
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.seed = seed

    def prompt(self, index: int) -> Prompt:
        # a generator per item (string seeds hash deterministically) makes item i the same
        # whichever worker draws it and whatever was drawn before
        rng = random.Random(f"mtp-synthetic:{self.seed}:{index}")
        n_input = self.input_tokens.sample(rng)
        n_output = self.output_tokens.sample(rng)
        text = " ".join(rng.choices(_WORDS, k=n_input))
        return Prompt(index=index, text=text, max_tokens=n_output, ignore_eos=True)


class SharedPrefixPrompts:
    """Groups of prompts that share a long prefix: `groups` prefixes (a system prompt, a document)
    of `prefix_tokens` words, each prompt one of them plus a suffix of its own drawn from
    `input_tokens`, asking for an exact output length (as SyntheticPrompts).

    What it is for: the prefix cache's hits (vLLM's `vllm:prefix_cache_hits` / `queries`). Both
    arms walk the same sequence, so they see the same groups in the same order; an arm whose
    hit rate falls far below the other's under it has a prefix cache that does not work as the
    baseline's does. Item i's group is drawn per item (seeded), so a group's requests are spread
    over the run, as a shared system prompt's are in production.
    """

    name = "shared_prefix"
    has_chats = False

    def __init__(self, groups: int, prefix_tokens: int, input_tokens: LengthDistribution,
                 output_tokens: LengthDistribution, seed: int = 0) -> None:
        if groups < 1 or prefix_tokens < 1:
            raise ValueError(f"shared_prefix needs at least one group and one prefix token (got {groups}, {prefix_tokens})")
        self.groups = groups
        self.prefix_tokens = prefix_tokens
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.seed = seed
        self._prefixes: dict[int, str] = {}

    def prefix(self, group: int) -> str:
        if group not in self._prefixes:
            rng = random.Random(f"mtp-prefix:{self.seed}:{group}")
            self._prefixes[group] = " ".join(rng.choices(_WORDS, k=self.prefix_tokens))
        return self._prefixes[group]

    def group_of(self, index: int) -> int:
        return random.Random(f"mtp-prefix-group:{self.seed}:{index}").randrange(self.groups)

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"mtp-shared-prefix:{self.seed}:{index}")
        suffix = " ".join(rng.choices(_WORDS, k=self.input_tokens.sample(rng)))
        n_output = self.output_tokens.sample(rng)
        return Prompt(index=index, text=f"{self.prefix(self.group_of(index))}\n{suffix}", max_tokens=n_output,
                      ignore_eos=True)


class MultiTurnSessions:
    """Conversations of `turns` turns: each turn's prompt is the whole history (every earlier user
    message and reply) plus a new user message of `input_tokens` words, asking for an exact
    output length (as SyntheticPrompts).

    Item `session * turns + turn` is that session's turn, a pure function of (seed, session,
    turn), so both arms get the same sessions with the same histories. The replies in the
    history are scripted (seeded words of each turn's output length), not what an arm answered:
    that keeps the histories identical on every arm whatever each arm generated, at the cost of
    prefix-cache hits on the previous reply's own blocks (a chat client that sends back the real
    reply gets those too). Completions get the history as "User: ...\nAssistant: ..." text; chat
    gets it as messages. The traffic share keeps each session on one user, turn after turn.
    """

    name = "multi_turn"

    def __init__(self, turns: int, input_tokens: LengthDistribution, output_tokens: LengthDistribution,
                 seed: int = 0, chat: bool = False) -> None:
        if turns < 1:
            raise ValueError(f"multi_turn needs at least one turn per session (got {turns})")
        self.turns = turns
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.seed = seed
        self.has_chats = chat

    def _turn(self, session: int, turn: int) -> tuple[str, str, int]:
        """The user's message of one turn, the scripted reply, and the turn's output length."""
        rng = random.Random(f"mtp-multi-turn:{self.seed}:{session}:{turn}")
        message = " ".join(rng.choices(_WORDS, k=self.input_tokens.sample(rng)))
        n_output = self.output_tokens.sample(rng)
        reply = " ".join(rng.choices(_WORDS, k=n_output))
        return message, reply, n_output

    def prompt(self, index: int) -> Prompt:
        session, turn = divmod(index, self.turns)
        history = [self._turn(session, t) for t in range(turn + 1)]
        n_output = history[-1][2]
        if self.has_chats:
            messages: list[dict[str, str]] = []
            for message, reply, _ in history[:-1]:
                messages += [{"role": "user", "content": message}, {"role": "assistant", "content": reply}]
            messages.append({"role": "user", "content": history[-1][0]})
            return Prompt(index=index, messages=tuple(messages), max_tokens=n_output, ignore_eos=True,
                          session=session, turn=turn)
        text = "".join(f"User: {message}\nAssistant: {reply}\n" for message, reply, _ in history[:-1])
        return Prompt(index=index, text=f"{text}User: {history[-1][0]}\nAssistant:", max_tokens=n_output,
                      ignore_eos=True, session=session, turn=turn)


# Mooncake traces name their prompts' KV blocks by hash id, one id per 512 tokens: prompts whose
# ids agree share those blocks (the prefix cache's hits), and replay keeps that sharing
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: when it came (seconds after the trace's first request), its
    lengths, and what it shares with others (a session's earlier turns, a prefix, KV blocks)."""

    at_s: float
    input_tokens: int
    output_tokens: int
    session_id: str | None = None
    prefix_id: str | None = None
    prefix_tokens: int | None = None
    block_ids: tuple[int, ...] | None = None


def _positive_int(value: Any, where: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < 1:
        raise ValueError(f"{where}: {field} must be a positive integer, got {str(value)[:40]}")
    if value > MAX_REQUEST_TOKENS:
        raise ValueError(f"{where}: {field} {value:g} is beyond {MAX_REQUEST_TOKENS} tokens")
    return int(value)


def _check_size(path: Path) -> None:
    size = path.stat().st_size
    if size > MAX_DATASET_BYTES:
        raise ValueError(f"{path}: {size} bytes, beyond the {MAX_DATASET_BYTES} a dataset may hold (each is read whole)")


def _timestamp(value: Any, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {field} must be a non-negative number, got {value!r}")
    return float(value)


def _optional_id(value: Any, where: str, field: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{where}: {field} must be a string or an integer, got {value!r}")
    return str(value)


def load_trace(path: str | Path, trace_format: TraceFormat = "jsonl") -> list[TraceRow]:
    """A trace file's requests in time order, times made relative to the first.

    - jsonl: {"timestamp": seconds, "input_tokens", "output_tokens"[, "session_id", "prefix_id",
      "prefix_tokens"]} per line (this project's format; sessions: a later turn's prompt extends
      the earlier ones', prefix groups: the first prefix_tokens words shared, default half);
    - mooncake: Mooncake's {"timestamp": milliseconds, "input_length", "output_length",
      "hash_ids": [...]} per line (FAST'25 traces);
    - burstgpt: BurstGPT's CSV (Timestamp in seconds, "Request tokens", "Response tokens");
      rows with no response tokens (failed requests in the log) are left out.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file not found: {path}")
    _check_size(path)
    rows: list[TraceRow] = []
    if trace_format == "burstgpt":
        with open(path, encoding="utf-8", newline="") as text:
            reader = csv.DictReader(text)
            missing = {"Timestamp", "Request tokens", "Response tokens"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: not a BurstGPT CSV: no column {', '.join(sorted(missing))}")
            for number, row in enumerate(reader, start=2):
                where = f"{path}:{number}"
                try:
                    at = float(row["Timestamp"])
                    n_in, n_out = float(row["Request tokens"]), float(row["Response tokens"])
                except (TypeError, ValueError):
                    raise ValueError(f"{where}: Timestamp, Request tokens and Response tokens must be numbers") from None
                if n_out < 1:
                    continue  # a request that failed in the log: nothing to ask for
                rows.append(TraceRow(_timestamp(at, where, "Timestamp"), _positive_int(n_in, where, "Request tokens"),
                                     _positive_int(math.floor(n_out) if math.isfinite(n_out) else n_out, where,
                                                   "Response tokens")))
    elif trace_format in ("jsonl", "mooncake"):
        for number, row in enumerate(_read_jsonl(path), start=1):
            where = f"{path}:{number}"
            if trace_format == "mooncake":
                blocks = row.get("hash_ids", [])
                if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
                    raise ValueError(f"{where}: hash_ids must be a list of integers")
                rows.append(TraceRow(
                    _timestamp(row.get("timestamp"), where, "timestamp") / 1000.0,
                    _positive_int(row.get("input_length"), where, "input_length"),
                    _positive_int(row.get("output_length"), where, "output_length"),
                    block_ids=tuple(blocks),
                ))
            else:
                prefix_tokens = row.get("prefix_tokens")
                rows.append(TraceRow(
                    _timestamp(row.get("timestamp"), where, "timestamp"),
                    _positive_int(row.get("input_tokens"), where, "input_tokens"),
                    _positive_int(row.get("output_tokens"), where, "output_tokens"),
                    session_id=_optional_id(row.get("session_id"), where, "session_id"),
                    prefix_id=_optional_id(row.get("prefix_id"), where, "prefix_id"),
                    prefix_tokens=None if prefix_tokens is None else _positive_int(prefix_tokens, where, "prefix_tokens"),
                ))
    else:
        raise ValueError(f"unknown trace format {trace_format!r} (jsonl, mooncake or burstgpt)")
    if not rows:
        raise ValueError(f"{path}: the trace holds no requests")
    rows.sort(key=lambda r: r.at_s)  # a stable sort: rows at the same time keep the file's order
    first = rows[0].at_s
    return [TraceRow(r.at_s - first, r.input_tokens, r.output_tokens, r.session_id, r.prefix_id, r.prefix_tokens,
                     r.block_ids) for r in rows]


class TracePrompts:
    """A trace replayed: request i is row i of the trace (looping: after the last row the trace
    starts again, one mean gap later, with fresh sessions, prefixes and blocks), with the row's
    lengths (exact output: ignore_eos) and due `at_s / speedup` after the replay starts.

    Prompt words are seeded: a row's own words by its position, shared ones by what it shares
    (a session, a prefix group, a Mooncake block id), so prompts that share in the trace share
    the same words, and both arms get the same prompts at the same times.
    """

    name = "trace"
    has_chats = False

    def __init__(self, rows: Sequence[TraceRow], seed: int = 0, speedup: float = 1.0) -> None:
        if not rows:
            raise ValueError("the trace holds no requests")
        if not speedup > 0:
            raise ValueError(f"trace speed-up must be positive, got {speedup}")
        self.rows = list(rows)
        self.seed = seed
        self.speedup = speedup
        gaps = self.rows[-1].at_s / (len(self.rows) - 1) if len(self.rows) > 1 else 1.0
        # one pass lasts from the first row to one mean gap after the last
        self.pass_s = self.rows[-1].at_s + (gaps if gaps > 0 else 1.0)

    def _words(self, key: str, n: int) -> list[str]:
        # choices() draws one word per call of random(): the first n of a longer draw are the
        # n-word draw, so a session's later turn extends its earlier turns' prompt word for word
        return random.Random(f"mtp-trace:{self.seed}:{key}").choices(_WORDS, k=n)

    def prompt(self, index: int) -> Prompt:
        trace_pass, position = divmod(index, len(self.rows))
        row = self.rows[position]
        own = f"{trace_pass}:row:{position}"
        if row.block_ids:
            words: list[str] = []
            for block in row.block_ids:
                if len(words) >= row.input_tokens:
                    break
                words += self._words(f"{trace_pass}:block:{block}", MOONCAKE_BLOCK_TOKENS)
            words = words[:row.input_tokens]
            words += self._words(own, row.input_tokens - len(words))
        elif row.session_id is not None:
            words = self._words(f"{trace_pass}:session:{row.session_id}", row.input_tokens)
        elif row.prefix_id is not None:
            shared = min(row.input_tokens, row.prefix_tokens or max(1, row.input_tokens // 2))
            words = self._words(f"{trace_pass}:prefix:{row.prefix_id}", shared)
            words += self._words(own, row.input_tokens - shared)
        else:
            words = self._words(own, row.input_tokens)
        return Prompt(index=index, text=" ".join(words), max_tokens=row.output_tokens, ignore_eos=True,
                      trace_offset_s=(trace_pass * self.pass_s + row.at_s) / self.speedup)


class _ShuffledItems:
    """Items of a file in a seeded order that is reshuffled every pass over the file."""

    def __init__(self, items: Sequence[Any], seed: int, label: str) -> None:
        if not items:
            raise ValueError(f"{label} holds no items")
        self._items = items
        self._seed = seed
        self._label = label
        self._epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self._items)

    def item(self, index: int) -> Any:
        epoch, position = divmod(index, len(self._items))
        if epoch != self._epoch:
            order = list(range(len(self._items)))
            random.Random(f"mtp-{self._label}:{self._seed}:{epoch}").shuffle(order)
            self._epoch, self._order = epoch, order
        return self._items[self._order[position]]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    _check_size(path)
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(iter(lambda: lines.readline(MAX_LINE_BYTES + 1), ""), start=1):
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"{path}:{number}: a line longer than {MAX_LINE_BYTES} characters")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")
            rows.append(row)
    return rows


class Gsm8kQuestions:
    """gsm8k questions (any JSONL with a "question" field), zero-shot, in seeded order.

    Completions get vLLM's eval framing ("Question: ...\\nAnswer:"); chat gets the
    question as the user's message. This is load, not the accuracy eval: no few-shot.
    """

    name = "gsm8k"
    has_chats = False

    def __init__(self, path: str | Path, seed: int = 0) -> None:
        rows = _read_jsonl(Path(path))
        for number, row in enumerate(rows, start=1):
            if not isinstance(row.get("question"), str):
                raise ValueError(f"{path}: item {number} has no 'question' string")
        self._questions = _ShuffledItems([row["question"] for row in rows], seed, "gsm8k")

    def __len__(self) -> int:
        return len(self._questions)

    def prompt(self, index: int) -> Prompt:
        question = self._questions.item(index)
        return Prompt(index=index, text=f"Question: {question}\nAnswer:")


class JsonlPrompts:
    """A user's JSONL: one {"prompt": "..."} or {"messages": [...]} per line, optionally
    with "max_tokens", in seeded order."""

    name = "jsonl"

    def __init__(self, path: str | Path, seed: int = 0) -> None:
        rows = _read_jsonl(Path(path))
        prompts: list[Prompt] = []
        for number, row in enumerate(rows, start=1):
            max_tokens = row.get("max_tokens")
            if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                           or not 1 <= max_tokens <= MAX_REQUEST_TOKENS):
                raise ValueError(f"{path}: item {number}: max_tokens must be an integer from 1 to {MAX_REQUEST_TOKENS}")
            if isinstance(row.get("prompt"), str):
                prompts.append(Prompt(index=-1, text=row["prompt"], max_tokens=max_tokens))
            elif isinstance(row.get("messages"), list) and all(isinstance(m, dict) for m in row["messages"]):
                prompts.append(Prompt(index=-1, messages=tuple(row["messages"]), max_tokens=max_tokens))
            else:
                raise ValueError(f"{path}: item {number} has neither a 'prompt' string nor a 'messages' list")
        self._prompts = _ShuffledItems(prompts, seed, "jsonl")
        self.has_chats = any(p.is_chat for p in prompts)

    def __len__(self) -> int:
        return len(self._prompts)

    def prompt(self, index: int) -> Prompt:
        item: Prompt = self._prompts.item(index)
        return Prompt(index=index, text=item.text, messages=item.messages, max_tokens=item.max_tokens)


def open_prompt_source(
    kind: DatasetKind,
    *,
    path: str | Path | None = None,
    input_tokens: str = "128",
    output_tokens: str = "128",
    seed: int = 0,
    prefix_groups: int = 8,
    prefix_tokens: int = 256,
    turns: int = 4,
    chat: bool = False,
    trace_format: TraceFormat = "jsonl",
    trace_speedup: float = 1.0,
) -> PromptSource:
    """The prompt source a run's options name; a bad path or spec raises ValueError."""
    if kind == "synthetic":
        return SyntheticPrompts(LengthDistribution.parse(input_tokens), LengthDistribution.parse(output_tokens), seed)
    if kind == "shared_prefix":
        return SharedPrefixPrompts(prefix_groups, prefix_tokens, LengthDistribution.parse(input_tokens),
                                   LengthDistribution.parse(output_tokens), seed)
    if kind == "multi_turn":
        return MultiTurnSessions(turns, LengthDistribution.parse(input_tokens), LengthDistribution.parse(output_tokens),
                                 seed, chat=chat)
    if path is None:
        raise ValueError(f"dataset {kind!r} needs a path (--mtp-dataset-path)")
    if not Path(path).is_file():
        raise ValueError(f"dataset file not found: {path}")
    if kind == "gsm8k":
        return Gsm8kQuestions(path, seed)
    if kind == "jsonl":
        return JsonlPrompts(path, seed)
    if kind == "trace":
        return TracePrompts(load_trace(path, trace_format), seed, trace_speedup)
    raise ValueError(f"unknown dataset kind {kind!r} (synthetic, shared_prefix, multi_turn, gsm8k, jsonl or trace)")
