"""What every benchmark shares: the machine label, the model under test, timing, result files.

Results are only comparable when they say where and how they were taken, so every result file
carries the machine (CPU model, cores, GPU, load average at start and end), the date and the exact
command that produced it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import transformers
from transformers import Qwen3_5ForConditionalGeneration

from deltas_ros.core.config import NODE_NAME, MemoryConfig
from deltas_ros.core.kernels import select_gated_delta_kernels
from deltas_ros.core.loader import LoadedModel, default_dtype, load_model, resolve_model_path
from deltas_ros.core.model_maker import (
    config_from_file,
    init_decay_like_trained,
    make_tokenizer,
    tiny_config,
)

if TYPE_CHECKING:
    from deltas_ros.core.memory import StreamingMemory

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results"
NINE_B_CONFIG = Path(__file__).parents[1] / "config" / "models" / "qwen3_5_9b.json"


# ------------------------------------------------------------------------------------ the machine
def machine() -> dict[str, Any]:
    """Where the numbers come from (the load average matters on a shared machine)."""
    cpu = next((line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def machine_label(info: dict[str, Any]) -> str:
    threads = info["torch_threads"]
    return (f"{info['cpu']}, {info['cores']} cores ({threads} torch thread"
            f"{'s' if threads != 1 else ''}), {info['gpu'] or 'no GPU'}; "
            f"load average {info['load_avg_1m_start']} at start, "
            f"{info.get('load_avg_1m_end', '?')} at end; {info['date']}")


def command(module: str, argv: list[str]) -> str:
    """The command line that reproduces a run, as typed from the repository root (with
    OMP_NUM_THREADS when set: it decides how many threads torch uses)."""
    python = Path(sys.executable)
    if python.is_relative_to(REPO):
        python = python.relative_to(REPO)
    threads = os.environ.get("OMP_NUM_THREADS")
    env = [f"OMP_NUM_THREADS={threads}"] if threads else []
    return " ".join([*env, str(python), "-m", module, *map(shlex.quote, argv)])


# ------------------------------------------------------------------------------------ the model
def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the tiny test model)")
    parser.add_argument("--config", help="config.json-style file: a random model of that size")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)


def add_stream_args(parser: argparse.ArgumentParser, chunks: int, chunks_help: str, budget: int,
                    window: int, pixel_budget: int, width: int, height: int,
                    pixel_help: str | None = None) -> None:
    """The options of a benchmark that streams synthetic chunks through one memory: the stream's
    length and frame size, the memory's budget, window and pixel budget (defaults per benchmark).
    """
    parser.add_argument("--chunks", type=int, default=chunks, help=chunks_help)
    parser.add_argument("--budget", type=int, default=budget, help="KV budget M (tokens)")
    parser.add_argument("--window", type=int, default=window, help="recent window (tokens)")
    parser.add_argument("--pixel-budget", type=int, default=pixel_budget, help=pixel_help)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--height", type=int, default=height)


def stream_parser(doc: str, **stream_defaults: Any) -> argparse.ArgumentParser:
    """The parser of a benchmark that streams synthetic chunks through one memory: described by
    its docstring's first paragraph, with the model's options and the stream's (add_stream_args
    with these defaults)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_model_args(parser)
    add_stream_args(parser, **stream_defaults)
    return parser


def stream_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The add_stream_args options as the results record them."""
    return {"chunks": args.chunks, "budget": args.budget, "window": args.window,
            "pixel_budget": args.pixel_budget, "frame_size": [args.width, args.height]}


def synthetic_chunks(args: argparse.Namespace,
                     ) -> Iterator[tuple[list[np.ndarray], list[float]]]:
    """--chunks seconds of synth_stream (2 fps, --width x --height, --seed) as chunks of two
    frames, one a second: (frames, times), drawn as the stream goes, so that a long stream is
    never held whole."""
    from deltas_ros.training.synth import synth_stream  # as in start_stream_run

    stream, _ = synth_stream(float(args.chunks), 2.0, args.width, args.height, args.seed)
    pending: list[tuple[float, np.ndarray]] = []
    for time_s, frame in stream:
        pending.append((time_s, frame))
        if len(pending) == 2:
            yield [f for _, f in pending], [t for t, _ in pending]
            pending = []


def bench_model(args: argparse.Namespace) -> LoadedModel:
    """The model under test: --model DIR through load_model, else a random-init model.

    The random model (--config FILE, or the tiny test config) is built in memory on the device
    with exactly the steps of `make_model` (seed, fp32 construction, cast, decay init), so a 9B
    model needs neither 19 GB of disk nor a reload; test/bench/test_scripts.py checks that the
    tiny one equals `load_model(make_model(...))` weight for weight.
    """
    if args.model:
        return load_model(args.model, args.device, args.dtype)
    device = torch.device(args.device)
    dtype = default_dtype(device) if args.dtype == "auto" else getattr(torch, args.dtype)
    config = config_from_file(args.config) if args.config else tiny_config()
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Qwen3_5ForConditionalGeneration(config).to(dtype)
    init_decay_like_trained(model, args.seed)
    model.eval().requires_grad_(False)
    fla = select_gated_delta_kernels(model, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    tokenizer = make_tokenizer(config.vision_start_token_id)
    return LoadedModel(model, tokenizer, Path(args.config or "tiny"), device, dtype, fla)


def describe_model(loaded: LoadedModel) -> dict[str, Any]:
    text = loaded.model.config.text_config
    return {
        "source": str(loaded.path),
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "layers": text.num_hidden_layers,
        "linear_layers": text.layer_types.count("linear_attention"),
        "hidden_size": text.hidden_size,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "gated_delta_kernels": "fla" if loaded.fla_kernels else "torch",
    }


# ------------------------------------------------------------------------------------ timing
def now(device: torch.device) -> float:
    """perf_counter after the device's queued work is done (the engine's own timing rule)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ------------------------------------------------------------------------------------ ROS
def isolate_ros() -> None:
    """A DDS domain of our own unless ROS_DOMAIN_ID is set (201-232: clear of the tests' ids),
    discovery on this host only. Child processes inherit it."""
    os.environ.setdefault("ROS_DOMAIN_ID", str(random.Random(os.getpid()).randint(201, 232)))
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")


def start_ros_run(name: str, parser: argparse.ArgumentParser, argv: list[str] | None,
                  ) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse the options, then start the results of a benchmark over ROS: in a DDS domain of
    its own (isolate_ros), with the middleware it runs on (ros_setup)."""
    args, argv = parse(parser, argv)
    isolate_ros()
    return args, start_results(name, argv) | {"ros": ros_setup()}


def ros_setup() -> dict[str, str]:
    """What decides how frames travel: the middleware and Fast DDS's transports."""
    from rclpy.utilities import get_rmw_implementation_identifier

    return {"rmw": get_rmw_implementation_identifier(),
            "fastdds_builtin_transports": os.environ.get("FASTDDS_BUILTIN_TRANSPORTS",
                                                         "default"),
            "domain_id": os.environ.get("ROS_DOMAIN_ID", "0")}


def memory_node_command(overrides: dict[str, Any]) -> list[str]:
    """The memory node as launch/deltas.launch.py runs it (its parameters file), plus
    `overrides` (parameter: value)."""
    command = [str(Path(sys.prefix) / "lib" / "deltas_ros" / "memory_node"), "--ros-args",
               "-r", f"__node:={NODE_NAME}",
               "--params-file", str(REPO / "config" / "deltas.yaml")]
    for key, value in overrides.items():
        command += ["-p", f"{key}:={value}"]
    return command


def add_camera_args(parser: argparse.ArgumentParser, seconds_help: str | None = None) -> None:
    """The options stream_camera reads: the stream's length, rate and frame size."""
    parser.add_argument("--seconds", type=float, default=30.0, help=seconds_help)
    parser.add_argument("--fps", type=float, default=30.0)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=720)


def stream_camera(args: argparse.Namespace, topic: str, encoding: str,
                  *more: str) -> dict[str, Any]:
    """bench.camera_pub in its own process (see its --help), publishing --seconds of --width x
    --height frames at --fps on `topic` (more: its further options); waited for, its one-line
    JSON summary."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.camera_pub", "--topic", topic, "--encoding", encoding,
         "--fps", str(args.fps), "--seconds", str(args.seconds), "--width", str(args.width),
         "--height", str(args.height), *more],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = process.communicate(timeout=args.seconds + 120)
    if process.returncode:
        raise RuntimeError(f"camera process failed ({process.returncode}): {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def stop_process(process: subprocess.Popen) -> str:
    """SIGINT (a node saves and shuts down cleanly), kill after 20 s; its stderr."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
    return err


# ------------------------------------------------------------------------------------ results
def add_out_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None,
          ) -> tuple[argparse.Namespace, list[str]]:
    """--out added last, then the options parsed from argv (default: the command line); argv
    too, for the command the results record."""
    add_out_arg(parser)
    argv = sys.argv[1:] if argv is None else argv
    return parser.parse_args(argv), argv


def start_results(name: str, argv: list[str]) -> dict[str, Any]:
    """The results of bench.<name> run with argv: filled in by the script, written by finish."""
    return {"benchmark": name, "command": command(f"bench.{name}", argv), "machine": machine(),
            "_started": time.perf_counter()}


def start_stream_run(name: str, parser: argparse.ArgumentParser, argv: list[str] | None,
                     ) -> tuple[argparse.Namespace, dict[str, Any], StreamingMemory]:
    """Parse the options (add_model_args, add_stream_args), start the results with the model
    (bench_model) and the stream's settings: (options, results so far, a memory of the model at
    the run's --budget, --window and --pixel-budget)."""
    # Imported here, not with this module: bench.cleanup_memory counts the modules a session
    # imports after its own imports (bench.common among them).
    from deltas_ros.core.memory import StreamingMemory

    args, argv = parse(parser, argv)
    results = start_results(name, argv)
    loaded = bench_model(args)
    results |= {"model": describe_model(loaded), **stream_settings(args)}
    return args, results, StreamingMemory(loaded, memory_config(args,
                                                                pixel_budget=args.pixel_budget))


def memory_config(args: argparse.Namespace, **fields: Any) -> MemoryConfig:
    """The run's memory: the budget and window its --budget and --window set (where it has
    them), then `fields` over them (a condition's budget and policy, a resolved pixel budget)."""
    given = {field: getattr(args, option) for option, field in
             (("budget", "budget_tokens"), ("window", "window_tokens")) if hasattr(args, option)}
    return MemoryConfig.from_mapping(given | fields)


def finish(out_dir: Path, results: dict[str, Any], title: str, body: str) -> dict[str, Any]:
    """Write <name>.json and <name>.md (machine, date, command, tables); print the markdown."""
    results["wall_s"] = round(time.perf_counter() - results.pop("_started"), 1)
    results["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    name = results["benchmark"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = (f"### {title}\n\nMachine: {machine_label(results['machine'])}\n\n"
                f"Command (ran {results['wall_s']:.0f} s): `{results['command']}`\n\n{body}")
    (out_dir / f"{name}.md").write_text(markdown)
    print(markdown)
    return results


STREAM_DONE = "stream_done"  # the key of the line that ends a stream's answers


def add_answers_args(parser: argparse.ArgumentParser) -> None:
    """The options every answer benchmark (answers, busy, busy_retention) shares."""
    parser.add_argument("--model", help="model directory (default: the shipped scene model)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--pixel-budget", type=int, help="default: the model's stored one")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--height", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--records", type=Path,
                        help="answers file (JSON lines) to append to (default: a new "
                             "OUT/NAME.jsonl)")
    parser.add_argument("--report", type=Path, nargs="+",
                        help="only report these answers files (merged)")


def add_resume_arg(parser: argparse.ArgumentParser) -> None:
    """--resume, for an answer benchmark that outlasts a session (`streams_done`)."""
    parser.add_argument("--resume", action="store_true",
                        help="go on after a stop: keep the streams the answers file holds whole")


def stream_done(seconds: int, seed: int) -> str:
    """The answers-file line that ends a stream's records: the unit a resumed run keeps."""
    return json.dumps({"seconds": seconds, "seed": seed, STREAM_DONE: True}) + "\n"


def streams_done(path: Path, resume: bool) -> set[tuple[int, int]]:
    """(seconds, seed) of the streams the answers file at `path` holds whole, for a run to
    skip. resume: first rewrite the file without the records of any other stream (one a stop
    cut off, its last line perhaps half written). Without resume a file holding a whole stream
    is refused: a second copy of its answers would count twice."""
    done = finished_streams(path, keep_only_them=resume)
    if done and not resume:
        raise SystemExit(f"{path} already holds streams of this run: pass --resume to go on "
                         "from them, or another --out")
    return done


def finished_streams(path: Path, keep_only_them: bool) -> set[tuple[int, int]]:
    """(seconds, seed) of the streams whose records `path` holds whole (a `stream_done` line
    after them); keep_only_them: rewrite the file without the records of any other stream."""
    if not path.is_file():
        return set()
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines) - 1:  # only a stop's last line may be cut off
                raise SystemExit(f"{path}: line {number + 1} is not JSON") from None
    done = {(r["seconds"], r["seed"]) for r in records if r.get(STREAM_DONE)}
    if keep_only_them:
        kept = [line for line, r in zip(lines, records) if (r["seconds"], r["seed"]) in done]
        partial = path.with_suffix(".tmp")
        partial.write_text("".join(f"{line}\n" for line in kept))
        partial.replace(path)
    return done


def run_answers(name: str, parser: argparse.ArgumentParser, argv: list[str] | None,
                evaluate: Callable[[argparse.Namespace, LoadedModel, Path], None],
                ) -> tuple[argparse.Namespace, dict[str, Any], list[dict], LoadedModel | None]:
    """Parse the options (add_answers_args last), answer the benchmark's questions into
    `--records` (unless `--report` names answers files to read instead), then read every answer
    back: (options, results so far, answers, the model)."""
    args, argv = parse(parser, argv)
    torch.set_num_threads(args.threads)
    results = start_results(name, argv)
    model_path = resolve_model_path(args.model)
    files = args.report or [args.records or args.out / f"{name}.jsonl"]
    loaded = None
    if not args.report:
        loaded = load_model(model_path, "cpu")
        files[0].parent.mkdir(parents=True, exist_ok=True)
        if not (args.records or hasattr(args, "resume")):  # --out: this run's answers alone
            files[0].unlink(missing_ok=True)
        evaluate(args, loaded, files[0])
    records = [record for f in files for line in f.read_text().splitlines()
               if not (record := json.loads(line)).get(STREAM_DONE)]
    results |= {"model": str(model_path), "answers_files": [str(f) for f in files]}
    return args, results, records, loaded


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def percent(fraction: float) -> str:
    return f"{100 * fraction:.2f} %"
