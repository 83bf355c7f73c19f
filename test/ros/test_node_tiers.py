"""The second tier through the node over DDS: configured by its parameters, its files in the
memory directory, its use in diagnostics, and questions answered while it holds chunks, which
say what they recalled (the AskMemory service and the ask action)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from deltas_ros.action import AskMemory as AskAction
from ros_helpers import Tester, send_goal, start, status_values, stop, wait_future


def test_a_second_tier_is_reported_and_answers_say_what_they_recalled(tiny_model_dir, ros_domain):
    process: subprocess.Popen = start(tiny_model_dir, ros_domain, reliable_qos="true",
                                      host_budget_mb="0.002", disk_budget_mb="1.0",
                                      recall_tokens="64")
    tester = Tester()
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
        handle = send_goal(tester.action, AskAction.Goal(question="What did you see?"), 120)
        assert handle.accepted
        result = wait_future(handle.get_result_async(), 120).result
        assert result.success, result.message
        assert 0 < result.recalled_chunks >= result.recalled_from_disk
    finally:
        tester.close()
        code, err = stop(process)
    assert code == 0 and "Traceback" not in err, err[-5000:]
