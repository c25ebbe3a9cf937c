"""The goodput gate (``goodput_guard``): the share of requests that meet the SLO, canary against baseline, paired by prompt.

Goodput, as DistServe and ``vllm bench serve`` use the word: the share of requests that
succeeded and met every bound of ``gates.slo`` (TTFT, TPOT, E2E; any subset). A failed
request misses it; a cancelled one (cut off by the load stopping, not by the server) is
not a request, as everywhere in the judge. `arm_goodput` counts it per arm (decision.json's
``experiment.goodput``), `goodput_samples` pairs the arms' requests by prompt, and
`judge_goodput` judges the drop, baseline goodput - canary goodput, against
``gates.goodput_max_decrease``:

* PASS          the drop's upper bound is below the margin (the canary is shown to lose
                less than that many points);
* FAIL          the drop's lower bound is above the margin;
* INCONCLUSIVE  otherwise, and always with fewer than ``min_requests_per_arm`` pairs or
                with pairs from fewer than 2 blocks.

Why pairs: the experiment pins every prompt to each arm in turn, so prompt k's two
requests share its length and difficulty and were sent at nearly the same moment; their
difference cancels both. A pair is the j-th completed request of each arm for one
``dataset_index`` (a prompt the sequence served twice pairs twice); a request whose
partner has not completed (in flight at the look, or a faster arm's extra prompts under
``experiment.arm_users``) is left out of the comparison and counted in the detail.

The bounds at each look, built as the latency gates' are:

* Tango's paired score interval of p12 - p21 (``stats.tango_interval``, the accuracy
  gate's interval: good coverage with few discordant pairs and shares near 1), where p12
  is the share of pairs only the baseline met and p21 the share only the canary met;
* requests are not independent: a look is a block (without looks, a run of
  ``RUN_BLOCK_REQUESTS`` pairs). The design effect of the mean pair difference
  (cluster-robust variance over the blocks, G / (G - 1) small-sample factor, over the iid
  variance; floored at 1) scales the counts down, so a clustered sample of n pairs counts
  as n / deff independent ones (Rao & Scott 1981, JASA 76:221-230), and the critical value
  is the t quantile on G - 1 degrees of freedom at the look's alpha-spending level (the
  same t as the latency gates' Woodruff bands). Never narrower than the iid interval
  (deff >= 1, t >= z); no verdict before 2 blocks, so never at look 1;
* the repeated intervals of all looks so far are intersected
  (``latency.cumulative_bounds``): a verdict once reached is never taken back;
* both sides at ``alpha``: the promote side like every gate (intersection-union), the
  rollback side as a family of its own (not Holm-adjusted with the latency guardrails:
  the drop is a different question from a quantile ratio).

Claimed only as far as the simulation shows: ``rollout.calibration.calibrate`` puts the canary
exactly at the margin under a per-look arm-level latency (the ``limit/goodput_guard`` row).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cluster.arms import BASELINE, CANARY
from loadtests.records import RequestRecord
from rollout.judge import stats
from rollout.judge.config import GatesConfig, SloConfig
from rollout.judge.latency import RUN_BLOCK_REQUESTS, cumulative_bounds
from rollout.judge.looks import CODE_TO_VERDICT, interval_or_none, resolve_information, t_critical, upper_is_good_verdict, z
from rollout.judge.names import GOODPUT_NAME
from rollout.judge.verdicts import GateResult, Verdict

__all__ = ["ArmGoodput", "GoodputSamples", "meets_slo", "arm_goodput", "goodput_by_arm", "goodput_samples", "judge_goodput"]

ARMS = (BASELINE, CANARY)


class ArmGoodput(BaseModel):
    """One arm's goodput: of its completed requests (cancelled ones are not requests), how many met the SLO."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    share: float | None = Field(description="met / of; null when the arm completed no request.")
    met: int = Field(description="Requests that succeeded and met every bound of gates.slo.")
    of: int = Field(description="Completed requests, failed ones included.")


def _record_arm(record: RequestRecord) -> str | None:
    # the controller's rule (experiment_looks.record_arm, which imports this module): the arm that answered,
    # else the one the request was pinned to
    return record.arm if record.arm is not None else record.pinned_arm


def _tpot_s(record: RequestRecord) -> float | None:
    """TPOT for the SLO: a one-token output has no token after the first, so nothing to miss (0, as vllm bench).
    Unknown (no server token count) stays None, and None never meets a bound."""
    if record.output_tokens is not None and record.output_tokens < 2:
        return 0.0
    return record.tpot_s


def meets_slo(record: RequestRecord, slo: SloConfig) -> bool:
    """The request succeeded and every configured bound holds (a value it lacks, e.g. no TTFT, misses)."""
    if not record.ok:
        return False
    values = {"ttft_s": record.ttft_s, "tpot_s": _tpot_s(record), "e2e_s": record.e2e_s}
    # `not value <= bound` also misses a NaN
    return all(values[field] is not None and values[field] <= bound for field, bound in slo.bounds.items())


def arm_goodput(records: Sequence[RequestRecord], slo: SloConfig, arm: str) -> ArmGoodput:
    """Goodput of one arm over ``records`` (cancelled requests left out, failed ones count as misses)."""
    mine = [r for r in records if _record_arm(r) == arm and not r.cancelled]
    met = sum(1 for r in mine if meets_slo(r, slo))
    return ArmGoodput(share=met / len(mine) if mine else None, met=met, of=len(mine))


def goodput_by_arm(records: Sequence[RequestRecord], slo: SloConfig) -> dict[str, ArmGoodput]:
    return {arm: arm_goodput(records, slo, arm) for arm in ARMS}


@dataclass(frozen=True)
class GoodputSamples:
    """Both arms' requests paired by prompt: whether each pair's baseline and canary request met the SLO.

    Pairs are in completion order (the later of the two). ``look`` is, per pair, the look
    in which its second request arrived (None without looks); ``block`` the block of its
    variance (the look, else a run of `RUN_BLOCK_REQUESTS` pairs). ``arms``: every
    completed request of each arm, paired or not; ``unpaired``: how many of them had no
    partner (or no prompt index) and are left out of the comparison.
    """

    baseline_met: np.ndarray
    canary_met: np.ndarray
    block: np.ndarray
    look: np.ndarray | None
    arms: dict[str, ArmGoodput]
    unpaired: dict[str, int]

    @property
    def pairs(self) -> int:
        return int(self.baseline_met.size)


def goodput_samples(
    records: Sequence[RequestRecord], slo: SloConfig, looks_of: Sequence[int] | None = None
) -> GoodputSamples:
    """Pair the arms' completed requests by prompt (``dataset_index``), ``looks_of[i]`` the look of ``records[i]``."""
    if looks_of is not None and len(looks_of) != len(records):
        raise ValueError(f"one look per record needed: {len(looks_of)} for {len(records)} records")
    served: dict[str, dict[tuple[int, int], tuple[int, bool, int]]] = {arm: {} for arm in ARMS}
    occurrences: dict[str, dict[int, int]] = {arm: defaultdict(int) for arm in ARMS}
    met, of = dict.fromkeys(ARMS, 0), dict.fromkeys(ARMS, 0)
    for i, record in enumerate(records):
        arm = _record_arm(record)
        if arm not in served or record.cancelled:
            continue
        good = meets_slo(record, slo)
        of[arm] += 1
        met[arm] += good
        if record.dataset_index is None:
            continue
        index = int(record.dataset_index)
        j = occurrences[arm][index]
        occurrences[arm][index] = j + 1
        served[arm][(index, j)] = (i, good, int(looks_of[i]) if looks_of is not None else 0)
    keys = sorted(
        (key for key in served[BASELINE] if key in served[CANARY]),
        key=lambda key: max(served[BASELINE][key][0], served[CANARY][key][0]),
    )
    baseline = [served[BASELINE][key] for key in keys]
    canary = [served[CANARY][key] for key in keys]
    look = np.array([max(b[2], c[2]) for b, c in zip(baseline, canary)], dtype=int) if looks_of is not None else None
    return GoodputSamples(
        baseline_met=np.array([b[1] for b in baseline], dtype=bool),
        canary_met=np.array([c[1] for c in canary], dtype=bool),
        block=look if look is not None else np.arange(len(keys), dtype=int) // RUN_BLOCK_REQUESTS,
        look=look,
        arms={arm: ArmGoodput(share=met[arm] / of[arm] if of[arm] else None, met=met[arm], of=of[arm]) for arm in ARMS},
        unpaired={arm: of[arm] - len(keys) for arm in ARMS},
    )


def _design_effect(differences: np.ndarray, blocks: np.ndarray) -> float:
    """Cluster-robust variance of the mean pair difference over its iid variance, floored at 1.

    The G / (G - 1) small-sample factor as ``stats.design_effect``; no variance at all
    (every pair the same difference): 1, nothing to widen by.
    """
    centred = differences - differences.mean()
    iid = float(np.sum(centred**2))
    index = np.unique(blocks, return_inverse=True)[1]
    n_blocks = int(index.max()) + 1 if index.size else 0
    if iid <= 0.0 or n_blocks < 2:
        return 1.0
    sums = np.bincount(index, weights=centred, minlength=n_blocks)
    return max(n_blocks / (n_blocks - 1) * float(np.sum(sums**2)) / iid, 1.0)


@dataclass(frozen=True)
class _LookCounts:
    """One look's pairs as the interval needs them: design-effect-scaled counts and the t critical value."""

    only_baseline: float
    only_canary: float
    pairs: float
    crit: float
    deff: float
    blocks: int


def _look_counts(differences: np.ndarray, blocks: np.ndarray, z_value: float) -> _LookCounts:
    """Counts scaled down by the design effect (never below 1) and t on G - 1 df at the look's level."""
    deff = _design_effect(differences, blocks)
    n_blocks = int(np.unique(blocks).size)
    return _LookCounts(
        only_baseline=float(np.sum(differences > 0)) / deff,
        only_canary=float(np.sum(differences < 0)) / deff,
        pairs=differences.size / deff,
        crit=t_critical(z_value, n_blocks - 1),
        deff=deff,
        blocks=n_blocks,
    )


def _share_text(arm: ArmGoodput) -> str:
    return "n/a" if arm.share is None else f"{arm.share:.3f} ({arm.met}/{arm.of})"


def _counts_by_look(samples: GoodputSamples, differences: np.ndarray, looks: list[int], boundary_look: int,
                    planned: int, cfg: GatesConfig, fractions) -> tuple[np.ndarray, list[_LookCounts], str]:
    """Per look 1..boundary_look (the pairs judged by then): whether it can be judged, its scaled
    counts and critical value, and why the latest unusable one could not ("" once one could)."""
    usable = np.zeros(len(looks), dtype=bool)
    counts: list[_LookCounts] = []
    why_not = ""
    for i, lk in enumerate(looks):
        keep = samples.look <= lk if (samples.look is not None and lk < boundary_look) else np.ones(samples.pairs, dtype=bool)
        d, blocks = differences[keep], samples.block[keep]
        n_blocks = int(np.unique(blocks).size)
        if d.size < cfg.min_requests_per_arm:
            why_not = f"Too few prompts served by both arms ({d.size} < {cfg.min_requests_per_arm} pairs)."
            continue
        if n_blocks < 2:
            why_not = (f"Needs pairs from at least 2 blocks (has {n_blocks}): a latency level shared by one block's "
                       "requests cannot be told from the arms' difference inside it.")
            continue
        usable[i] = True
        counts.append(_look_counts(d, blocks, z(cfg.alpha, lk, planned, cfg, fractions)))
        why_not = ""
    return usable, counts, why_not


def judge_goodput(
    samples: GoodputSamples,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = None,
    information: Sequence[float] | None = None,
) -> GateResult:
    """Gate ``goodput_guard``: canary goodput >= baseline goodput - ``goodput_max_decrease``, on paired requests.

    ``look``/``max_looks``/``information`` as for the latency judge (``information``: the
    information fraction of every look 1..look, alpha spent at those). Without an SLO
    (``gates.slo`` null or empty) the gate is not enabled; called anyway it is INCONCLUSIVE.
    """
    margin = cfg.goodput_max_decrease
    slo = cfg.goodput_slo
    boundary_look, planned, note, fractions = resolve_information(look, max_looks, cfg, information)
    n = samples.pairs
    baseline = float(samples.baseline_met.mean()) if n else None
    canary = float(samples.canary_met.mean()) if n else None
    common = dict(
        name=GOODPUT_NAME, metric="goodput_drop", baseline=baseline, canary=canary, threshold=margin,
        estimate=None if baseline is None or canary is None else baseline - canary, n_baseline=n, n_canary=n, look=look,
    )
    if slo is None:
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail="No SLO configured (gates.slo): no goodput to judge.")
    differences = samples.baseline_met.astype(float) - samples.canary_met.astype(float)
    use_looks = samples.look is not None
    looks = list(range(1, boundary_look + 1)) if use_looks else [boundary_look]
    usable, counts, why_not = _counts_by_look(samples, differences, looks, boundary_look, planned, cfg, fractions)
    lower_own, upper_own = np.full(len(looks), -np.inf), np.full(len(looks), np.inf)
    if counts:  # one vectorised interval over the usable looks (the bisection is the judge's cost)
        lower_own[usable], upper_own[usable] = stats.tango_interval(
            np.array([c.only_baseline for c in counts]), np.array([c.only_canary for c in counts]),
            np.array([c.pairs for c in counts]), np.array([c.crit for c in counts]), np.array([c.crit for c in counts]),
        )
    now = counts[-1] if counts else None
    lower_all, upper_all = cumulative_bounds(lower_own, upper_own, usable)
    lower, upper = float(lower_all[-1]), float(upper_all[-1])
    any_usable = bool(usable.any())
    verdict = CODE_TO_VERDICT[int(upper_is_good_verdict(lower, upper, margin, any_usable, any_usable))]
    if verdict is Verdict.PASS:
        reason = f"Goodput drop upper bound {upper:.4f} < {margin:g}: the canary loses less than the margin."
    elif verdict is Verdict.FAIL:
        reason = f"Goodput drop lower bound {lower:.4f} > {margin:g}: the canary loses more than the margin."
    elif not any_usable:
        reason = why_not
    else:
        reason = f"Goodput drop interval [{lower:.4f}, {upper:.4f}] holds {margin:g}." + (f" {why_not}" if why_not else "")
    design = ""
    if now is not None:
        design = (f" Blocks: {'looks' if use_looks else f'runs of {RUN_BLOCK_REQUESTS} pairs'}; design effect "
                  f"{now.deff:.2f} over {now.blocks} blocks (counts scaled by it, t on {now.blocks - 1} df).")
    windows = f"intersected over {int(usable.sum())} look(s)" if usable.sum() > 1 else "this look"
    detail = (
        f"{reason} SLO: {slo.text()}. Paired over {n} prompts both arms served (only baseline met "
        f"{int(np.sum(differences > 0))}, only canary met {int(np.sum(differences < 0))}); all requests: baseline "
        f"{_share_text(samples.arms[BASELINE])}, canary {_share_text(samples.arms[CANARY])}; unpaired (left out): "
        f"baseline {samples.unpaired[BASELINE]}, canary {samples.unpaired[CANARY]}. Tango score bounds at alpha "
        f"{cfg.alpha:g} each side, look {boundary_look}/{planned} ({cfg.spending} spending), {windows}.{design}{note}"
    )
    bounded = any_usable and math.isfinite(lower) and math.isfinite(upper)
    return GateResult(
        **common,
        verdict=verdict,
        interval=interval_or_none(lower, upper) if bounded and lower <= upper else None,
        detail=detail,
    )
