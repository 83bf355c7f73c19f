"""What a lifecycle cleanup gives back, and what the first configure keeps for good.

In this process (default): the node's configure, activate and cleanup without ROS, as
`Session` runs them for the lifecycle: `Session.configure` + `open_memory` + `attach`
(configure), frames at 2 fps and a question on the worker (active), `Session.close` (cleanup).
After each step the RSS, split into anonymous memory and file pages (the code of torch's
libraries, resident once it has run); after each cleanup whether the memory, the model and its
tokenizer are still alive (weak references) and the modules imported since the start.
`--node`: the installed memory_node driven through its lifecycle services (autostart off):
configure, activate + frames + a question, deactivate + cleanup; its RSS read from /proc.
What the first cycle keeps and later cycles do not add is a one-time cost of the process;
growth from cycle to cycle, or a live model, would be a leak.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.cleanup_memory --model DIR [--cycles 3] [--node]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    finish,
    isolate_ros,
    md_table,
    memory_node_command,
    parse,
    start_results,
)
from deltas_ros.core.config import DEFAULT_NODE
from deltas_ros.runtime import params
from deltas_ros.runtime.resources import memory_in_use
from deltas_ros.runtime.session import Session

MIB = 2**20


def rss_mib() -> float:
    return round(memory_in_use()["rss"] / MIB, 1)


def rss_parts_mib(pid: str = "self") -> dict[str, float]:
    """RSS split as Linux counts it: RssAnon (heap, tensors) and RssFile (pages of mapped files:
    the code of torch's libraries as it first runs, shared and reclaimable)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: round(int(line.split()[1]) / 1024, 1) for line in lines
            for key in ("VmRSS", "RssAnon", "RssFile") if line.startswith(key + ":")}


def frame(stamp: float) -> np.ndarray:
    return np.random.default_rng(int(stamp)).integers(0, 256, (120, 160, 3), np.uint8)


def cycle(values: dict[str, Any], seconds: int) -> tuple[dict[str, float], dict[str, bool], int]:
    """configure, stream and ask, cleanup: (RSS after each step, which objects outlived the
    cleanup, the model's parameter bytes)."""
    rss = {"before": rss_mib()}
    parts_before = rss_parts_mib()
    del parts_before["VmRSS"]
    session = Session.configure(values)
    memory, _ = session.open_memory()
    session.attach(memory, lambda chunk, result, held: None)
    session.node_active = lambda: True
    rss["configured"] = rss_mib()
    processed = session.worker.counters.chunks_processed
    for k in range(seconds * 2):
        session.take_frame(1_700_000_000.0 + k / 2, lambda s=k: frame(s))
    deadline = time.monotonic() + 600
    while session.worker.counters.chunks_processed < processed + seconds - 1:
        assert time.monotonic() < deadline, "chunks not processed"
        time.sleep(0.05)
    session.ask("what did you see?", 4)
    rss["streamed"] = rss_mib()
    model_bytes = sum(p.numel() * p.element_size() for p in memory.model.parameters())
    refs = {"memory": weakref.ref(memory), "model": weakref.ref(memory.model),
            "tokenizer": weakref.ref(memory.tokenizer)}
    del memory
    ended, _ = session.close(10.0)
    assert ended
    rss["cleaned"] = rss_mib()
    parts = {f"{key} kept": round(value - parts_before[key], 1)
             for key, value in rss_parts_mib().items() if key in parts_before}
    return rss | parts, {name: ref() is not None for name, ref in refs.items()}, model_bytes


def node_cycles(args: argparse.Namespace, memory_dir: str) -> list[dict[str, dict]]:
    """The installed node through `args.cycles` lifecycle cycles: its RSS parts per step."""
    import rclpy
    from deltas_ros.srv import AskMemory
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState
    from sensor_msgs.msg import Image

    from deltas_ros.ros.messages import to_time_msg

    isolate_ros()
    overrides = {"model_path": args.model, "autostart": "false", "device": "cpu",
                 "pixel_budget": args.pixel_budget, "budget_tokens": 256, "window_tokens": 64,
                 "memory_dir": memory_dir, "reliable_qos": "true"}
    process = subprocess.Popen(memory_node_command(overrides), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    rclpy.init()
    client = rclpy.create_node("cleanup_memory_bench")
    change = client.create_client(ChangeState, f"{DEFAULT_NODE}/change_state")
    ask = client.create_client(AskMemory, f"{DEFAULT_NODE}/ask_memory")
    camera = client.create_publisher(Image, "/camera/image_raw", 10)

    def call(service, request):
        assert service.wait_for_service(timeout_sec=120), service.srv_name
        future = service.call_async(request)
        rclpy.spin_until_future_complete(client, future, timeout_sec=900)
        return future.result()

    def transition(label: str) -> None:
        assert call(change, ChangeState.Request(transition=Transition(label=label))).success

    def stream(seconds: int) -> None:
        deadline = time.monotonic() + 120
        while not camera.get_subscription_count():
            assert time.monotonic() < deadline, "the node did not subscribe"
            rclpy.spin_once(client, timeout_sec=0.1)
        for k in range(seconds * 10):
            pixels = frame(k / 10)
            message = Image(height=120, width=160, encoding="rgb8", step=480,
                            data=pixels.tobytes())
            message.header.stamp = to_time_msg(1_700_000_000.0 + k / 10)
            camera.publish(message)
            time.sleep(0.1)

    cycles = []
    try:
        assert change.wait_for_service(timeout_sec=120)  # up: imports done, nothing configured
        time.sleep(2.0)
        for _ in range(args.cycles):
            steps = {"before": rss_parts_mib(str(process.pid))}
            transition("configure")
            steps["configured"] = rss_parts_mib(str(process.pid))
            transition("activate")
            stream(args.seconds)
            time.sleep(2.0)  # the last chunks
            assert call(ask, AskMemory.Request(question="what did you see?",
                                               max_new_tokens=4)).success
            steps["streamed"] = rss_parts_mib(str(process.pid))
            transition("deactivate")
            transition("cleanup")
            steps["cleaned"] = rss_parts_mib(str(process.pid))
            cycles.append(steps)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)
        client.destroy_node()
        rclpy.try_shutdown()
    return cycles


def node_main(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as memory_dir:
        cycles = node_cycles(args, memory_dir)
    start = cycles[0]["before"]
    rows = []
    for index, steps in enumerate(cycles):
        before = steps["before"]
        kept = {key: round(steps["cleaned"][key] - before[key], 1) for key in before}
        rows.append([index + 1, before["VmRSS"],
                     round(steps["configured"]["VmRSS"] - before["VmRSS"], 1),
                     round(steps["streamed"]["VmRSS"] - before["VmRSS"], 1),
                     kept["VmRSS"], kept["RssAnon"], kept["RssFile"],
                     round(steps["cleaned"]["VmRSS"] - start["VmRSS"], 1)])
    results.update(model=args.model, node=True, rss_unconfigured_mib=start, cycles=cycles)
    body = (f"The installed memory_node, model {args.model}; RSS in MiB, unconfigured after "
            f"its imports: {start['VmRSS']} (anonymous {start['RssAnon']}, file pages "
            f"{start['RssFile']}); each cycle's figures from its own start.\n\n" + md_table(
                ["cycle", "RSS before", "+ configure", "+ activate, stream, ask",
                 "kept after cleanup", "of it anonymous", "of it file pages",
                 "kept since the first configure"], rows) + "\n")
    return finish(args.out, results, "What cleanup gives back: the node", body)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory (make-model)")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=4, help="stream seconds per cycle")
    parser.add_argument("--pixel-budget", type=int, default=4096)
    parser.add_argument("--node", action="store_true",
                        help="the installed memory_node over its lifecycle services")
    args, argv = parse(parser, argv)
    results = start_results("cleanup_memory", argv)
    if args.node:
        results["benchmark"] = "cleanup_memory_node"  # its own result files
        return node_main(args, results)
    modules_at_start = len(sys.modules)
    rss_at_start = rss_mib()
    rows, cycles = [], []
    with tempfile.TemporaryDirectory() as memory_dir:
        values = params.defaults() | {
            "model_path": args.model, "memory_dir": memory_dir, "device": "cpu",
            "pixel_budget": args.pixel_budget, "budget_tokens": 256, "window_tokens": 64}
        for index in range(args.cycles):
            rss, alive, model_bytes = cycle(values, args.seconds)
            cycles.append({"rss_mib": rss, "alive_after_cleanup": alive,
                           "modules_imported": len(sys.modules) - modules_at_start})
            added = {step: round(rss[step] - rss["before"], 1)
                     for step in ("configured", "streamed", "cleaned")}
            rows.append([index + 1, rss["before"], added["configured"], added["streamed"],
                         added["cleaned"], rss["RssAnon kept"], rss["RssFile kept"],
                         round(rss["cleaned"] - rss_at_start, 1),
                         ", ".join(name for name, live in alive.items() if live) or "none",
                         len(sys.modules) - modules_at_start])
    results.update(model=args.model, model_mib=round(model_bytes / MIB, 1),
                   rss_at_start_mib=rss_at_start, cycles=cycles)
    body = (f"Model {args.model}: parameters {model_bytes / MIB:.1f} MiB. RSS in MiB; "
            "each cycle's figures from its own start.\n\n" + md_table(
                ["cycle", "RSS before", "+ configure", "+ stream, ask", "kept after cleanup",
                 "of it anonymous", "of it file pages", "kept since start",
                 "alive after cleanup", "modules imported since start"],
                rows) + "\n")
    return finish(args.out, results, "What cleanup gives back", body)


if __name__ == "__main__":
    main()
