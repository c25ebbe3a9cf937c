"""The arm names and the header that pins a request to an arm: one definition for the router and its clients.

Plain constants, so `rollout` (config, evals, the phases) can import them without importing Ray or aiohttp.
"""

from __future__ import annotations

__all__ = ["ARM_HEADER", "BASELINE", "CANARY"]

BASELINE = "baseline"
CANARY = "canary"

ARM_HEADER = "x-mtp-canary-arm"
