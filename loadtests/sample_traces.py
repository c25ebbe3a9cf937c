"""The small request traces that ship with the project, and the code that writes them.

Trace replay needs traces, and none may be downloaded at run time, so the project makes
its own: seeded, small (a minute or two of traffic, prompts that fit the tiny checkpoint's
1,024-token context), one per format `loadtests.datasets.load_trace` reads:

- `sample.jsonl`: this project's format, bursty (gamma arrivals, shape 0.5), with sessions
  of three turns (each turn's prompt extends the last) and groups sharing a 300-word prefix
  (long enough to hit: vLLM's prefix cache on the hybrid MiMo-V2 hits whole 128-token blocks
  short of the prompt's last full one, so a shared prefix under ~2 blocks never hits);
- `mooncake_sample.jsonl`: Mooncake's format (timestamps in ms, KV block hash ids of 512
  tokens; the first block drawn from a few shared ones, as a system prompt is);
- `burstgpt_sample.csv`: BurstGPT's CSV, with a few failed requests (no response tokens)
  that replay leaves out.

`python -m loadtests.sample_traces DIR` writes them again; the shipped copies in
`loadtests/data/traces/` are its output (a test checks they are byte for byte).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
from pathlib import Path

SAMPLE_DIR = Path(__file__).resolve().parent / "data" / "traces"
SAMPLES = ("sample.jsonl", "mooncake_sample.jsonl", "burstgpt_sample.csv")


def _gamma_times(rng: random.Random, n: int, mean_gap_s: float, shape: float) -> list[float]:
    at, times = 0.0, []
    for _ in range(n):
        times.append(round(at, 3))
        at += rng.gammavariate(shape, mean_gap_s / shape)
    return times


def sample_jsonl(n: int = 120, seed: int = 0) -> str:
    rng = random.Random(f"mtp-sample-trace:{seed}")
    lines = []
    session_turns: dict[int, int] = {}
    for at in _gamma_times(rng, n, mean_gap_s=0.5, shape=0.5):
        row: dict[str, object] = {"timestamp": at, "output_tokens": rng.randint(8, 48)}
        kind = rng.random()
        if kind < 0.3:
            # a session: turns come in order, each prompt the last one's plus a new message
            session = rng.randrange(12)
            turn = session_turns.get(session, 0)
            if turn >= 3:
                session = 100 + len(session_turns)  # that one is over: a new session
                turn = 0
            session_turns[session] = turn + 1
            row.update(input_tokens=120 + 120 * turn + rng.randint(0, 20), session_id=f"s{session}")
        elif kind < 0.6:
            row.update(input_tokens=rng.randint(330, 420), prefix_id=f"p{rng.randrange(4)}", prefix_tokens=300)
        else:
            row["input_tokens"] = rng.randint(16, 200)
        lines.append(json.dumps(row, sort_keys=True))
    return "\n".join(lines) + "\n"


def mooncake_jsonl(n: int = 100, seed: int = 0) -> str:
    rng = random.Random(f"mtp-sample-mooncake:{seed}")
    lines, next_block = [], 1000
    for at in _gamma_times(rng, n, mean_gap_s=0.6, shape=0.7):
        input_length = rng.randint(100, 560)  # words: ~1.5 tiny-tokenizer tokens each
        blocks = [rng.randrange(8)]  # a shared first block (a system prompt)
        while len(blocks) * 512 < input_length:
            blocks.append(next_block)
            next_block += 1
        lines.append(json.dumps({"timestamp": int(at * 1000), "input_length": input_length,
                                 "output_length": rng.randint(8, 64), "hash_ids": blocks}))
    return "\n".join(lines) + "\n"


def burstgpt_csv(n: int = 100, seed: int = 0) -> str:
    rng = random.Random(f"mtp-sample-burstgpt:{seed}")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
    for at in _gamma_times(rng, n, mean_gap_s=0.5, shape=0.4):
        request = rng.randint(16, 400)
        response = 0 if rng.random() < 0.05 else rng.randint(8, 64)  # a failed request logs no response
        writer.writerow([f"{at:g}", rng.choice(["ChatGPT", "GPT-4"]), request, response, request + response,
                         "Conversation log"])
    return out.getvalue()


def sample_texts() -> dict[str, str]:
    return {"sample.jsonl": sample_jsonl(), "mooncake_sample.jsonl": mooncake_jsonl(),
            "burstgpt_sample.csv": burstgpt_csv()}


def write_samples(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in sample_texts().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description="write the sample traces the project ships")
    parser.add_argument("directory", nargs="?", type=Path, default=SAMPLE_DIR)
    for path in write_samples(parser.parse_args().directory):
        print(path)


if __name__ == "__main__":
    main()
