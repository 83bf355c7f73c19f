"""`deltas-ros`: the package's one command line. Each subcommand is a small function below.

    deltas-ros make-model --tiny OUT_DIR
    deltas-ros make-model --config qwen3_5_9b_config.json OUT_DIR
    deltas-ros synth OUT_BAG [--duration 30] [--fps 30] [--width 640] [--height 480]
                     [--encoding rgb8|jpeg] [--storage mcap|sqlite3] [--topic T] [--seed 0]
    deltas-ros replay BAG [--rate 1.0] [--loop] [--max-loops N] [--clock] [--topic T ...]
                      [--best-effort]
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


def synth_command(args: argparse.Namespace) -> int:
    """Write a generated camera stream with known events as a rosbag2 (plus events.json)."""
    from .bag import load_events
    from .synth import write_synth_bag

    out = write_synth_bag(
        args.out_bag,
        duration_s=args.duration,
        fps=args.fps,
        width=args.width,
        height=args.height,
        encoding=args.encoding,
        storage=args.storage,
        topic=args.topic,
        seed=args.seed,
    )
    print(f"wrote {out}")
    for event in load_events(out):
        span = f"{event['time']:8.3f} .. {event['end']:8.3f} s"
        print(f"  {span}  {event['kind']:6}  {event['label']}")
    return 0


def replay_command(args: argparse.Namespace) -> int:
    """Publish a bag's camera topics live on the recorded time line (like `ros2 bag play`)."""
    from .replay import replay_command as run

    return run(args)


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

    synth = commands.add_parser("synth", help=synth_command.__doc__)
    synth.add_argument("out_bag", help="bag directory to create (must not exist)")
    synth.add_argument("--duration", type=float, default=30.0, help="seconds")
    synth.add_argument("--fps", type=float, default=30.0)
    synth.add_argument("--width", type=int, default=640)
    synth.add_argument("--height", type=int, default=480)
    synth.add_argument("--encoding", default="rgb8", choices=["rgb8", "jpeg"])
    synth.add_argument("--storage", default="mcap", choices=["mcap", "sqlite3"])
    synth.add_argument("--topic", default="/camera/image_raw")
    synth.add_argument("--seed", type=int, default=0)
    synth.set_defaults(run=synth_command)

    replay = commands.add_parser("replay", help=replay_command.__doc__)
    replay.add_argument("bag", help="rosbag2 directory (MCAP or sqlite3)")
    replay.add_argument("--rate", type=float, default=1.0, help="playback speed factor")
    replay.add_argument("--loop", action="store_true", help="repeat the bag")
    replay.add_argument("--max-loops", type=int, help="stop after N passes (implies --loop)")
    replay.add_argument("--clock", action="store_true", help="publish the bag time on /clock")
    replay.add_argument(
        "--topic", action="append", help="image topic to replay (repeatable; default: all)"
    )
    replay.add_argument(
        "--best-effort", action="store_true", help="sensor-data QoS instead of reliable"
    )
    replay.set_defaults(run=replay_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as error:
        print(f"deltas-ros {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
