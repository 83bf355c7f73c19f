"""The second tier through the node over DDS: configured by its parameters, its files in the
memory directory, its use in diagnostics and on ~/memory_chunks, and questions answered while
it holds chunks, which say what they recalled (the AskMemory service, the ask action's feedback
and result)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from deltas_ros.action import AskMemory as AskAction
from deltas_ros.msg import MemoryChunks
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from ros_helpers import Tester, send_goal, start, status_values, stop, wait_future

LATCHED = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.TRANSIENT_LOCAL)


def test_a_second_tier_is_reported_and_answers_say_what_they_recalled(tiny_model_dir, ros_domain):
    process: subprocess.Popen = start(tiny_model_dir, ros_domain, reliable_qos="true",
                                      host_budget_mb="0.002", disk_budget_mb="1.0",
                                      recall_tokens="64")
    tester = Tester()
    listed: list[MemoryChunks] = tester.collecting(MemoryChunks, "/deltas_memory/memory_chunks",
                                                   LATCHED)
    try:
        tester.wait_ready(process)
        tester.stream(8.0, speed=2.0)
        status = tester.wait_for_status(
            lambda s: int(status_values(s).get("tier_disk_chunks", 0)) >= 1, timeout=240)
        values = status_values(status)
        assert int(values["tier_disk_bytes"]) > 0 and values["tier_dropped_chunks"] == "0"
        assert {"tier_host_chunks", "tier_host_bytes", "tier_dropped_pieces"} <= set(values)
        tiers = Path(ros_domain["ROS_HOME"]) / "deltas_ros" / "tiers"
        assert list(tiers.glob("chunk-*.safetensors"))
        response = tester.ask("What did you see?", timeout=120)
        assert response.success, response.message
        assert 0 < response.recalled_chunks >= response.recalled_from_disk
        assert len(response.recalled_times) == response.recalled_chunks
        assert list(response.recalled_times) == sorted(response.recalled_times)
        feedback: list = []
        handle = send_goal(tester.action, AskAction.Goal(question="What did you see?"), 120,
                           feedback)
        assert handle.accepted
        result = wait_future(handle.get_result_async(), 120).result
        assert result.success, result.message
        assert 0 < result.recalled_chunks >= result.recalled_from_disk
        assert len(result.recalled_times) == result.recalled_chunks
        # Every feedback message says what the question recalled, from the first token on.
        assert feedback and all(
            (f.recalled_chunks, f.recalled_from_disk)
            == (result.recalled_chunks, result.recalled_from_disk) for f in feedback)
        # The recalled chunks are chunks of the stream, by their times on ~/drift.
        with tester.lock:
            streamed = {d.stream_time for d in tester.drift}
        assert set(result.recalled_times) <= streamed
        # ~/memory_chunks lists the second tier beside the held chunks, oldest first (what the
        # tier's writer had taken when the newest chunk was listed).
        with tester.lock:
            latest = listed[-1]
        tiers = list(latest.tiered_tier)
        assert tiers and set(tiers) <= {MemoryChunks.TIER_HOST, MemoryChunks.TIER_DISK}
        assert len(latest.tiered_time) == len(latest.tiered_tokens) == len(tiers)
        assert list(latest.tiered_time) == sorted(latest.tiered_time)
        assert set(latest.tiered_time) <= streamed and all(t > 0 for t in latest.tiered_tokens)
    finally:
        tester.close()
        code, err = stop(process)
    assert code == 0 and "Traceback" not in err, err[-5000:]
