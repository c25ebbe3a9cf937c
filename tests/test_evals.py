"""Eval items: loading, gsm8k prompt and extraction, scoring, divergence, and requests to a real vLLM."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rollout.evals import (
    GSM8K_STOP,
    EvalItem,
    EvalSpec,
    ItemOutcome,
    completion_request,
    evaluate_batch,
    extract_last_integer,
    gsm8k_gold_answer,
    gsm8k_prompt,
    load_gsm8k_fewshot,
    load_items,
    outputs_differ,
    score,
)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# -- loading -----------------------------------------------------------------------------------


def test_golden_ids_load_in_file_order_without_shuffle(tmp_path):
    path = write_jsonl(
        tmp_path / "g.jsonl",
        [
            {"id": "a", "prompt_token_ids": [5, 6], "expected_token_ids": [7, 8, 9]},
            {"prompt_token_ids": [1], "expected_token_ids": [2], "prompt": "decoded text is ignored"},
        ],
    )
    items = load_items(EvalSpec(path=str(path), shuffle=False))
    assert [i.id for i in items] == ["a", "g-2"]
    assert items[0].prompt_token_ids == [5, 6] and items[0].expected_token_ids == [7, 8, 9]
    # ids are exact, so a decoded prompt next to them is dropped, not re-tokenised
    assert items[1].prompt is None and items[1].prompt_token_ids == [1]


def test_golden_text_forms(tmp_path):
    path = write_jsonl(
        tmp_path / "g.jsonl",
        [
            {"id": "t1", "prompt": "The capital of France is", "expected": " Paris"},
            {"id": "t2", "prompt": "1 2 3", "expected_text": " 4"},
            {"id": "t3", "prompt": "x", "expected": [3, 4]},
            "",  # blank lines are skipped
        ],
    )
    items = {i.id: i for i in load_items(EvalSpec(path=str(path)))}
    assert items["t1"].expected_text == " Paris" and items["t1"].expected_token_ids is None
    assert items["t2"].expected_text == " 4"
    assert items["t3"].expected_token_ids == [3, 4]


def test_shuffle_is_seeded_and_limit_takes_the_first_after_it(tmp_path):
    rows = [{"id": f"i{n}", "prompt_token_ids": [n + 1], "expected_token_ids": [n + 2]} for n in range(50)]
    path = str(write_jsonl(tmp_path / "g.jsonl", rows))
    first = [i.id for i in load_items(EvalSpec(path=path, seed=3))]
    again = [i.id for i in load_items(EvalSpec(path=path, seed=3))]
    other = [i.id for i in load_items(EvalSpec(path=path, seed=4))]
    assert first == again != other
    assert sorted(first) == sorted(r["id"] for r in rows)
    assert first != [r["id"] for r in rows]
    assert [i.id for i in load_items(EvalSpec(path=path, seed=3, limit=7))] == first[:7]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt_token_ids": [1]}', "needs exactly one of 'answer', 'expected_token_ids' and 'expected_text'"),
        ('{"expected_token_ids": [1]}', "needs exactly one of 'prompt' and 'prompt_token_ids'"),
        ('{"prompt_token_ids": [1], "expected_token_ids": []}', "'expected_token_ids' is empty"),
        ('{"prompt_token_ids": ["a"], "expected_token_ids": [2]}', "prompt_token_ids.0"),
        ('{"prompt": "p", "expected_ids": [2]}', "unknown field(s) ['expected_ids']"),
        ('{"prompt": "p", "expected": "a", "expected_text": "b"}', "not both"),
    ],
)
def test_bad_golden_line_is_named_in_the_error(tmp_path, line, message):
    good = json.dumps({"prompt_token_ids": [1], "expected_token_ids": [2]})
    path = write_jsonl(tmp_path / "bad.jsonl", [good, "", line])
    with pytest.raises(ValueError) as err:
        load_items(EvalSpec(path=str(path)))
    assert f"{path}:3:" in str(err.value)
    assert message in str(err.value)


def test_golden_file_problems_are_clear(tmp_path):
    with pytest.raises(ValueError, match="needs a 'path'"):
        load_items(EvalSpec(kind="golden"))
    with pytest.raises(ValueError, match="eval file not found: .*missing.jsonl"):
        load_items(EvalSpec(path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ValueError, match="no eval items"):
        load_items(EvalSpec(path=str(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))))
    dup = {"id": "same", "prompt_token_ids": [1], "expected_token_ids": [2]}
    with pytest.raises(ValueError, match="duplicate item id 'same'"):
        load_items(EvalSpec(path=str(write_jsonl(tmp_path / "dup.jsonl", [dup, dup]))))


def test_spec_rejects_unknown_and_invalid_fields():
    with pytest.raises(ValueError):
        EvalSpec(kind="golden", pth="x.jsonl")
    with pytest.raises(ValueError):
        EvalSpec(kind="mmlu")
    with pytest.raises(ValueError):
        EvalSpec(concurrency=0)
    assert all(field.description for field in EvalSpec.model_fields.values())


def test_gsm8k_loads_the_vendored_test_split():
    items = load_items(EvalSpec(kind="gsm8k", shuffle=False))
    assert len(items) == 1319
    first = items[0]
    assert first.id == "gsm8k-0" and first.answer == "18"  # Janet's ducks
    assert first.prompt.startswith("Question: Natalia sold clips")  # first train shot
    assert first.prompt.endswith("How much in dollars does she make every day at the farmers' market?\nAnswer:")
    assert first.prompt.count("Question: ") == 6
    # gold answers keep sign and drop thousands separators
    answers = {i.answer for i in items}
    assert "-10" in answers and "1450000" in answers
    assert all(a == extract_last_integer(a) for a in answers)


def test_gsm8k_limit_fewshot_and_seed():
    items = load_items(EvalSpec(kind="gsm8k", limit=5, num_fewshot=0, seed=1))
    assert len(items) == 5
    assert all(i.prompt.startswith("Question: ") and i.prompt.count("Question: ") == 1 for i in items)
    assert [i.id for i in items] == [i.id for i in load_items(EvalSpec(kind="gsm8k", limit=5, seed=1))]


def test_bad_gsm8k_file_names_the_line(tmp_path):
    path = write_jsonl(
        tmp_path / "gsm.jsonl",
        [{"question": "q1", "answer": "so #### 3"}, {"question": "q2", "answer": "no final marker"}],
    )
    with pytest.raises(ValueError, match=rf"{path}:2: gsm8k 'answer' has no '#### <integer>'"):
        load_items(EvalSpec(kind="gsm8k", path=str(path)))
    path = write_jsonl(tmp_path / "gsm2.jsonl", [{"question": "q1"}])
    with pytest.raises(ValueError, match=rf"{path}:1: gsm8k lines need string fields"):
        load_items(EvalSpec(kind="gsm8k", path=str(path)))


# -- prompt and extraction ---------------------------------------------------------------------


def test_gsm8k_prompt_matches_vllms_format():
    shots = [{"question": "1+1?", "answer": "1+1=2\n#### 2"}, {"question": "2+3?", "answer": "#### 5"}]
    assert gsm8k_prompt("4+4?", shots) == (
        "Question: 1+1?\nAnswer: 1+1=2\n#### 2\n\n" "Question: 2+3?\nAnswer: #### 5\n\n" "Question: 4+4?\nAnswer:"
    )
    assert gsm8k_prompt("q", []) == "Question: q\nAnswer:"


def test_fewshot_is_the_first_train_examples():
    shots = load_gsm8k_fewshot(5)
    assert len(shots) == 5 and shots[0]["question"].startswith("Natalia sold clips")
    assert load_gsm8k_fewshot(0) == []


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 1,234.", "1234"),
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
        ("The temperature dropped to -10 degrees", "-10"),
        ("x = -3", "-3"),
        ("16-3-4=9", "9"),
        ("from 5-7", "7"),  # a range dash is not a sign
        ("3 apples and 12 pears.", "12"),
        ("It costs $2.50", "50"),  # vLLM's extraction reads the last digit run
        ("answer: 007", "7"),
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_last_integer(text, expected):
    assert extract_last_integer(text) == expected


def test_gsm8k_gold_answer():
    assert gsm8k_gold_answer("work\n#### 1,450,000") == "1450000"
    assert gsm8k_gold_answer("#### -3") == "-3"
    assert gsm8k_gold_answer("no marker 12") is None


# -- scoring and divergence --------------------------------------------------------------------


def test_score_gsm8k_by_last_integer():
    item = EvalItem(id="q", prompt="Question: ...\nAnswer:", answer="72")
    assert score(item, " 48 + 24 = 72 clips.\n#### 72\n\n", None) == (True, "72")
    assert score(item, " 48 + 24 = 72, so 73", None) == (False, "73")
    assert score(item, " I do not know", None) == (False, None)


def test_score_golden_ids_is_exact_on_the_expected_prefix():
    item = EvalItem(id="g", prompt_token_ids=[1, 2], expected_token_ids=[3, 4, 5])
    assert score(item, "", [3, 4, 5]) == (True, None)
    assert score(item, "", [3, 4, 5, 6]) == (True, None)  # longer output: only the expected length counts
    assert score(item, "", [3, 4, 6]) == (False, None)
    assert score(item, "", [3, 4]) == (False, None)  # stopped early
    assert score(item, "345", None) == (False, None)  # no ids: cannot be exact


def test_score_golden_text_is_a_prefix_match():
    item = EvalItem(id="t", prompt="The capital of France is", expected_text="Paris")
    assert score(item, " Paris, of course.", None)[0]
    assert not score(item, " Lyon", None)[0]


def test_item_needs_a_plain_integer_answer():
    with pytest.raises(ValueError, match="plain integer"):
        EvalItem(id="q", prompt="p", answer="1,000")


def outcome(item_id="i", text="x", ids=None, error=None, arm="baseline") -> ItemOutcome:
    return ItemOutcome(
        item_id=item_id, arm=arm, output_text=text, output_token_ids=ids, correct=error is None,
        extracted=None, error=error, latency_s=0.1,
    )


def test_outputs_differ():
    assert not outputs_differ(outcome(ids=[1, 2], text="a"), outcome(ids=[1, 2], text="a"))
    assert outputs_differ(outcome(ids=[1, 2]), outcome(ids=[1, 3]))
    # ids decide when both have them, even if the text agrees
    assert outputs_differ(outcome(ids=[1, 2], text="ab"), outcome(ids=[3], text="ab"))
    # else the text decides
    assert not outputs_differ(outcome(ids=[1], text="ab"), outcome(ids=None, text="ab"))
    assert outputs_differ(outcome(text="ab"), outcome(text="ac"))
    # a failed request is never agreement
    assert outputs_differ(outcome(text=""), outcome(text="", error="HTTP 500"))
    with pytest.raises(ValueError, match="different items"):
        outputs_differ(outcome(item_id="a"), outcome(item_id="b"))


def test_completion_request_is_greedy_and_sized_by_the_item():
    spec = EvalSpec(seed=7, max_tokens=64)
    golden = completion_request("m", EvalItem(id="g", prompt_token_ids=[1, 2], expected_token_ids=[3, 4, 5]), spec)
    assert golden["prompt"] == [1, 2] and golden["max_tokens"] == 3
    assert golden["temperature"] == 0.0 and golden["seed"] == 7 and golden["return_token_ids"] is True
    assert "stop" not in golden
    gsm = completion_request("m", EvalItem(id="q", prompt="Question: q\nAnswer:", answer="1"), spec)
    assert gsm["prompt"] == "Question: q\nAnswer:" and gsm["max_tokens"] == 64 and gsm["stop"] == GSM8K_STOP
    assert gsm["model"] == "m"
    sampled = completion_request("m", EvalItem(id="g", prompt_token_ids=[1, 2], expected_token_ids=[3]),
                                 EvalSpec(seed=7, temperature=1.0))
    assert sampled["temperature"] == 1.0 and sampled["seed"] == 7


# -- evaluate_batch against a scripted server --------------------------------------------------


class ScriptedCompletions(BaseHTTPRequestHandler):
    """Answers /v1/completions like vLLM: the expected continuation, except where told otherwise.

    Prompt [n] -> token ids [n+1, n+2]; prompt [99] -> HTTP 500; header arm 'liar' is
    answered as 'baseline' (a router that ignored the pin).
    """

    seen: list[tuple[str, dict]] = []
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        arm = self.headers.get("x-mtp-canary-arm", "")
        with self.lock:
            self.seen.append((arm, body))
        first = body["prompt"][0]
        if first == 99:
            self._reply(500, {"error": "boom"}, arm)
            return
        ids = [first + 1, first + 2][: body["max_tokens"]]
        served = "baseline" if arm == "liar" else arm
        self._reply(200, {"choices": [{"text": " ".join(map(str, ids)), "token_ids": ids}]}, served)

    def _reply(self, status, payload, arm):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-mtp-canary-arm", arm)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted_server():
    ScriptedCompletions.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedCompletions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_evaluate_batch_pins_arms_keeps_order_and_records_failures(scripted_server):
    items = [EvalItem(id=f"i{n}", prompt_token_ids=[n], expected_token_ids=[n + 1, n + 2]) for n in range(10)]
    items.append(EvalItem(id="broken-server", prompt_token_ids=[99], expected_token_ids=[100]))
    items.append(EvalItem(id="wrong", prompt_token_ids=[20], expected_token_ids=[21, 0]))
    progress: list[tuple[str, int]] = []
    results = evaluate_batch(
        scripted_server, "tiny", items, ["baseline", "canary"], EvalSpec(concurrency=3),
        on_item_done=lambda arm, done: progress.append((arm, done)),
    )
    assert list(results) == ["baseline", "canary"]
    for arm, outcomes in results.items():
        assert [o.item_id for o in outcomes] == [i.id for i in items]
        assert all(o.arm == arm for o in outcomes)
        by_id = {o.item_id: o for o in outcomes}
        assert all(by_id[f"i{n}"].correct and by_id[f"i{n}"].error is None for n in range(10))
        assert by_id["i3"].output_token_ids == [4, 5] and by_id["i3"].output_text == "4 5"
        assert not by_id["broken-server"].correct and "HTTP 500" in by_id["broken-server"].error
        assert not by_id["wrong"].correct and by_id["wrong"].error is None
    # every request pinned by header; identical bodies for both arms
    bodies = {arm: sorted(json.dumps(b, sort_keys=True) for a, b in ScriptedCompletions.seen if a == arm)
              for arm in ("baseline", "canary")}
    assert bodies["baseline"] == bodies["canary"] and len(bodies["baseline"]) == len(items)
    # progress per arm counts up to the number of items
    for arm in ("baseline", "canary"):
        assert [d for a, d in progress if a == arm] == list(range(1, len(items) + 1))


def test_evaluate_batch_rejects_an_answer_from_another_arm(scripted_server):
    items = [EvalItem(id="i", prompt_token_ids=[1], expected_token_ids=[2])]
    results = evaluate_batch(scripted_server, "tiny", items, ["liar"], EvalSpec())
    assert not results["liar"][0].correct
    assert "pinned to arm 'liar' but served by 'baseline'" in results["liar"][0].error


def test_evaluate_batch_unreachable_server_gives_failed_outcomes_not_none():
    from cluster.replica import free_port

    items = [EvalItem(id=f"i{n}", prompt="p", answer="1") for n in range(3)]
    results = evaluate_batch(f"http://127.0.0.1:{free_port()}", "tiny", items, ["baseline"], EvalSpec())
    assert [o.item_id for o in results["baseline"]] == ["i0", "i1", "i2"]
    assert all(not o.correct and "ConnectionError" in o.error for o in results["baseline"])


def test_evaluate_batch_rejects_duplicate_arms():
    with pytest.raises(ValueError, match="distinct"):
        evaluate_batch("http://127.0.0.1:1", "m", [], ["baseline", "baseline"], EvalSpec())


# evaluate_batch against real vLLM engines (k=1 and k=3, two servers): tests/test_fleet.py
