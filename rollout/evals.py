"""Eval items of the accuracy phase: what to ask each arm, how to ask it, how to score it.

Two kinds of items:

* ``golden``: a JSONL set of prompts with the exact greedy continuation
  expected (the tiny checkpoint writes one; users may bring their own).
  Scored exactly on token ids when the set gives ids, by text prefix otherwise.
* ``gsm8k``: vLLM's 5-shot gsm8k eval (``tests/evals/gsm8k/gsm8k_eval.py``):
  "Question: ...\\nAnswer: ..." shots, stop at "Question", last integer of the
  output vs the gold "#### N" answer.

``evaluate_batch`` sends every item to every arm with identical greedy
sampling parameters and returns one ``ItemOutcome`` per item per arm, in item
order, so the paired statistics (``rollout.judge.accuracy.judge_accuracy`` /
``judge_divergence``) can line the arms up item by item. Nothing here judges.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any, Literal

import requests
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.arms import ARM_HEADER
from cluster.bounded_body import read_bounded

GSM8K_DIR = Path(__file__).parent / "data" / "gsm8k"
GSM8K_TEST = GSM8K_DIR / "test.jsonl"
GSM8K_TRAIN = GSM8K_DIR / "train.jsonl"

# vLLM's gsm8k eval stops at the next "Question" (the model starting a new
# shot); the other two end a turn in common chat-trained base models.
GSM8K_STOP = ["Question", "</s>", "<|im_end|>"]

# A minus sign counts only when it does not follow a word character, so the
# arithmetic "16-3-4=9" yields 16, 3, 4, 9 rather than -3 and -4, while
# "is -10" and "=-3" keep their sign (gsm8k has negative gold answers).
# one eval answer's body: a gsm8k answer of 256 tokens with its token ids is a few KB
EVAL_MAX_BYTES = 4 << 20


class EvalDeadlineError(TimeoutError):
    """A batch not answered by its deadline; the message names what each arm still owed."""


_INTEGER = re.compile(r"(?:(?<!\w)-)?\d+")
_GOLD_MARKER = "#### "


class EvalSpec(BaseModel):
    """Which eval items the accuracy phase sends, and how (the run YAML's `accuracy:` eval part)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["golden", "gsm8k"] = Field(
        "golden",
        description="golden: JSONL prompts with their exact expected greedy continuation; "
        "gsm8k: vLLM's 5-shot gsm8k eval (last-integer answer)",
    )
    path: str | None = Field(
        None,
        description="JSONL file of items. Required for golden (the controller fills in the tiny "
        "checkpoint's golden.jsonl); gsm8k defaults to the vendored rollout/data/gsm8k/test.jsonl",
    )
    limit: int | None = Field(None, ge=1, description="use only the first N items (after the shuffle)")
    num_fewshot: int = Field(5, ge=0, description="gsm8k: worked examples in the prompt, from the vendored train.jsonl")
    max_tokens: int = Field(
        256, ge=1, description="gsm8k (and golden items given as text): generation cap; golden ids use len(expected)"
    )
    seed: int = Field(0, description="seed of the item shuffle and of every request's sampling")
    # Speculative decoding must be lossless in distribution, not only under greedy decoding: sampled
    # items put the engine's rejection sampler (min(1, p/q) acceptance, residual resampling) to the test.
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=2.0,
        description="sampling temperature of the eval requests (0: greedy). Above 0: a golden item is right only "
        "when the sampled continuation is the expected one (a checkpoint as sharp as the tiny one, p ~ 0.999 per "
        "token, follows it unless the engine's sampled speculation is lossy); sampled outputs differ between arms "
        "by chance, so the output_divergence gate must be named in gates.disabled",
    )
    shuffle: bool = Field(
        True, description="shuffle items (seeded) so an early look at the first items sees a representative sample"
    )
    concurrency: int = Field(4, ge=1, description="requests in flight per arm")
    request_timeout_s: float = Field(300.0, gt=0, description="timeout of one eval request")


class EvalItem(BaseModel):
    """One question put to every arm, with what counts as a correct answer."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(..., min_length=1)
    prompt: str | None = Field(None, description="text prompt (gsm8k, or golden given as text)")
    prompt_token_ids: list[int] | None = Field(None, description="prompt as token ids (sent as ids, no re-tokenising)")
    answer: str | None = Field(None, description="gsm8k gold integer, as a string without commas")
    expected_token_ids: list[int] | None = Field(None, description="golden: exact greedy continuation ids")
    expected_text: str | None = Field(None, description="golden: expected continuation text (prefix match)")

    @model_validator(mode="after")
    def _one_prompt_and_one_expectation(self) -> "EvalItem":
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("needs exactly one of 'prompt' and 'prompt_token_ids'")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("'prompt_token_ids' is empty")
        if self.prompt_token_ids is not None and min(self.prompt_token_ids) < 0:
            raise ValueError("'prompt_token_ids' holds a negative id")
        expectations = [self.answer, self.expected_token_ids, self.expected_text]
        if sum(e is not None for e in expectations) != 1:
            raise ValueError("needs exactly one of 'answer', 'expected_token_ids' and 'expected_text'")
        if self.expected_token_ids is not None and not self.expected_token_ids:
            raise ValueError("'expected_token_ids' is empty")
        if self.expected_text is not None and not self.expected_text.strip():
            raise ValueError("'expected_text' is empty")
        if self.answer is not None and extract_last_integer(self.answer) != self.answer:
            raise ValueError(f"'answer' must be a plain integer, got {self.answer!r}")
        return self


class ItemOutcome(BaseModel):
    """What one arm answered to one item, and whether that was correct."""

    item_id: str
    arm: str
    output_text: str
    output_token_ids: list[int] | None = Field(None, description="generated token ids, when the server returned them")
    correct: bool
    extracted: str | None = Field(None, description="gsm8k: the integer read from the output; golden: None")
    error: str | None = Field(None, description="why the request failed (then correct is False); None on success")
    latency_s: float


# -- loading ---------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; ValueError naming file:line otherwise."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"eval file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read eval file {path}: {exc}") from None
    rows = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
        rows.append((line_no, row))
    if not rows:
        raise ValueError(f"{path}: no eval items")
    return rows


def _item_error(path: Path, line_no: int, exc: ValidationError) -> ValueError:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return ValueError(f"{path}:{line_no}: {where + ': ' if where else ''}{message}")


def _golden_item(path: Path, line_no: int, row: dict[str, Any]) -> EvalItem:
    known = {"id", "prompt", "prompt_token_ids", "expected_token_ids", "expected", "expected_text"}
    unknown = sorted(set(row) - known)
    if unknown:
        raise ValueError(f"{path}:{line_no}: unknown field(s) {unknown}; expected some of {sorted(known)}")
    fields = {k: row[k] for k in ("prompt", "prompt_token_ids", "expected_token_ids", "expected_text") if k in row}
    if "expected" in row:
        # "expected" is the short form: text, or a list of token ids.
        if "expected_text" in row or "expected_token_ids" in row:
            raise ValueError(f"{path}:{line_no}: give 'expected' or 'expected_text'/'expected_token_ids', not both")
        key = "expected_token_ids" if isinstance(row["expected"], list) else "expected_text"
        fields[key] = row["expected"]
    # The tiny checkpoint's golden.jsonl carries both the ids and their decoded
    # text; the ids are exact (no re-tokenisation), so they win.
    if "prompt_token_ids" in fields:
        fields.pop("prompt", None)
    item_id = row.get("id", f"{path.stem}-{line_no}")
    try:
        return EvalItem(id=str(item_id), **fields)
    except ValidationError as exc:
        raise _item_error(path, line_no, exc) from None


def gsm8k_gold_answer(answer_field: str) -> str | None:
    """The integer after gsm8k's "#### " marker, commas removed; None when absent."""
    if _GOLD_MARKER not in answer_field:
        return None
    return extract_last_integer(answer_field.rsplit(_GOLD_MARKER, 1)[1])


def _gsm8k_item(path: Path, line_no: int, row: dict[str, Any], index: int, fewshot: list[dict]) -> EvalItem:
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str):
        raise ValueError(f"{path}:{line_no}: gsm8k lines need string fields 'question' and 'answer'")
    gold = gsm8k_gold_answer(answer)
    if gold is None:
        raise ValueError(f"{path}:{line_no}: gsm8k 'answer' has no '#### <integer>' final answer")
    # Ids follow the position in the file, so they stay stable across shuffles.
    return EvalItem(id=f"gsm8k-{index}", prompt=gsm8k_prompt(question, fewshot), answer=gold)


def load_gsm8k_fewshot(num_fewshot: int, path: Path = GSM8K_TRAIN) -> list[dict]:
    """The first num_fewshot worked examples of the train split (as vLLM's eval takes them)."""
    if num_fewshot == 0:
        return []
    rows = _read_jsonl(path)
    if len(rows) < num_fewshot:
        raise ValueError(f"{path}: has {len(rows)} examples, num_fewshot is {num_fewshot}")
    shots = []
    for line_no, row in rows[:num_fewshot]:
        if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
            raise ValueError(f"{path}:{line_no}: gsm8k lines need string fields 'question' and 'answer'")
        shots.append({"question": row["question"], "answer": row["answer"]})
    return shots


def load_items(spec: EvalSpec) -> list[EvalItem]:
    """The eval items of a spec: read, validated, shuffled (seeded) and cut to spec.limit."""
    if spec.kind == "golden":
        if spec.path is None:
            raise ValueError("accuracy: kind 'golden' needs a 'path' to a JSONL file")
        path = Path(spec.path)
        items = [_golden_item(path, line_no, row) for line_no, row in _read_jsonl(path)]
    else:
        path = Path(spec.path) if spec.path is not None else GSM8K_TEST
        fewshot = load_gsm8k_fewshot(spec.num_fewshot)
        items = [
            _gsm8k_item(path, line_no, row, index, fewshot)
            for index, (line_no, row) in enumerate(_read_jsonl(path))
        ]
    seen: set[str] = set()
    for item in items:
        if item.id in seen:
            raise ValueError(f"{path}: duplicate item id {item.id!r}")
        seen.add(item.id)
    if spec.shuffle:
        random.Random(spec.seed).shuffle(items)
    return items[: spec.limit] if spec.limit is not None else items


# -- prompt, extraction, scoring ---------------------------------------------------------------


def gsm8k_prompt(question: str, fewshot: list[dict]) -> str:
    """vLLM's gsm8k completion prompt: worked shots, then the open question."""
    shots = "".join(f"Question: {shot['question']}\nAnswer: {shot['answer']}\n\n" for shot in fewshot)
    return f"{shots}Question: {question}\nAnswer:"


def extract_last_integer(text: str) -> str | None:
    """The last integer in text, commas removed and sign kept ("1,234." -> "1234"); None if none.

    vLLM's eval reads the last run of digits after dropping commas; this also
    keeps a leading minus (gsm8k has negative answers such as "#### -10") and
    normalises leading zeros so "007" equals "7".
    """
    matches = _INTEGER.findall(text.replace(",", ""))
    if not matches:
        return None
    return str(int(matches[-1]))


def score(item: EvalItem, output_text: str, output_token_ids: list[int] | None) -> tuple[bool, str | None]:
    """(correct, extracted answer) of one output for one item."""
    if item.answer is not None:
        extracted = extract_last_integer(output_text)
        return extracted == item.answer, extracted
    if item.expected_token_ids is not None:
        if output_token_ids is None:
            return False, None
        expected = item.expected_token_ids
        return list(output_token_ids[: len(expected)]) == expected, None
    assert item.expected_text is not None
    # Text golden sets are written by hand: a leading space is a tokeniser
    # detail, not a wrong answer.
    return output_text.lstrip().startswith(item.expected_text.lstrip()), None


def outputs_differ(a: ItemOutcome, b: ItemOutcome) -> bool:
    """Whether two arms' greedy outputs for the same item differ.

    Token ids when both have them (text can hide a difference, e.g. two
    tokenisations of the same string), else text. A failed request counts as
    differing: its output is unknown, and missing data must never look like
    agreement.
    """
    if a.item_id != b.item_id:
        raise ValueError(f"outcomes of different items: {a.item_id!r} vs {b.item_id!r}")
    if a.error is not None or b.error is not None:
        return True
    if a.output_token_ids is not None and b.output_token_ids is not None:
        return a.output_token_ids != b.output_token_ids
    return a.output_text != b.output_text


# -- requests --------------------------------------------------------------------------------


def completion_request(model: str, item: EvalItem, spec: EvalSpec) -> dict[str, Any]:
    """The /v1/completions body for an item: greedy (or at spec.temperature), seeded, identical for every arm."""
    body: dict[str, Any] = {
        "model": model,
        # vLLM accepts a list of ints as one tokenised prompt.
        "prompt": item.prompt_token_ids if item.prompt_token_ids is not None else item.prompt,
        "temperature": spec.temperature,
        "seed": spec.seed,
        "n": 1,
        "stream": False,
        # vLLM's CompletionResponseChoice.token_ids: exact scoring and divergence.
        "return_token_ids": True,
    }
    if item.expected_token_ids is not None:
        body["max_tokens"] = len(item.expected_token_ids)
    else:
        body["max_tokens"] = spec.max_tokens
    if item.answer is not None:
        body["stop"] = GSM8K_STOP
    return body


class _Requester:
    """Posts completions with one requests.Session per thread (Session is not thread-safe)."""

    def __init__(self, base_url: str, model: str, spec: EvalSpec, arm_header: str, token: str | None = None):
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.spec = spec
        self.arm_header = arm_header
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._local = threading.local()
        self.cancelled = threading.Event()  # the phase is past its deadline: reads in flight stop

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def run(self, item: EvalItem, arm: str) -> ItemOutcome:
        started = time.monotonic()
        try:
            text, token_ids = self._complete(item, arm)
        except Exception as exc:  # noqa: BLE001 - any failure is an incorrect, recorded outcome
            return ItemOutcome(
                item_id=item.id,
                arm=arm,
                output_text="",
                output_token_ids=None,
                correct=False,
                extracted=None,
                error=f"{type(exc).__name__}: {exc}"[:500],
                latency_s=time.monotonic() - started,
            )
        latency = time.monotonic() - started
        correct, extracted = score(item, text, token_ids)
        return ItemOutcome(
            item_id=item.id,
            arm=arm,
            output_text=text,
            output_token_ids=token_ids,
            correct=correct,
            extracted=extracted,
            error=None,
            latency_s=latency,
        )

    def _complete(self, item: EvalItem, arm: str) -> tuple[str, list[int] | None]:
        started = time.monotonic()
        # each answer whole within request_timeout_s and EVAL_MAX_BYTES: a replica answering every
        # read in time but never finishing (or never ending its body) fails that item, never hangs
        with self._session().post(
            self.url,
            json=completion_request(self.model, item, self.spec),
            headers={self.arm_header: arm, **self._auth},
            timeout=self.spec.request_timeout_s,
            stream=True,
        ) as response:
            body = read_bounded(response, EVAL_MAX_BYTES, self.spec.request_timeout_s, started, self.cancelled)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {body[:300].decode('utf-8', errors='replace')}")
        # A router answers with the arm that served; an answer from another arm
        # than the pinned one would silently pair the wrong outputs.
        served_by = response.headers.get(self.arm_header)
        if served_by is not None and served_by != arm:
            raise RuntimeError(f"pinned to arm {arm!r} but served by {served_by!r}")
        choices = json.loads(body).get("choices") or []
        if not choices:
            raise RuntimeError("response has no choices")
        choice = choices[0]
        text = choice.get("text")
        if not isinstance(text, str):
            raise RuntimeError("response choice has no text")
        token_ids = choice.get("token_ids")
        if token_ids is None and item.expected_token_ids is not None:
            raise RuntimeError("response has no token_ids (server ignores return_token_ids; vLLM >= 0.11 needed)")
        return text, token_ids


def evaluate_batch(
    base_url: str,
    model: str,
    items: Sequence[EvalItem],
    arms: Sequence[str],
    spec: EvalSpec,
    arm_header: str = ARM_HEADER,
    on_item_done: Callable[[str, int], None] | None = None,
    token: str | None = None,
    deadline: float | None = None,
) -> dict[str, list[ItemOutcome]]:
    """Every item to every arm (pinned by header), arms at the same time; outcomes in item order per arm.

    Each arm has its own pool of ``spec.concurrency`` threads, and requests
    are submitted interleaved (item 0 to every arm, then item 1, ...), so both
    arms see the same items in the same period of time. ``on_item_done(arm,
    done)`` is called on the caller's thread after each completed request.
    A failed request is an outcome with ``error`` set and ``correct`` False. ``deadline`` (a
    monotonic time): past it the reads in flight are cancelled and EvalDeadlineError names what
    each arm still owed.
    """
    if len(set(arms)) != len(arms):
        raise ValueError(f"arms must be distinct, got {list(arms)}")
    if not arms or not items:
        return {arm: [] for arm in arms}
    requester = _Requester(base_url, model, spec, arm_header, token)  # token: the router's bearer token
    pools = {arm: ThreadPoolExecutor(max_workers=spec.concurrency, thread_name_prefix=f"eval-{arm}") for arm in arms}
    slots: dict[Future, tuple[str, int]] = {}
    outcomes: dict[str, list[ItemOutcome | None]] = {arm: [None] * len(items) for arm in arms}
    done = {arm: 0 for arm in arms}
    finished = False
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        for index, item in enumerate(items):
            for arm in arms:
                slots[pools[arm].submit(requester.run, item, arm)] = (arm, index)
        for future in as_completed(slots, timeout=left):
            arm, index = slots[future]
            outcomes[arm][index] = future.result()  # run() records its own failures
            done[arm] += 1
            if on_item_done is not None:
                on_item_done(arm, done[arm])
        finished = True
    except FuturesTimeout:
        requester.cancelled.set()  # each read in flight ends at its next byte (silence: the router cuts it)
        owed = {arm: sum(o is None for o in outcomes[arm]) for arm in arms}
        raise EvalDeadlineError("; ".join(f"{arm}: {n} of {len(items)} items unanswered"
                                          for arm, n in owed.items() if n)) from None
    finally:
        # On an exception (e.g. KeyboardInterrupt) drop the queued requests and
        # do not wait for the in-flight ones (each may take request_timeout_s).
        for pool in pools.values():
            pool.shutdown(wait=finished, cancel_futures=True)
    result: dict[str, list[ItemOutcome]] = {}
    for arm in arms:
        missing = [items[i].id for i, o in enumerate(outcomes[arm]) if o is None]
        if missing:  # cannot happen after as_completed saw every future; never drop silently
            raise RuntimeError(f"arm {arm!r} has no outcome for items {missing[:5]}")
        result[arm] = [o for o in outcomes[arm] if o is not None]
    return result
