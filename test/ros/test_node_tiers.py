"""The second tier through the node over DDS: configured by its parameters, its files in the
memory directory, its use in diagnostics, and a question answered while it holds chunks."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ros_helpers import Tester, start, status_values, stop


def test_a_node_with_a_second_tier_reports_it_and_answers(tiny_model_dir, ros_domain):
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
        assert tester.ask("What did you see?", timeout=120).success
    finally:
        tester.close()
        code, err = stop(process)
    assert code == 0 and "Traceback" not in err, err[-5000:]
