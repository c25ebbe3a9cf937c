"""What a `speculative_config` is: the speculative methods vLLM 0.32 runs, the checks a config
must pass before a server starts, its draft depth k, and the label a report shows (pure).

An arm may speculate with any of vLLM's methods (MTP heads in the checkpoint, n-gram prompt
lookup, suffix decoding, a drafter model: EAGLE, DFlash, ...) or not at all (no
speculative_config: k = 0). The names and rules mirror vLLM 0.32 `vllm/config/speculative.py`
(SpeculativeMethod, RejectionSampleMethod, SpeculativeConfig.__post_init__ and
_resolve_synthetic_acceptance_rates), so that a config vLLM would refuse is refused here in one
line before any replica starts, and a config it accepts is accepted. Which methods run on the
CPU build: docs/speculative-methods.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "MTP_ALIASES",
    "DRAFTER_METHODS",
    "SPECULATIVE_METHODS",
    "REJECTION_SAMPLE_METHODS",
    "SUFFIX_DEFAULT_DEPTH",
    "speculative_config_error",
    "speculative_tokens",
    "speculative_label",
    "drafts_every_step",
]

# vLLM 0.32 MTPModelTypes: every name but "mtp" is deprecated there and read as "mtp"
MTP_ALIASES = frozenset({
    "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp", "glm_ocr_mtp",
    "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp", "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "qwen3_5_mtp",
    "longcat_flash_mtp", "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "kimi_k3_mtp",
    "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp", "hy_v4_mtp", "gemma4_mtp", "inkling_mtp", "glm5_next_mtp",
})
# methods whose drafts come from a separate checkpoint named by `model` (vLLM builds a draft
# ModelConfig from it; without one it raises "num_speculative_tokens was provided but without
# speculative model"); custom_class takes a dotted proposer path there
DRAFTER_METHODS = frozenset({"eagle", "eagle3", "dflash", "medusa", "mlp_speculator", "draft_model", "custom_class"})
# vLLM 0.32 SpeculativeMethod, the MTP aliases included
SPECULATIVE_METHODS = frozenset({
    "mtp", "ngram", "[ngram]", "ngram_gpu", "suffix", "dspark", "extract_hidden_states", *DRAFTER_METHODS, *MTP_ALIASES,
})
REJECTION_SAMPLE_METHODS = ("standard", "block", "synthetic")
# methods that propose only where the text repeats itself (a lookup in the prompt and output, or
# in a suffix tree of past outputs): a request may get no draft at all and the method still works
LOOKUP_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})
# suffix decoding without num_speculative_tokens: vLLM takes suffix_decoding_max_tree_depth (default 24) as k
SUFFIX_DEFAULT_DEPTH = 24
_SYNTHETIC_FIELDS = ("synthetic_acceptance_rates", "synthetic_acceptance_length")


def _method(config: Mapping[str, Any]) -> str:
    """The method vLLM runs: the given one with its aliases resolved, else what vLLM infers from `model`."""
    method = config.get("method")
    if method is None:
        model = str(config.get("model") or "")
        return "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    if method in MTP_ALIASES:
        return "mtp"
    return "ngram" if method == "[ngram]" else str(method)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _k_error(config: Mapping[str, Any]) -> str | None:
    # k may be left out: vLLM then takes the drafter's own (n_predict, the checkpoint's MTP
    # depth, suffix decoding's tree depth); 0 is no speculation, which leaves the config out
    k = config.get("num_speculative_tokens")
    if k is not None and not _is_count(k):
        return (f"num_speculative_tokens must be an integer >= 1, got {k!r} (an arm without speculation leaves "
                "speculative_config out)")
    return None


def _ngram_error(config: Mapping[str, Any]) -> str | None:
    low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if value is not None and not _is_count(value):
            return f"{name} must be an integer >= 1, got {value!r}"
    if low is not None and high is not None and low > high:
        return f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}"
    return None


def _rejection_error(config: Mapping[str, Any], k: int) -> str | None:
    rejection = config.get("rejection_sample_method", "standard")
    if rejection not in REJECTION_SAMPLE_METHODS:
        return f"rejection_sample_method {rejection!r} is not one of {', '.join(REJECTION_SAMPLE_METHODS)}"
    given = [name for name in _SYNTHETIC_FIELDS if config.get(name) is not None]
    if rejection != "synthetic":
        if given:
            return f"{given[0]} is only valid with rejection_sample_method 'synthetic'"
        return None
    if config.get("num_speculative_tokens") is None:
        return "rejection_sample_method 'synthetic' needs num_speculative_tokens (its profile has one rate per position)"
    if len(given) != 1:
        return "rejection_sample_method 'synthetic' needs exactly one of synthetic_acceptance_rates or " \
               "synthetic_acceptance_length"
    rates, length = config.get("synthetic_acceptance_rates"), config.get("synthetic_acceptance_length")
    if rates is not None:
        if not isinstance(rates, list) or len(rates) != k:
            return f"synthetic_acceptance_rates must list {k} rates (one per draft position), got {rates!r}"
        if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r <= 1.0 for r in rates):
            return f"synthetic_acceptance_rates entries must be in [0, 1], got {rates!r}"
        if any(rates[i] > rates[i - 1] for i in range(1, len(rates))):
            return f"synthetic_acceptance_rates must be non-increasing, got {rates!r}"
        return None
    if not isinstance(length, (int, float)) or isinstance(length, bool) or not 1.0 <= length <= k + 1:
        return f"synthetic_acceptance_length must be in [1, {k + 1}], got {length!r}"
    return None


def speculative_config_error(config: Any) -> str | None:
    """Why vLLM 0.32 would refuse ``config`` (one line naming the field), or None when it is accepted.

    What is checked is what vLLM checks before it loads anything: a known method (or a draft
    `model` to infer it from), a drafter for the methods that need one, k, the n-gram window and
    the verification method with its synthetic profile. Whether the method runs on a device (a
    package such as arctic-inference for suffix decoding, CUDA kernels) is the server's to say.
    """
    if not isinstance(config, Mapping):
        return f"must be a mapping such as {{method: mtp, num_speculative_tokens: 1}}, got {type(config).__name__}"
    given = config.get("method")
    if given is None and not config.get("model"):
        return "needs a 'method' (e.g. 'mtp', 'ngram', 'suffix', 'dflash') or a draft 'model'"
    if given is not None and given not in SPECULATIVE_METHODS:
        known = sorted(SPECULATIVE_METHODS - MTP_ALIASES - {"[ngram]"})
        return f"method {given!r} is not one of vLLM 0.32's speculative methods ({', '.join(known)})"
    if config.get("tensor_parallel_size") is not None:
        return "tensor_parallel_size is not a speculative_config key: vLLM takes draft_tensor_parallel_size there"
    method = _method(config)
    if method in DRAFTER_METHODS and not config.get("model"):
        return f"method {method!r} drafts with a separate checkpoint: give its 'model' (path or hub id)"
    error = _k_error(config)
    if error is None and method in ("ngram", "ngram_gpu"):
        error = _ngram_error(config)
    return error or _rejection_error(config, speculative_tokens(config))


def speculative_tokens(config: Mapping[str, Any] | None) -> int:
    """k: the draft tokens per step (at most, for suffix decoding); 0 without speculation. Left out
    of the config, k is the drafter's own: suffix decoding's tree depth, else at least 1."""
    if not config:
        return 0
    k = config.get("num_speculative_tokens")
    if k is None and _method(config) == "suffix":
        return int(config.get("suffix_decoding_max_tree_depth") or SUFFIX_DEFAULT_DEPTH)
    return int(k or 1)


def speculative_label(config: Mapping[str, Any] | None) -> str:
    """How a report names an arm's speculation: 'no speculation', 'mtp k=2', 'ngram k=3',
    'suffix k<=24', 'dflash k=15 (z-lab/...)', with a verification other than standard after it
    ('mtp k=3, block verification', 'mtp k=3, synthetic acceptance [0.9, 0.6, 0.3]')."""
    if not config:
        return "no speculation"
    method = _method(config)
    k = speculative_tokens(config)
    if method == "suffix":
        label = f"suffix k<={k}"
    elif config.get("num_speculative_tokens") is None:
        label = f"{method} (k: the drafter's)"
    else:
        label = f"{method} k={k}"
    if method in DRAFTER_METHODS and config.get("model"):
        # a hub id as it is, a local drafter path by its last two parts (checkpoint/dflash)
        label += f" ({'/'.join(str(config['model']).rstrip('/').split('/')[-2:])})"
    rejection = config.get("rejection_sample_method", "standard")
    if rejection == "synthetic":
        profile = config.get("synthetic_acceptance_rates")
        length = config.get("synthetic_acceptance_length")
        label += f", synthetic acceptance {profile if profile is not None else f'length {length}'}"
    elif rejection != "standard":
        label += f", {rejection} verification"
    return label


def drafts_every_step(config: Mapping[str, Any] | None) -> bool:
    """Whether an engine with ``config`` drafts on every decode step whatever the text (a drafter or
    MTP head), so that a request without drafts means it is broken; False for lookup methods (ngram,
    suffix), which draft only where the text repeats, and without speculation."""
    return bool(config) and _method(config) not in LOOKUP_METHODS  # type: ignore[arg-type]
