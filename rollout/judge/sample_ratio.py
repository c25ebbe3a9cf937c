"""The sample-ratio mismatch check (gate ``sample_ratio``): did every arm get the share of requests it was promised?

`judge_sample_ratio(counts, cfg, shares=None)` tests the requests each arm served
against the shares the pinning promised (the experiment pins every prompt to each
arm in turn: equal shares) and returns PASS, or INCONCLUSIVE naming the arms and
counts when the split is too lopsided to be chance. It never FAILs: a mismatch says
the experiment is broken (a dead or ejected replica, a router sending pinned
requests elsewhere, a load generator that dropped one arm's records), not that the
canary is worse, so the run must neither promote nor roll back on that data.

The test: two arms, the exact two-sided binomial test of n_first against
Binomial(n, share_first); more arms, Pearson's chi-square test. The level is
``cfg.sample_ratio_alpha`` (0.001, the level common A/B platforms use, so that the
check almost never fires on a healthy run, at every look: with L looks at most
L * 0.001 false inconclusives). A closed loop that alternates arms makes the
counts equal up to the requests in flight, far inside the test's tolerance;
tests/test_fail_closed_gates.py simulates both the healthy split and a lost replica.
"""

from __future__ import annotations

from collections.abc import Mapping

from scipy import stats as sps

from rollout.judge.config import GatesConfig
from rollout.judge.names import SAMPLE_RATIO_NAME
from rollout.judge.verdicts import GateResult, Verdict

__all__ = ["sample_ratio_pvalue", "judge_sample_ratio"]


def sample_ratio_pvalue(counts: Mapping[str, int], shares: Mapping[str, float]) -> float:
    """p-value of the counts under the promised shares (exact binomial for two arms, chi-square beyond)."""
    arms = list(shares)
    observed = [int(counts.get(arm, 0)) for arm in arms]
    total = sum(observed)
    if total == 0:
        return 1.0
    weights = [float(shares[arm]) for arm in arms]
    expected_share = [w / sum(weights) for w in weights]
    if len(arms) == 2:
        return float(sps.binomtest(observed[0], total, expected_share[0]).pvalue)
    return float(sps.chisquare(observed, [total * p for p in expected_share]).pvalue)


def judge_sample_ratio(
    counts: Mapping[str, int], cfg: GatesConfig, shares: Mapping[str, float] | None = None, look: int = 1
) -> GateResult:
    """PASS when the arms' request counts fit the promised shares (default: equal), else INCONCLUSIVE.

    ``counts``: requests each arm served so far (completed, errors included; cancelled
    ones are not counted). No requests at all: INCONCLUSIVE (missing data is never a pass).
    """
    shares = dict(shares) if shares is not None else {arm: 1.0 for arm in counts}
    if set(counts) - set(shares):
        raise ValueError(f"counts for arms without a promised share: {sorted(set(counts) - set(shares))}")
    n = {arm: int(counts.get(arm, 0)) for arm in shares}
    total = sum(n.values())
    arms = list(shares)
    tested = arms[-1]  # the canary with the experiment's (baseline, canary): its share is the estimate
    promised_share = shares[tested] / sum(shares.values())
    observed_share = (n[tested] / total) if total else None
    common = dict(
        name=SAMPLE_RATIO_NAME,
        metric=f"{tested}_share_of_requests",
        baseline=promised_share,  # the promised share, in the baseline column
        canary=observed_share,
        threshold=cfg.sample_ratio_alpha,
        estimate=observed_share,
        n_baseline=n[arms[0]],
        n_canary=n[tested],
        look=look,
    )
    split = ", ".join(f"{arm} {n[arm]}" for arm in arms)
    promised = ", ".join(f"{arm} {shares[arm] / sum(shares.values()):.3g}" for arm in arms)
    if total == 0:
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail="No requests served: the split cannot be checked.")
    p = sample_ratio_pvalue(n, shares)
    if p < cfg.sample_ratio_alpha:
        return GateResult(
            **common,
            p_value=p,
            verdict=Verdict.INCONCLUSIVE,
            detail=f"Sample-ratio mismatch: requests served {split} (of {total}) against promised shares {promised}, "
            f"p={p:.2g} < {cfg.sample_ratio_alpha:g}: a replica, the router or the load lost one arm's requests; "
            f"the comparison is not trusted.",
        )
    return GateResult(
        **common,
        p_value=p,
        verdict=Verdict.PASS,
        detail=f"Requests served {split} fit the promised shares {promised} (p={p:.2g} >= {cfg.sample_ratio_alpha:g}).",
    )
