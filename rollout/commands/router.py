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

`add_parser(subparsers)` adds the command to the CLI's subparsers; `run(args)` runs it;
`python -m rollout.commands.router ...` runs it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from cluster.arms import BASELINE
from cluster.router import ArmWeights, RouterServer
from cluster.router_limits import DEFAULT_TOKEN_ENV, MIB, RouterLimits, limits_error

EXIT_OK = 0
EXIT_CANNOT_SERVE = 1
EXIT_USAGE = 2
PROG = "mtp-canary router"


@dataclass(frozen=True)
class RouterPlan:
    """What the command line asks for, validated."""

    arms: dict[str, list[str]]  # arm -> replica URLs, in the order given
    weights: ArmWeights
    limits: RouterLimits


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router", help="serve the router alone (no Ray) in front of servers that already run",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=URL",
                        help="a replica of arm NAME at base URL (repeat: more replicas, more arms); required")
    parser.add_argument("--weight", action="append", default=[], metavar="NAME=W",
                        help="traffic weight of arm NAME, 0..100 (relative); default: all to baseline, else even")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to listen on (default 127.0.0.1; beyond loopback the token is required)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: any free one, printed)")
    parser.add_argument("--max-body-mb", type=float, default=RouterLimits().max_body_bytes / MIB,
                        help="request body cap in MiB (default %(default)g; beyond it 413)")
    parser.add_argument("--max-connections", type=int, default=RouterLimits().max_connections,
                        help="open client connections (default %(default)s; beyond them 503)")
    parser.add_argument("--auth-token-env", default=DEFAULT_TOKEN_ENV, metavar="VAR",
                        help="environment variable holding the bearer token clients must send (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; the exit code."""
    try:
        plan = plan_from(args)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
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
    if args.max_body_mb <= 0:
        raise ValueError(f"--max-body-mb must be > 0, got {args.max_body_mb:g}")
    try:
        limits = RouterLimits(
            max_body_bytes=max(1, int(args.max_body_mb * MIB)), max_connections=args.max_connections,
            auth_token_env=args.auth_token_env,
        )
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
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0] if __doc__ else None)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
