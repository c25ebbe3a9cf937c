"""`mtp-canary router`: the run's router on its own, without Ray, in front of servers that already run.

    mtp-canary router --arm baseline=http://10.0.0.5:8000 --arm baseline=http://10.0.0.6:8000 \\
        --arm canary=http://10.0.0.7:8000 --weight baseline=95 --weight canary=5 --port 8080

The same `RouterServer` (cluster/router.py) a run starts as a Ray actor: weighted
arms (or pinned by the x-mtp-canary-arm header), least-outstanding replicas,
outlier ejection, and the `RouterLimits`. `--arm NAME=URL` once per replica;
without `--weight` everything goes to the arm named baseline (as a run's router
before its first judgement) or, with no such arm, evenly to all. It prints its URL,
serves until SIGINT or SIGTERM, then stops cleanly. Exit codes: 0 stopped by a
signal, 2 bad arguments, 1 could not listen. Its event loop is uvloop when that is
installed, as a Ray actor's is.

`register(subparsers)` adds the command (no import of the router's machinery: `--help` stays
fast); `run(args)` serves; `python -m rollout.commands.router ...` runs it alone.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable

from typing import TYPE_CHECKING, NamedTuple

from rollout.commands.arguments import parse_alone

if TYPE_CHECKING:
    import asyncio

    from cluster.router import ArmWeights
    from cluster.router_limits import RouterLimits

EXIT_OK = 0
EXIT_CANNOT_SERVE = 1
EXIT_USAGE = 2
PROG = "mtp-canary router"


class RouterPlan(NamedTuple):
    """What the command line asks for, validated."""

    arms: dict[str, list[str]]  # arm -> replica URLs, in the order given
    weights: ArmWeights
    limits: RouterLimits


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "router", help="serve the router alone (no Ray) in front of servers that already run",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=URL",
                        help="a replica of arm NAME at base URL (repeat: more replicas, more arms); required")
    parser.add_argument("--weight", action="append", default=[], metavar="NAME=W",
                        help="traffic weight of arm NAME, 0..100 (relative); default: all to baseline, else even")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to listen on (default 127.0.0.1; beyond loopback the token is required)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: any free one, printed)")
    # the limits' defaults are RouterLimits' own (cluster/router_limits.py), filled in by plan_from
    parser.add_argument("--max-body-mb", type=float, default=None,
                        help="request body cap in MiB (default: the router's, 16; beyond it 413)")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="open client connections (default: the router's; beyond them 503)")
    parser.add_argument("--auth-token-env", default=None, metavar="VAR",
                        help="environment variable holding the bearer token clients must send "
                             "(default MTP_CANARY_ROUTER_TOKEN)")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; the exit code."""
    try:
        plan = plan_from(args)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    import asyncio
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_serve(plan, args.host, args.port))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed, as Ray runs its async actors (the Router actor) unless RAY_USE_UVLOOP=0."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def plan_from(args: argparse.Namespace) -> RouterPlan:
    """The validated arms, weights and limits; ValueError naming the bad argument."""
    from pydantic import ValidationError

    from cluster.arms import BASELINE
    from cluster.router import ArmWeights
    from cluster.router_limits import MIB, RouterLimits, limits_error

    arms: dict[str, list[str]] = {}
    for name, url in _pairs(args.arm, "--arm", "NAME=URL"):
        arms.setdefault(name, []).append(url)
    if not arms:
        raise ValueError("give at least one --arm NAME=URL")
    weights: dict[str, float] = {}
    for name, text in _pairs(args.weight, "--weight", "NAME=W"):
        if name not in arms:
            raise ValueError(f"--weight {name}={text}: no --arm names arm {name!r} (arms: {', '.join(arms)})")
        try:
            weights[name] = float(text)
        except ValueError:
            raise ValueError(f"--weight {name}={text}: the weight must be a number") from None
    if not weights:
        weights = {arm: (100.0 if arm == BASELINE else 0.0) for arm in arms} if BASELINE in arms else dict.fromkeys(arms, 1.0)
    try:
        arm_weights = ArmWeights(weights)
    except ValueError as exc:
        raise ValueError(f"--weight: {exc}") from None
    if args.max_body_mb is not None and args.max_body_mb <= 0:
        raise ValueError(f"--max-body-mb must be > 0, got {args.max_body_mb:g}")
    given = {"max_body_bytes": None if args.max_body_mb is None else max(1, int(args.max_body_mb * MIB)),
             "max_connections": args.max_connections, "auth_token_env": args.auth_token_env}
    try:
        limits = RouterLimits(**{field: value for field, value in given.items() if value is not None})
    except ValidationError as exc:
        raise ValueError(f"limits: {limits_error(exc)}") from None
    return RouterPlan(arms, arm_weights, limits)


def _pairs(values: list[str], flag: str, form: str) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name.strip() or not rest.strip():
            raise ValueError(f"{flag} {value!r}: expected {form}")
        pairs.append((name.strip(), rest.strip()))
    return pairs


async def _serve(plan: RouterPlan, host: str, port: int) -> int:
    from cluster.router import RouterServer

    server = RouterServer(initial_weights=plan.weights.by_arm, limits=plan.limits)
    try:
        await server.set_arms(plan.arms)
    except ValueError as exc:  # a URL that is not http(s)://HOST[:PORT]
        print(f"{PROG}: --arm: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        url = await server.start(host, port)
    except RuntimeError as exc:  # beyond loopback without a token
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"{PROG}: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_CANNOT_SERVE
    import asyncio

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    arms = ", ".join(
        f"{arm} {len(urls)} replica(s) at {plan.weights.share(arm):.0%}" for arm, urls in plan.arms.items()
    )
    auth = f"token from {plan.limits.auth_token_env}" if plan.limits.auth_token() else "no token"
    print(f"{PROG}: listening on {url} ({arms}; {auth})", flush=True)
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await server.stop()
    print(f"{PROG}: stopped", flush=True)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """`mtp-canary router ...` parsed alone (`python -m rollout.commands.router`, tests)."""
    return run(parse_alone(register, argv))


if __name__ == "__main__":
    sys.exit(main())
