"""`deltas-ros`: the package's one command line. Each subcommand is a small function below.

    deltas-ros make-model --tiny OUT_DIR
    deltas-ros make-model --config config/models/qwen3_5_9b.json OUT_DIR [--shards N]
    deltas-ros synth OUT_BAG [--duration 30] [--fps 30] [--width 640] [--height 480]
                     [--encoding rgb8|jpeg] [--storage mcap|sqlite3] [--topic T] [--seed 0]
                     [--scenes | --busy]
    deltas-ros replay BAG [--rate 1.0] [--loop] [--max-loops N] [--clock] [--topic T ...]
                      [--best-effort]
    deltas-ros run BAG_OR_VIDEO [--model DIR] [--out results.jsonl] [--policy deltas]
                   [--budget 8192] [--window 1024] [--sinks 4] [--buckets 4]
                   [--pixel-budget N] [--fps 2] [--device auto] [--dtype auto] [--topic T]
                   [--ask "question" ...] [--max-new-tokens 64] [--quiet]
    deltas-ros plan [--model DIR [DIR ...] | --config FILE [FILE ...]] [--budget 8192 ...]
                    [--pixel-budget N] [--frame 640x480] [--device auto] [--dtype auto]
                    [--available-gib G] [--json | --markdown]
    deltas-ros plot RESULTS [RESULTS ...] [--out plot.png]
    deltas-ros ask "question" [--node /deltas_memory | --all [--json] [--discovery 3]]
                   [--max-new-tokens N] [--timeout 120] [--wait-idle]
    deltas-ros train [--config config/train_tiny.yaml] [--out out/train] [--resume]
                     [--device cpu|cuda] [--seed N] [--max-minutes M] [--max-steps N]
                     [--export NAME]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..core.config import ASK_TIMEOUT_S, DEFAULT_NODE, DTYPES, MemoryConfig, StreamConfig

# `run`'s options that set the MemoryConfig field of the same name (their dest).
RUN_CONFIG = ("budget_tokens", "sink_tokens", "window_tokens", "buckets", "policy",
              "max_new_tokens", "thinking", "host_budget_mb", "disk_budget_mb", "tier_dir",
              "recall_tokens")
# `synth`'s options that set write_synth_bag's argument of the same name (their dest).
SYNTH_OPTIONS = ("duration_s", "fps", "width", "height", "encoding", "storage", "topic", "seed")


def make_model_command(args: argparse.Namespace) -> int:
    """Write a random-init Qwen3.5 (weights, tokenizer, processor) that loads like real weights."""
    import torch

    from ..core.model_maker import config_from_file, make_model, tiny_config

    config = config_from_file(args.config) if args.config else tiny_config()
    dtype = getattr(torch, args.dtype)
    out = make_model(args.out_dir, config, seed=args.seed, dtype=dtype, shards=args.shards)
    files = len(list(out.glob("model*.safetensors")))
    layout = f" in the published layout ({files} weight files)" if args.shards else ""
    print(f"wrote a random-init Qwen3.5 model to {out}{layout}")
    return 0


def synth_command(args: argparse.Namespace) -> int:
    """Write a generated camera stream with known events as a rosbag2 (plus events.json)."""
    from ..training.scenes import SceneOptions, busy_options
    from ..training.synth import write_synth_bag
    from .bag import load_events

    scenes = (busy_options(args.duration_s) if args.busy else SceneOptions() if args.scenes
              else None)
    out = write_synth_bag(args.out_bag, scenes=scenes,
                          **{name: getattr(args, name) for name in SYNTH_OPTIONS})
    print(f"wrote {out}")
    for event in load_events(out):
        span = f"{event['time']:8.3f} .. {event['end']:8.3f} s"
        print(f"  {span}  {event['kind']:6}  {event['label']}")
    return 0


def replay_command(args: argparse.Namespace) -> int:
    """Publish a bag's camera topics live on the recorded time line (like `ros2 bag play`)."""
    import json

    from ..ros.replay import replay_bag, stop_on_signals
    from .bag import open_images

    stop_on_signals()
    stats = replay_bag(
        open_images(args.bag, args.topic),  # a bad bag or topic fails before any ROS set-up
        rate=args.rate,
        loop=args.loop or args.max_loops is not None,
        publish_clock=args.clock,
        max_loops=args.max_loops,
        reliable=not args.best_effort,
        wait_for_subscribers_s=args.wait,
    )
    print(json.dumps(stats))
    return 0


def run_command(args: argparse.Namespace) -> int:
    """Feed a bag or video file through the memory at the node's sampling, without ROS."""
    from ..core.loader import load_model, resolve_model_path, resolve_pixel_budget
    from ..core.memory import StreamingMemory
    from .offline import open_source, run_file

    model = resolve_model_path(args.model)
    config = MemoryConfig.from_mapping(
        {name: getattr(args, name) for name in RUN_CONFIG}
        | {"pixel_budget": resolve_pixel_budget(args.pixel_budget, model)})
    source = open_source(args.source, args.topic)  # a bad input fails before the model loads
    memory = StreamingMemory(load_model(model, args.device, args.dtype), config)
    summary, asked = run_file(memory, source, args.out, questions=args.ask or (),
                              fps=args.fps, progress=not args.quiet)
    held = summary.retained_times
    span = f", {held[0]:.2f}-{held[-1]:.2f} s" if held else ""
    print(f"{source.kind} {source.path}: {summary.frames} frames, {summary.sampled} sampled, "
          f"{summary.bad_frames} bad, {summary.chunks} chunks, {summary.resets} resets "
          f"in {summary.wall_s:.1f} s")
    reasons = sorted(summary.bad_frame_reasons.items(), key=lambda item: -item[1])
    for reason, count in reasons[:5]:
        print(f"  bad frame x{count}: {reason}")
    print(f"memory ({config.policy}): {summary.kv_tokens}/{config.budget_tokens} tokens, "
          f"holds {len(held)} of {summary.chunks} chunks{span}")
    for item in asked:
        evidence = ", ".join(f"{t:.2f} s" for t in item.evidence_times) or "none"
        reasoning = f"   reasoning: {item.reasoning}\n" if item.reasoning else ""
        recalled = (f", {item.recalled_chunks} chunks recalled ({item.recalled_from_disk} "
                    f"from disk)" if item.recalled_chunks else "")
        print(f"Q: {item.question}\n{reasoning}A: {item.text}\n   evidence at {evidence} "
              f"({item.latency_ms:.0f} ms{recalled})")
    print(f"wrote {args.out}")
    return 0


def plan_command(args: argparse.Namespace) -> int:
    """Memory a model, a budget M and a pixel budget need on a device, and whether they fit."""
    import json

    import torch

    from ..core.config import DEFAULT_PIXEL_BUDGET
    from ..core.loader import (
        resolve_device,
        resolve_dtype,
        resolve_model_path,
        resolve_pixel_budget,
    )
    from ..core.plan import PlanInputs, markdown_table, plan_for_path

    sources = args.config or [resolve_model_path(path) for path in args.model or [None]]
    height, width = parse_frame(args.frame)
    # With --available-gib the plan is for another machine: any device name is accepted.
    device = (torch.device(args.device) if args.available_gib is not None and args.device != "auto"
              else resolve_device(args.device))
    available = None if args.available_gib is None else int(args.available_gib * 2**30)
    plans = []
    for source in sources:
        pixel_budget = ((args.pixel_budget or DEFAULT_PIXEL_BUDGET) if args.config
                        else resolve_pixel_budget(args.pixel_budget, source))
        for budget in args.budget:
            inputs = PlanInputs(
                budget_tokens=budget, pixel_budget=pixel_budget, frame=(height, width),
                fps=args.fps, frames_per_chunk=args.frames_per_chunk,
                answer_tokens=args.max_new_tokens, evidence_candidates=args.evidence_candidates,
                recall_tokens=args.recall_tokens,
                host_tier_bytes=int(args.host_budget_mb * 2**20),
                disk_tier_bytes=int(args.disk_budget_mb * 2**20))
            plans.append((Path(source).stem, plan_for_path(
                source, inputs, device, resolve_dtype(args.dtype, device), available)))
    if args.json:
        found = [plan.to_json() for _, plan in plans]
        print(json.dumps(found[0] if len(found) == 1 else found, indent=2))
    elif args.markdown:
        print(markdown_table(plans))
    else:
        print("\n\n".join(f"{name}, M = {plan.budget_tokens}\n{plan.summary()}"
                          for name, plan in plans))
    return 0 if all(plan.fits for _, plan in plans) else 1


def parse_frame(text: str) -> tuple[int, int]:
    """"WIDTHxHEIGHT" -> (height, width)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError as error:
        raise ValueError(f"--frame must be WIDTHxHEIGHT, e.g. 640x480, not {text!r}") from error
    return height, width


def plot_command(args: argparse.Namespace) -> int:
    """Plot drift over stream time and what each memory still holds, from results files."""
    from .plot import plot_results

    print(f"wrote {plot_results(args.results, args.out)}")
    return 0


def ask_command(args: argparse.Namespace) -> int:
    """Ask a running memory node a question (its ~/ask_memory service), or every one (--all)."""
    if args.all:
        return ask_all(args)
    if args.json:
        raise ValueError("--json goes with --all")
    from ..ros.ask_client import ask, format_response

    try:
        response = ask(args.question, args.node, args.max_new_tokens, args.timeout,
                       args.wait_idle)
    except TimeoutError as error:
        raise RuntimeError(str(error)) from error
    print(format_response(response))
    return 0 if response.success else 1


def ask_all(args: argparse.Namespace) -> int:
    """Every memory node on the graph at once, under one timeout; 0 when all answered."""
    from ..ros.ask_client import fleet_answers, fleet_report

    if args.discovery < 0:
        raise ValueError("--discovery must be >= 0 seconds")
    if args.node != DEFAULT_NODE or args.wait_idle:
        raise ValueError("--all asks every memory node: it takes neither --node nor --wait-idle")
    answers = fleet_answers(args.question, args.max_new_tokens, args.timeout, args.discovery)
    if not answers:
        raise RuntimeError("no memory node on the graph (no AskMemory service found)")
    print(fleet_report(answers, args.json))
    return 0 if all(a.answered for a in answers) else 1


def dashboard_command(args: argparse.Namespace) -> int:
    """Serve a live memory dashboard in the browser (read-only; 127.0.0.1 unless a token)."""
    from ..ros.dashboard import serve

    if args.token:
        print("warning: --token is readable by every user of this machine (the process list, "
              "/proc/PID/cmdline); give it with --token-file or $DELTAS_DASHBOARD_TOKEN",
              file=sys.stderr, flush=True)
    return serve(args.node, args.host, args.port, args.token, args.token_file,
                 tuple(args.allow_host))


def train_command(args: argparse.Namespace) -> int:
    """Train the tiny scene model (a Qwen3.5) on generated streams; see training/train.py."""
    from ..training.config import TrainConfig
    from ..training.train import Trainer

    cfg = TrainConfig.from_file(args.config, seed=args.seed, max_minutes=args.max_minutes,
                                max_steps=args.max_steps, threads=args.threads)
    if args.export:  # a running or stopped run's weights, to evaluate them where they stand
        trainer = Trainer(cfg, args.out, args.device, resume=True)
        print(f"step {trainer.step}'s weights in {trainer.export({}, args.export)}")
        return 0
    model = Trainer(cfg, args.out, args.device, args.resume).run()
    print(f"model in {model}")
    return 0


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """--device and --dtype, as the node's parameters of the same names take them."""
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPES))


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
    make.add_argument("--shards", type=int,
                      help="lay the directory out as a published checkpoint, the weights in "
                           "about N safetensors shards with their index (1: one file)")
    make.set_defaults(run=make_model_command)

    synth = commands.add_parser("synth", help=synth_command.__doc__)
    synth.add_argument("out_bag", help="bag directory to create (must not exist)")
    synth.add_argument("--duration", dest="duration_s", metavar="DURATION", type=float,
                       default=30.0, help="seconds")
    for flag, kind, default in (("--fps", float, 30.0), ("--width", int, 640),
                                ("--height", int, 480), ("--seed", int, 0)):
        synth.add_argument(flag, type=kind, default=default)
    synth.add_argument("--encoding", default="rgb8", choices=["rgb8", "jpeg"])
    synth.add_argument("--storage", default="mcap", choices=["mcap", "sqlite3"])
    synth.add_argument("--topic", default="/camera/image_raw")
    for flag, text in (("--scenes", "a scene stream: shapes the shipped model answers about"),
                       ("--busy", "a busy scene stream: up to 12 objects sharing shapes and "
                                  "colours; over 10 minutes, the hour world (5-minute parts, "
                                  "60 identities)")):
        synth.add_argument(flag, action="store_true", help=text)
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
    replay.add_argument("--wait", type=float, default=10.0,
                        help="seconds to wait for subscribers before publishing anyway")
    replay.set_defaults(run=replay_command)

    run = commands.add_parser("run", help=run_command.__doc__)
    run.add_argument("source", help="rosbag2 directory or video file (any OpenCV can read)")
    run.add_argument("--model", help="local Qwen3.5 model directory (default: the shipped "
                                      "scene model)")
    run.add_argument("--out", default="results.jsonl",
                     help="results file: JSON lines, or CSV when it ends in .csv")
    run.add_argument("--policy", default=MemoryConfig.policy,
                     help="retention signal (deltas, recency, uniform, random, ...; "
                          "default: %(default)s)")
    run.add_argument("--budget", dest="budget_tokens", metavar="BUDGET", type=int,
                     default=MemoryConfig.budget_tokens,
                     help="KV cache budget M in tokens (default: %(default)s)")
    run.add_argument("--window", dest="window_tokens", metavar="WINDOW", type=int,
                     default=MemoryConfig.window_tokens,
                     help="recent tokens always kept (default: %(default)s)")
    run.add_argument("--sinks", dest="sink_tokens", metavar="SINKS", type=int,
                     default=MemoryConfig.sink_tokens,
                     help="attention-sink tokens always kept (default: %(default)s)")
    run.add_argument("--buckets", type=int, default=MemoryConfig.buckets,
                     help="temporal buckets (default: %(default)s)")
    run.add_argument("--pixel-budget", type=int,
                     help="pixels per frame after resizing (default: the model's stored "
                          "budget, else 320x320; as the node)")
    run.add_argument("--fps", type=float, default=StreamConfig.fps,
                     help="frames sampled per second (default: %(default)s)")
    add_device_options(run)
    run.add_argument("--topic", help="a bag's image topic (default: its only one)")
    run.add_argument("--ask", action="append", metavar="QUESTION",
                     help="ask at the end of the stream (repeatable)")
    run.add_argument("--max-new-tokens", type=int, default=MemoryConfig.max_new_tokens,
                     help="longest answer in tokens (default: %(default)s)")
    run.add_argument("--thinking", action="store_true",
                     help="let the model reason first (the reasoning is printed apart)")
    tiers = run.add_argument_group("the second tier: what the budget lets go, kept for recall")
    tiers.add_argument("--host-budget-mb", type=float, default=MemoryConfig.host_budget_mb,
                       help="host memory for evicted chunks (default: %(default)s, none)")
    tiers.add_argument("--disk-budget-mb", type=float, default=MemoryConfig.disk_budget_mb,
                       help="disk for evicted chunks, under --tier-dir (default: %(default)s)")
    tiers.add_argument("--tier-dir", default=MemoryConfig.tier_dir,
                       help="directory of the disk tier")
    tiers.add_argument("--recall-tokens", type=int, default=MemoryConfig.recall_tokens,
                       help="tokens of tiered chunks a question may call back (default: "
                            "%(default)s, none)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(run=run_command)

    plan = commands.add_parser("plan", help=plan_command.__doc__)
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--model", action="extend", nargs="+",
                        help="local Qwen3.5 model directories (default: the shipped scene "
                             "model)")
    source.add_argument("--config", action="extend", nargs="+",
                        help="Qwen3.5 config.json-style files, e.g. "
                             "config/models/qwen3_5_9b.json")
    plan.add_argument("--budget", type=int, nargs="+", default=[MemoryConfig.budget_tokens],
                      help="KV cache budget M in tokens (several: one plan each; default: "
                           "%(default)s)")
    plan.add_argument("--pixel-budget", type=int,
                      help="pixels per frame after resizing (default: the model's stored "
                           "budget, else 320x320; as the node)")
    plan.add_argument("--frame", default="640x480", help="camera frame size, WIDTHxHEIGHT")
    plan.add_argument("--fps", type=float, default=StreamConfig.fps,
                      help="frames sampled per second (default: %(default)s)")
    plan.add_argument("--frames-per-chunk", type=int, default=StreamConfig.frames_per_chunk,
                      help="default: %(default)s")
    plan.add_argument("--max-new-tokens", type=int, default=MemoryConfig.max_new_tokens,
                      help="longest answer (default: %(default)s)")
    plan.add_argument("--evidence-candidates", type=int,
                      default=MemoryConfig.evidence_candidates,
                      help="chunks left out once each to find an answer's evidence (0: none; "
                           "default: %(default)s)")
    plan.add_argument("--recall-tokens", type=int, default=MemoryConfig.recall_tokens,
                      help="tokens a question calls back from the second tier, which join its "
                           "view of the memory (0: none; default: %(default)s)")
    plan.add_argument("--host-budget-mb", type=float, default=MemoryConfig.host_budget_mb,
                      help="the second tier's host memory, counted where the device shares it "
                           "(the CPU, a Jetson; default: %(default)s)")
    plan.add_argument("--disk-budget-mb", type=float, default=MemoryConfig.disk_budget_mb,
                      help="the second tier's disk: its chunks' key summaries stay in memory, "
                           "counted as the host tier is (default: %(default)s)")
    add_device_options(plan)
    plan.add_argument("--available-gib", type=float,
                      help="plan for a device with this much free memory instead of this one")
    output = plan.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true",
                        help="print the plan as JSON (a list for several)")
    output.add_argument("--markdown", action="store_true",
                        help="print the plans as one Markdown table")
    plan.set_defaults(run=plan_command)

    plot = commands.add_parser("plot", help=plot_command.__doc__)
    plot.add_argument("results", nargs="+", help="results files of `deltas-ros run`")
    plot.add_argument("--out", default="plot.png", help="PNG to write")
    plot.set_defaults(run=plot_command)

    ask = commands.add_parser("ask", help=ask_command.__doc__)
    ask.add_argument("question")
    ask.add_argument("--node", default=DEFAULT_NODE, help="the memory node's name")
    ask.add_argument("--all", action="store_true",
                     help="ask every memory node on the graph (every namespace) at once")
    ask.add_argument("--json", action="store_true", help="with --all: one object per robot")
    # 3 s: Fast DDS repeats a participant's announcement every 3 s after its first burst.
    ask.add_argument("--discovery", type=float, default=3.0,
                     help="with --all: seconds to listen for memory nodes first "
                          "(default: %(default)s)")
    ask.add_argument("--max-new-tokens", type=int, default=0, help="0 = the node's default")
    ask.add_argument("--timeout", type=float, default=ASK_TIMEOUT_S,
                     help="seconds to wait (with --all: for every robot together)")
    ask.add_argument("--wait-idle", action="store_true",
                     help="first wait until no chunk is waiting for the model")
    ask.set_defaults(run=ask_command)

    dash = commands.add_parser("dashboard", help=dashboard_command.__doc__)
    dash.add_argument("--node", default=DEFAULT_NODE, help="the memory node's name")
    dash.add_argument("--host", default="127.0.0.1",
                      help="address to bind; anything but loopback requires a token")
    dash.add_argument("--port", type=int, default=8080, help="HTTP port (0: any free one)")
    token = dash.add_mutually_exclusive_group()
    token.add_argument("--token-file", default="",
                       help="a file holding the token, then required on every request (?token= "
                            "or an X-Token header); also $DELTAS_DASHBOARD_TOKEN")
    token.add_argument("--token", default="",
                       help="the token itself (visible to local users: prefer --token-file)")
    dash.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                      help="a Host name the page may be reached by, beside the bound address "
                           "and localhost (repeatable; e.g. the robot's DNS name)")
    dash.set_defaults(run=dashboard_command)

    train = commands.add_parser("train", help=train_command.__doc__)
    train.add_argument("--config", default="config/train_tiny.yaml", help="training config")
    train.add_argument("--out", default="out/train",
                       help="run directory: checkpoint.pt, train.log, model/ (best so far)")
    train.add_argument("--resume", action="store_true", help="continue OUT/checkpoint.pt")
    train.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    train.add_argument("--seed", type=int, help="override the config's seed")
    train.add_argument("--max-minutes", type=float, help="override the config's time limit")
    train.add_argument("--max-steps", type=int, help="override the config's step limit")
    train.add_argument("--threads", type=int, help="override the config's torch threads")
    train.add_argument("--export", metavar="NAME",
                       help="write OUT/checkpoint.pt's weights to OUT/NAME (a model directory) "
                            "and stop, training nothing")
    train.set_defaults(run=train_command)
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
