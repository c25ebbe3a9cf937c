"""The Locust web UI with the run's Rollout console tab, served by a phase's load master (the
experiment's, then the sweep's and the progressive load's at the same address)."""

from __future__ import annotations

from cluster.router_limits import is_loopback
from loadtests.console import TAB_TITLE, console_spec
from loadtests.swarm import SwarmSpec
from rollout.run.context import InfrastructureError, RunContext


def with_console(ctx: RunContext, spec: SwarmSpec, phase: str) -> SwarmSpec:
    """With experiment.web_ui: `spec` serving Locust's web UI and the run's Rollout console tab at
    the configured address (the experiment's master, then the progressive load's at the same URL)."""
    exp = ctx.cfg.experiment
    if not exp.web_ui:
        return spec
    if not is_loopback(exp.web_host) and ctx.cfg.router.auth_token() is None:
        # the console's Promote / Abort would answer anyone who reaches the port; a token made for the
        # run (beyond loopback the router gets one) is one the operator cannot type into the console
        raise InfrastructureError(
            f"experiment.web_host {exp.web_host} is beyond loopback and the run has no router token: set "
            f"{ctx.cfg.router.auth_token_env} (the console's buttons then need it) or serve the UI on 127.0.0.1"
        )
    ctx.say(f"{phase}: Locust web UI at http://{exp.web_host}:{exp.web_port} (the {TAB_TITLE} tab: "
            f"phase, looks, gates, canary weight, Promote / Abort) while the {phase}'s load runs")
    return console_spec(spec, ctx.run_id, ctx.run_dir.parent, host=exp.web_host, port=exp.web_port)
