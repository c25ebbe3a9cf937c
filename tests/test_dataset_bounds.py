"""Datasets and lengths are bounded: a trace's or a distribution's token count beyond any model's
context, an overflowing number, a line or a file too large to read whole, each refused with a
one-line error naming the field (loadtests.datasets)."""

from __future__ import annotations

import json

import pytest

from loadtests import datasets
from loadtests.datasets import MAX_REQUEST_TOKENS, JsonlPrompts, LengthDistribution, load_trace


@pytest.mark.parametrize("line, field", [
    ('{"timestamp": 0, "input_tokens": 1e999, "output_tokens": 8}', "input_tokens"),  # OverflowError before
    ('{"timestamp": 0, "input_tokens": 10000000, "output_tokens": 8}', "input_tokens"),  # a 60 MB prompt
    ('{"timestamp": 0, "input_tokens": 8, "output_tokens": 1e7}', "output_tokens"),
])
def test_a_trace_row_beyond_the_bounds_is_refused_by_name(tmp_path, line, field):
    path = tmp_path / "trace.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=rf"trace.jsonl:1: {field}"):
        load_trace(path)


def test_a_burstgpt_row_that_overflows_is_refused_by_name(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Request tokens,Response tokens\n0,1e999,5\n")
    with pytest.raises(ValueError, match="burst.csv:2: Request tokens"):
        load_trace(path, "burstgpt")
    path.write_text("Timestamp,Request tokens,Response tokens\n0,5,1e999\n")
    with pytest.raises(ValueError, match="burst.csv:2: Response tokens"):
        load_trace(path, "burstgpt")


@pytest.mark.parametrize("spec", ["1e7", "10000000", "uniform:8:99999999", "1e999"])
def test_a_length_distribution_beyond_the_bound_is_refused(spec):
    with pytest.raises(ValueError):
        LengthDistribution.parse(spec)


def test_a_wide_distribution_never_samples_past_the_bound():
    import random

    dist = LengthDistribution.parse(f"lognormal:{MAX_REQUEST_TOKENS}:5")
    assert max(dist.sample(random.Random(i)) for i in range(200)) <= MAX_REQUEST_TOKENS


def test_a_file_or_line_too_large_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 5000}) + "\n")
    monkeypatch.setattr(datasets, "MAX_LINE_BYTES", 1000)
    with pytest.raises(ValueError, match="prompts.jsonl:1: a line longer than 1000"):
        JsonlPrompts(path)
    monkeypatch.setattr(datasets, "MAX_DATASET_BYTES", 100)
    with pytest.raises(ValueError, match="beyond the 100 a dataset may hold"):
        JsonlPrompts(path)
    path.write_text(json.dumps({"prompt": "p", "max_tokens": 10**9}) + "\n")
    monkeypatch.setattr(datasets, "MAX_DATASET_BYTES", 1 << 30)
    with pytest.raises(ValueError, match="max_tokens must be an integer from 1"):
        JsonlPrompts(path)
