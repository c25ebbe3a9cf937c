"""`mtp-canary make-model DIR`: write the tiny MiMo-V2 checkpoint the CPU runs and tests serve."""

from __future__ import annotations

import argparse
import sys

from rollout.commands.arguments import EXIT_USAGE, refuse_bad_environment


MAKE_MODEL_EPILOG = """\
Measured with the default size (24 layers, hidden 1024) on vLLM 0.32 CPU, 2 cores,
MTP k=3, 16 golden prompts x 48 tokens, server /metrics deltas
(reproduce: python benchmarks/tiny_checkpoint.py --noise 0 2 4 6 8 12 16):
  --draft-noise  acceptance rate  mean acceptance length  per position
       0-4           1.000              4.00              1.00 1.00 1.00
       6             0.938              3.81              0.97 0.95 0.90
       8             0.510              2.53              0.69 0.48 0.36
      12             0.098              1.30              0.23 0.06 0.01
      16             0.029              1.09              0.08 0.01 0.00
More noise -> fewer accepted drafts, monotonically. Single-stream TPOT p50 with
perfect drafts: k=1 26.0 ms, k=3 12.2 ms (2.1x lower); server start 26-29 s.
"""


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    make = sub.add_parser(
        "make-model",
        help="write the tiny MiMo-V2 checkpoint (config, tokenizer, constructed weights, golden.jsonl)",
        epilog=MAKE_MODEL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    make.add_argument("dir")
    make.add_argument("--draft-noise", type=float, default=0.0, help="noise on the MTP layer: 0 = drafts always accepted")
    make.add_argument("--draft-decay", type=float, default=0.0, help="share of drafts after the first that are wrong")
    make.add_argument("--broken", action="store_true", help="greedy outputs differ from the golden continuations")
    make.add_argument("--mtp-layers", type=int, default=1, help="MTP layers in the checkpoint (vLLM 0.32 loads only layer 0)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--num-layers", type=int, default=None, help="decoder layers (default 24, or --auto-size)")
    make.add_argument("--hidden-size", type=int, default=None, help="width, a multiple of 256 (default 1024, or --auto-size)")
    make.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default=None,
        help="config.json torch_dtype, what --dtype auto serves (default bfloat16, or --auto-size: float32 without native bf16)",
    )
    make.add_argument(
        "--auto-size", action="store_true",
        help="size depth (width) and dtype for this machine by a short cached probe: k=1 TPOT ~25 ms at 1 thread; "
        "explicit --num-layers/--hidden-size/--dtype win",
    )
    make.set_defaults(handler=run)
    return make


def run(args: argparse.Namespace) -> int:
    from tinymodel.checkpoint import DEFAULT_CACHE, TinyCheckpointSpec, write_checkpoint

    layers, hidden, dtype = args.num_layers, args.hidden_size, args.dtype
    if args.auto_size:
        from rollout.config import TinyModelOptions
        from tinymodel.sizing import size_tiny_model

        try:
            options = TinyModelOptions(num_layers=layers, hidden_size=hidden, dtype=dtype)
        except ValueError as exc:
            print(f"mtp-canary make-model: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if refuse_bad_environment("make-model"):
            return EXIT_USAGE
        sizing = size_tiny_model(DEFAULT_CACHE, print, options=options)  # explicit flags win over the probe
        layers, hidden, dtype = sizing.num_layers, sizing.hidden_size, sizing.dtype
    try:
        spec = TinyCheckpointSpec.sized(
            layers,
            hidden,
            draft_noise=args.draft_noise,
            draft_decay=args.draft_decay,
            broken=args.broken,
            mtp_layers=args.mtp_layers,
            seed=args.seed,
            **({"torch_dtype": dtype} if dtype else {}),
        )
    except ValueError as exc:
        print(f"mtp-canary make-model: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = write_checkpoint(args.dir, spec)
    print(
        f"wrote tiny MiMo-V2 checkpoint to {out}: {spec.num_layers} layers x hidden {spec.hidden_size}, "
        f"serve with --dtype {spec.torch_dtype} (golden prompts: {out / 'golden.jsonl'})"
    )
    return 0
