"""`deltas-ros`: the package's one command line. Each subcommand is a small function below.

    deltas-ros make-model --tiny OUT_DIR
    deltas-ros make-model --config qwen3_5_9b_config.json OUT_DIR
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def make_model_command(args: argparse.Namespace) -> int:
    """Write a random-init Qwen3.5 (weights, tokenizer, processor) that loads like real weights."""
    import torch

    from .model import config_from_file, make_model, tiny_config

    config = config_from_file(args.config) if args.config else tiny_config()
    dtype = getattr(torch, args.dtype)
    out = make_model(args.out_dir, config, seed=args.seed, dtype=dtype)
    print(f"wrote a random-init Qwen3.5 model to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltas-ros", description="DeltaS long-horizon video memory: tools."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser("make-model", help=make_model_command.__doc__)
    size = make.add_mutually_exclusive_group(required=True)
    size.add_argument("--tiny", action="store_true", help="a tiny CPU-sized model for tests")
    size.add_argument("--config", help="a Qwen3.5 config.json-style file (e.g. the 9B one)")
    make.add_argument("out_dir", help="directory to write")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    make.set_defaults(run=make_model_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        print(f"deltas-ros {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
