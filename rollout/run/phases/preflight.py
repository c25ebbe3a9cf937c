"""Preflight: every replica answers a smoke request, /metrics scrapes, and a speculative
canary really drafts (fail closed: a speculative config that never drafts is not the
config under test). Engine warnings are recorded, and what each server says it runs with
(its vLLM version and non-default args: decision.json arms.<arm>.servers.<replica>; its node,
GPUs and package versions: arms.<arm>.environment.<replica>).

The arms' configured engines were compared before anything started (rollout.engine_parity,
called by the config's validation): here only what the servers logged is recorded."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor, wait

import requests

from cluster.arms import CANARY
from cluster.bounded_body import BodyDeadlineError, BodyLimitError, read_bounded
from rollout.engine_parity import SERVER_LOG_NEEDLES, engine_run_from_log
from rollout.judge.verdicts import Decision, GateResult, Verdict
from rollout.record.result import PreflightSummary
from rollout.run.context import InfrastructureError, RunContext
from rollout.run.decision import Decided

SMOKE_PROMPT = "Question: 1 + 1?\nAnswer:"
SMOKE_MAX_BYTES = 1 << 20  # an answer of 8 tokens is well under a KiB
SAME_MTP_LAYER = "same MTP layer"  # vLLM's warning when k > 1 drafts reuse one MTP layer


class Preflight:
    name = "preflight"

    def enabled(self, ctx: RunContext) -> bool:
        return True

    def run(self, ctx: RunContext) -> Decided | None:
        ctx.say("preflight: smoke request to every replica")
        fleet = ctx.fleet
        answers = smoke_every_replica(fleet, ctx.served_model, ctx.cfg.preflight_timeout_s)
        metrics = fleet.metrics()
        missing = [h.name for h in fleet.replicas if h.name not in metrics]
        if missing:
            raise InfrastructureError(f"preflight: /metrics of {missing} could not be scraped")
        warnings = fleet.engine_warnings()
        ctx.result.engine_warnings = warnings
        self._record_servers(ctx)
        # several candidates: the canary's seat is empty until one wins; each candidate is checked below
        seat = CANARY if CANARY in ctx.engines else ctx.cfg.candidates[0].name
        canary_drafts = sum(metrics[h.name].spec_decode.drafts for h in fleet.handles(seat))
        k = ctx.engines[seat].num_speculative_tokens
        ctx.result.preflight = PreflightSummary(
            smoke_completion_tokens=answers,
            canary_speculative_tokens=k,
            canary_drafts=canary_drafts,
            notable_warnings={name: w[:3] for name, w in warnings.items() if w},
        )
        ctx.store.put_phase_result(ctx.run_id, "preflight", 1, ctx.result.preflight.document())
        for name, lines in warnings.items():
            for line in lines:
                if SAME_MTP_LAYER in line:
                    ctx.say(f"preflight: {name} engine warning: {line}")
                    break
        if ctx.cfg.candidates:
            self._check_candidates(ctx, metrics)
            return None
        if ctx.speculative_canary and canary_drafts <= 0:
            return self._fail_no_drafts(ctx, canary_drafts)
        ctx.event("preflight", "pass", f"canary drafts {canary_drafts:g}")
        return None

    @staticmethod
    def _record_servers(ctx: RunContext) -> None:
        """Each replica's vLLM version and non-default args, as its log says (a record for
        comparing what the engines really ran with; a replica not read is left out)."""
        lines = ctx.fleet.log_lines_with(SERVER_LOG_NEEDLES)
        environments = ctx.fleet.environments()  # node, GPUs, driver, CUDA, NCCL, torch, vLLM, Ray
        for handle in ctx.fleet.replicas:
            if handle.arm not in ctx.result.arms:
                continue
            if handle.name in lines:
                run = engine_run_from_log(lines[handle.name])
                ctx.result.arms[handle.arm].setdefault("servers", {})[handle.name] = run.model_dump(mode="json")
            if handle.name in environments:
                ctx.result.arms[handle.arm].setdefault("environment", {})[handle.name] = environments[handle.name]

    @staticmethod
    def _check_candidates(ctx: RunContext, metrics) -> None:
        """Each candidate's drafts (decision.json arms.<candidate>.preflight_drafts); a speculative
        candidate that never drafted loses (its preflight_speculation gate fails), the others go on."""
        for candidate in ctx.cfg.candidates:
            name = candidate.name
            drafts = sum(metrics[h.name].spec_decode.drafts for h in ctx.fleet.handles(name))
            ctx.result.arms[name]["preflight_drafts"] = drafts
            if ctx.engines[name].num_speculative_tokens > 0 and drafts <= 0:
                ctx.candidate_gates.setdefault(name, []).append(_no_drafts_gate(drafts, name))
                ctx.say(f"preflight: candidate {name} is configured to speculate but produced no drafts: it loses")
        ctx.event("preflight", "pass", "candidates' drafts: " + ", ".join(
            f"{c.name} {ctx.result.arms[c.name]['preflight_drafts']:g}" for c in ctx.cfg.candidates))

    @staticmethod
    def _fail_no_drafts(ctx: RunContext, canary_drafts: float) -> Decided:
        """A speculative canary that never drafted is not the config under test: ROLLBACK."""
        gate = _no_drafts_gate(canary_drafts, "canary")
        ctx.result.gates.append(gate)
        ctx.event("preflight", "fail", gate.detail)
        return Decided(Decision.ROLLBACK, gate.detail)


def _no_drafts_gate(drafts: float, arm: str) -> GateResult:
    return GateResult(
        name="preflight_speculation",
        metric="canary_drafts",
        baseline=None,
        canary=float(drafts),
        threshold=1.0,
        verdict=Verdict.FAIL,
        detail=f"{arm} is configured to speculate but produced no drafts in preflight",
    )


def smoke_every_replica(fleet, model: str, deadline_s: float) -> dict[str, int]:
    """replica name -> the completion tokens of its smoke answer. Every replica is asked at once and
    each answer read whole within deadline_s (preflight_timeout_s) and SMOKE_MAX_BYTES: a replica
    that trickles its answer or never ends it cannot hold the run. InfrastructureError names the
    first replica, in the fleet's order, that did not answer."""
    replicas = list(fleet.replicas)
    started = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=max(1, len(replicas)), thread_name_prefix="smoke")
    try:
        futures = [pool.submit(_smoke, h, model, fleet.upstream_key(h), started, deadline_s) for h in replicas]
        wait(futures)  # each ends by itself: every read and the whole answer within deadline_s
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return {handle.name: future.result() for handle, future in zip(replicas, futures)}


def _smoke(handle, model: str, api_key: str | None, started: float, deadline_s: float) -> int:
    late = f"preflight: replica {handle.name} did not answer within preflight_timeout_s ({deadline_s:g} s)"
    try:
        with requests.post(
            f"{handle.url}/v1/completions",
            json={"model": model, "prompt": SMOKE_PROMPT, "max_tokens": 8, "temperature": 0},
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            timeout=deadline_s,
            stream=True,
        ) as response:
            response.raise_for_status()
            body = read_bounded(response, SMOKE_MAX_BYTES, deadline_s, started)
        return json.loads(body)["usage"]["completion_tokens"]
    except (requests.Timeout, BodyDeadlineError):
        raise InfrastructureError(late) from None
    except (requests.RequestException, BodyLimitError, KeyError, TypeError, ValueError) as exc:
        raise InfrastructureError(f"preflight: replica {handle.name} did not answer: {exc}") from None
