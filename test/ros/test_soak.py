"""Soak: a long simulated stream through the real node on a sped-up clock, with questions and a
save + load in the middle. Nothing is lost that is not counted, and the memory stays flat.

CI streams 120 simulated seconds at 4x. For a longer soak, e.g. an hour:
    DELTAS_SOAK_S=3600 DELTAS_SOAK_SPEED=8 scripts/test.sh test/ros/test_soak.py
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from deltas_ros.srv import MemoryFile
from diagnostic_msgs.msg import DiagnosticStatus
from ros_helpers import Tester, start, status_values, stop

SOAK_S = float(os.environ.get("DELTAS_SOAK_S", "120"))  # simulated stream seconds
SPEED = float(os.environ.get("DELTAS_SOAK_SPEED", "4"))  # stream seconds per wall second
CAMERA_FPS = 4.0  # enough for the 2 fps sampler, light enough to publish at any speed
BUDGET = 120


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


ACCOUNTED = ("chunks_processed", "chunks_dropped", "chunks_discarded")


def chunks_accounted(tester: Tester) -> int:
    """Chunks processed, dropped (the model slower than the stream) or discarded (waiting when
    the load ended their stream) in the newest diagnostics report (the caller holds
    tester.lock). Counting only the first two failed whenever a chunk was waiting at the load."""
    values = tester.newest_values()
    return sum(int(values.get(key, 0)) for key in ACCOUNTED)


def test_a_long_sped_up_stream_loses_nothing_uncounted_and_stays_flat(tiny_model_dir, ros_env,
                                                                      tmp_path):
    process = start(tiny_model_dir, ros_env, reliable_qos="true", use_sim_time="true",
                    budget_tokens=str(BUDGET), silence_warn_s="30.0",
                    memory_dir=str(tmp_path))
    tester = Tester()
    try:
        tester.wait_ready(process)
        camera = threading.Thread(target=tester.stream, daemon=True,
                                  kwargs=dict(seconds=SOAK_S, speed=SPEED, fps=CAMERA_FPS))
        camera.start()
        wall_s = SOAK_S / SPEED

        def at(fraction: float) -> None:
            """Sleep until `fraction` of the stream has been published."""
            time.sleep(max(0.0, started + fraction * wall_s - time.monotonic()))

        started = time.monotonic()
        answers, files = [], []
        at(0.25)
        answers.append(tester.ask("what happened so far?", timeout=120))
        at(1 / 3)
        rss_early = rss_bytes(process.pid)
        _, early = tester.last_status()
        at(0.5)
        for service in ("save_memory", "load_memory"):
            client = tester.node.create_client(MemoryFile, f"/deltas_memory/{service}")
            files.append(tester.call(client, MemoryFile.Request(), timeout=120))
        at(0.75)
        answers.append(tester.ask("what is in front of you now?", timeout=120))
        camera.join(wall_s + 120)
        assert not camera.is_alive()

        # Every sampled chunk is processed, or dropped and counted; never silently lost.
        expected = int(SOAK_S)  # 2 fps, 2 frames per chunk: one chunk per stream second
        tester.wait_for(lambda: chunks_accounted(tester) >= expected - 1, timeout=180)
        answers.append(tester.ask("what did you see at the end?", timeout=120))
        final = {}

        def settled() -> bool:
            """A diagnostics report that counts exactly the chunks published on ~/drift, taken
            together with them; never true if a processed chunk's DriftScore was lost."""
            status = tester.diagnostics[-1].status[0]
            if len(tester.drift) != int(status_values(status)["chunks_processed"]):
                return False
            final.update(level=status.level, values=status_values(status),
                         drift=list(tester.drift))
            return True

        tester.wait_for(settled, timeout=30)
        level, values, drift = final["level"], final["values"], final["drift"]
        rss_end = rss_bytes(process.pid)
    finally:
        tester.close()
        code, err = stop(process)
    assert code == 0 and "Traceback" not in err, err[-3000:]

    processed, dropped, discarded = (int(values[key]) for key in ACCOUNTED)
    print(f"soak: {SOAK_S:.0f} s at {SPEED:g}x: {processed} chunks processed, {dropped} dropped, "
          f"{discarded} discarded at the load; "
          f"RSS {rss_early / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB, "
          f"position {values['position']}")
    indices = [m.chunk_index for m in drift]
    assert values["chunks_failed"] == "0" and level != DiagnosticStatus.ERROR
    # The last chunk may be incomplete.
    assert processed + dropped + discarded in (expected - 1, expected)
    assert indices == sorted(set(indices)) and indices[-1] < expected
    assert all(f.success for f in files), [f.message for f in files]
    assert all(a.success for a in answers), [a.error for a in answers]

    # Flat: the cache is full at exactly the budget from early on, bytes and RSS do not grow.
    full = [m.kv_tokens for m in drift if m.chunk_index >= expected // 3]
    assert max(m.kv_tokens for m in drift) <= BUDGET and set(full) == {BUDGET}
    assert values["memory_bytes"] == early["memory_bytes"]
    assert rss_end < 1.10 * rss_early, (rss_early, rss_end)
    next_position, max_positions = map(int, values["position"].split("/"))
    assert next_position < max_positions
