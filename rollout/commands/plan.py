"""`mtp-canary plan CONFIG`: what a run would reserve and whether its nodes can run it, before
any engine starts (the plan itself: rollout.run.cluster_plan).

Exit 0: every check passed; 1: a check failed (one line per failure on stderr, naming the
node); 2: a bad config.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rollout.commands.arguments import parse_alone
from rollout.run.plan_defaults import PLACEMENT_PROBE_S  # light: the plan itself is imported when it runs


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser("plan", help="before reserving GPUs: placement, node environments, timeouts, GPU-hours",
                            description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the run's YAML config")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--placement-wait-s", type=float, default=PLACEMENT_PROBE_S,
                        help="how long to wait for the trial placement group (default %(default)s s)")
    parser.set_defaults(handler=run)
    return parser


def main(argv: Sequence[str] | None = None, modules: Sequence[str] | None = None) -> int:
    """`mtp-canary plan ...` parsed alone (`python -m rollout.commands.plan`, tests)."""
    return run(parse_alone(register, argv), modules=modules)


def run(args: argparse.Namespace, modules: Sequence[str] | None = None) -> int:
    """The plan made on the connected cluster and printed; 0 when every check passed, 1 if one failed.
    `modules`: what each node must import (default: what a run imports, RUN_MODULES)."""
    from rollout.config import ConfigError, load_config
    from rollout.run.cluster_plan import make_plan, render
    from rollout.run.node_check import RUN_MODULES

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"mtp-canary: bad config: {exc}", file=sys.stderr)
        return 2

    from cluster.ray_cluster import connect

    said = connect(cfg.ray.address)
    if not args.json:
        print(said)
    plan = make_plan(cfg, modules=RUN_MODULES if modules is None else modules, placement_wait_s=args.placement_wait_s)
    # what the plan can decide: each gate's detectable effect, and a warning per margin it cannot
    from rollout.judge.power import detectable_effects, render as render_power
    from rollout.run.plan_power import power_plan

    plan.notes += render_power(detectable_effects(power_plan(cfg)))
    print(json.dumps(plan.document(), indent=2, sort_keys=True) if args.json else render(plan))
    for failure in plan.failures:
        print(f"mtp-canary plan: {failure}", file=sys.stderr)
    return 0 if plan.ok else 1


if __name__ == "__main__":
    sys.exit(main())
