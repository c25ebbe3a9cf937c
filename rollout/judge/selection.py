"""The winner's curse of several candidates: the winner's TPOT p50 ratio is the lowest of K estimates.

Chosen for being low, it is biased low: had every candidate been as fast as the winner, the lowest
of K estimates with the same standard error se (on the log scale) would sit E[max of K standard
normals] x se below the truth (0.56 se for 2, 0.85 for 3, 1.03 for 4); candidates that truly differ
bias it less, so this is the most the selection can have moved it (the case of equal candidates).
The se is read off the winner's own interval: its upper bound's distance from the estimate over the
one-sided normal quantile at the alpha it was judged at (alpha / K), so a wider (drift-robust or t)
bound makes the se, and the bias said, larger. The winner's upper bound was held to alpha / K, which
keeps the false-promote rate at alpha across the K candidates; its point estimate has no such guard.
A run of the winner alone measures the ratio without selection.
"""

from __future__ import annotations

import math

from scipy import integrate, special

__all__ = ["expected_max_standard_normal", "winners_curse_note"]


def expected_max_standard_normal(k: int) -> float:
    """E[max of k independent standard normals] (0 for k = 1)."""
    if k <= 1:
        return 0.0
    value, _ = integrate.quad(
        lambda x: x * k * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * special.ndtr(x) ** (k - 1), -12, 12
    )
    return float(value)


def winners_curse_note(winner: str, ratio: float | None, interval: tuple[float, float] | None, candidates: int,
                       alpha: float) -> str | None:
    """One line on how far selection may have flattered the winner's ratio (None: one candidate, or no estimate)."""
    if candidates <= 1 or ratio is None or not ratio > 0:
        return None
    shift = expected_max_standard_normal(candidates)
    text = (f"winner's curse: {winner}'s TPOT p50 ratio {ratio:.3f} is the lowest of {candidates} estimates, chosen "
            "for being low")
    upper = interval[1] if interval is not None else None
    z_value = float(special.ndtri(1.0 - alpha)) if 0 < alpha < 1 else math.inf
    if upper is None or not upper > ratio or not math.isfinite(z_value):
        return text + "; a run of the winner alone measures it without selection"
    se = math.log(upper / ratio) / z_value
    unbiased = ratio * math.exp(shift * se)
    return (f"{text}: with {candidates} equally fast candidates the lowest would sit {shift:.2f} se "
            f"({100 * (math.exp(shift * se) - 1):.1f}%) below the truth, so read it as up to ~{unbiased:.3f} (its "
            f"upper bound at alpha {alpha:.3g}: {upper:.3f}); a run of the winner alone measures it without selection")
