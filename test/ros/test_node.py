"""The memory node in its own process, driven over real DDS from this one (tiny model, CPU).

The node is started exactly as launch/deltas.launch.py starts it: the installed `memory_node`
executable with config/deltas.yaml and the launch file's overrides.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cv2
import pytest
from deltas_ros.srv import MemoryFile
from diagnostic_msgs.msg import DiagnosticStatus
from engine_helpers import corrupted_jpeg
from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
from rcl_interfaces.srv import SetParameters
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import serialize_message
from ros_helpers import (
    BASE_STAMP,
    Tester,
    indices,
    raw_frame,
    scene,
    set_parameter,
    stamp_msg,
    start,
    status_values,
    stop,
)
from sensor_msgs.msg import CompressedImage, Image
from visualization_msgs.msg import Marker, MarkerArray

from deltas_ros.ros.node import QUESTION_SLOTS
from deltas_ros.runtime.files import read_metadata


@pytest.fixture(scope="module")
def raw_node(tiny_model_dir, ros_domain):
    process = start(tiny_model_dir, ros_domain, reliable_qos="true")
    tester = Tester()
    try:
        tester.wait_ready(process)
        # Warm-up: the first chunk and the first question of a fresh process pay one-time costs
        # (lazy imports and kernel set-up) that took up to ~30 s on a loaded 2-core machine.
        tester.stream(2.0)
        tester.wait_for(lambda: len(tester.drift) >= 2, timeout=120)
        assert tester.ask("warm-up", timeout=120).success
        yield tester, process
    finally:
        tester.close()
        code, err = stop(process)
        print(f"memory_node exited {code}; stderr:\n{err[-5000:]}")
    # SIGINT after every test of the module used the node: a clean exit (checked here, not in a
    # test that would have to run last).
    assert code == 0 and "Traceback" not in err, err[-5000:]


def test_streams_one_drift_per_second_and_answers_while_streaming(raw_node):
    tester, _ = raw_node
    tester.reset()
    answers, errors = [], []

    def ask() -> None:
        try:
            answers.append(tester.ask("What changed?", timeout=120))
        except Exception as error:  # a thread's exception would be lost: report it below
            errors.append(error)

    def ask_midway(i: int) -> None:
        if i == 90:  # 3 s into the stream, from another thread like a planner would
            threading.Thread(target=ask, daemon=True).start()

    tester.stream(6.0, on_frame=ask_midway)
    tester.wait_for(lambda: len(tester.drift) >= 6 and (answers or errors), timeout=120)
    assert not errors, f"the question mid-stream failed: {errors[0]!r}"
    time.sleep(1.0)
    drift = list(tester.drift)
    assert 5 <= len(drift) <= 7
    assert indices(drift) == list(range(len(drift)))  # consecutive: no chunk lost
    times = [m.stream_time for m in drift]
    assert times == sorted(times) and times[0] < 0.5
    assert all(m.kv_tokens <= 120 and len(m.layer_drift) == 6 for m in drift)
    assert drift[0].header.stamp.sec == int(BASE_STAMP) and drift[0].header.frame_id == "camera"
    answer = answers[0]
    assert answer.success, answer.error
    assert answer.evidence_times and answer.memory_tokens > 0
    assert all(answer.memory_span_start <= t <= answer.memory_span_end
               for t in answer.evidence_times)
    assert len(answer.evidence_stamps) == len(answer.evidence_times)
    assert answer.recalled_chunks == answer.recalled_from_disk == 0  # no second tier


def test_without_poses_the_markers_are_a_deleteall_alone(raw_node):
    """No pose_topic: ~/memory_markers still comes (transient local) and after every answer,
    holding nothing but its DELETEALL; the question is answered as ever."""
    tester, _ = raw_node
    got: list[MarkerArray] = []
    latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
    subscription = tester.node.create_subscription(MarkerArray, "/deltas_memory/memory_markers",
                                                   got.append, latched)
    try:
        tester.wait_for(lambda: got, timeout=60)  # the latest, kept for a late subscriber
        assert tester.ask("Where is the cup?", timeout=120).success
        tester.wait_for(lambda: len(got) >= 2, timeout=60)
        assert all([m.action for m in msg.markers] == [Marker.DELETEALL] for msg in got)
    finally:
        tester.node.destroy_subscription(subscription)


def test_same_input_at_1x_and_2x_gives_the_same_chunks(raw_node):
    tester, _ = raw_node
    runs = []
    for speed in (1.0, 2.0):
        tester.reset()
        tester.stream(4.0, speed=speed)
        tester.wait_for(lambda: len(tester.drift) >= 4)
        time.sleep(0.5)
        with tester.lock:
            runs.append([(m.chunk_index, m.stream_time, m.drift) for m in tester.drift])
    assert len(runs[0]) == len(runs[1]) == 4
    for (i1, t1, d1), (i2, t2, d2) in zip(*runs):
        assert i1 == i2 and t1 == t2
        assert d1 == pytest.approx(d2, rel=1e-6)


def test_ten_planners_at_once_get_answers_and_leave_the_memory_untouched(raw_node):
    tester, _ = raw_node
    runs, answers = [], []

    def planner(n: int) -> None:
        answers.append(tester.ask(f"planner {n}: what is in front of you?", timeout=120))

    for with_questions in (True, False):
        tester.reset()
        camera = threading.Thread(target=tester.stream, args=(4.0,), daemon=True)
        camera.start()
        if with_questions:
            time.sleep(1.5)  # mid-stream
            planners = [threading.Thread(target=planner, args=(n,)) for n in range(10)]
            start = time.monotonic()
            for thread in planners:
                thread.start()
            for thread in planners:
                thread.join(120)
            elapsed_s = time.monotonic() - start
        camera.join(30)
        tester.wait_for(lambda: len(tester.drift) >= 4)
        time.sleep(0.5)
        with tester.lock:
            runs.append([(m.chunk_index, m.drift, m.kv_tokens) for m in tester.drift])
    assert len(answers) == 10 and all(a.success for a in answers), [a.error for a in answers]
    # At most QUESTION_SLOTS question callbacks run at once; the others wait in the service
    # queue, not in blocked executor threads (when all of those blocked, the worker starved and
    # this sum measured 7.8x the time taken). So the latencies add up to no more than
    # QUESTION_SLOTS times the time it took (plus slack for transport).
    served_s = sum(a.latency_ms for a in answers) / 1e3
    assert served_s <= (QUESTION_SLOTS + 0.5) * elapsed_s, (served_s, elapsed_s)
    assert runs[0] == runs[1]  # the same drift, chunk by chunk: questions left no trace


def test_bad_frames_are_counted_and_the_node_keeps_running(raw_node):
    tester, process = raw_node
    tester.reset()

    def bad(i: int, stamp: float) -> Image:
        msg = raw_frame(i, stamp)
        kind = (i // 15) % 4
        if kind == 0:
            msg.encoding = "yuv422_weird"
        elif kind == 1:
            msg.height = msg.width = 0
            msg.step, msg.data = 0, b""
        elif kind == 2:
            msg.data = msg.data[: len(msg.data) // 2]  # shorter than step * height
        else:
            msg.encoding = "16UC1"  # depth
        return msg

    tester.stream(2.0, make=bad)
    tester.stream(2.0, start=BASE_STAMP + 2.0)
    tester.wait_for(lambda: len(tester.drift) >= 2)
    status = tester.wait_for_status(lambda s: int(status_values(s)["frames_bad"]) >= 4)
    assert process.poll() is None
    assert int(status_values(status)["chunks_processed"]) >= 2

    def ok_after_bad_frames() -> bool:
        levels = [(m.status[0].level, m.status[0].message) for m in tester.diagnostics]
        warns = [i for i, (_, msg) in enumerate(levels) if msg.startswith("bad frames")]
        return bool(warns) and (DiagnosticStatus.OK, "ok") in levels[warns[0]:]

    # WARN while bad frames come, OK again once only good ones do.
    tester.wait_for(ok_after_bad_frames, timeout=15)


def test_a_malformed_message_is_counted_and_reported_as_what_it_is(raw_node):
    """CDR bytes cut short after the header: the stamp reads, the message does not."""
    tester, process = raw_node
    tester.reset()
    _, before = tester.last_status()

    def truncated(i: int, stamp: float) -> Image | bytes:
        msg = raw_frame(i, stamp)
        return serialize_message(msg)[:200] if i == 15 else msg  # 0.5 s: a sampling slot

    tester.stream(2.0, make=truncated)
    tester.wait_for(lambda: len(tester.drift) >= 2)
    status = tester.wait_for_status(
        lambda s: int(status_values(s)["frames_bad"]) > int(before["frames_bad"]))
    values = status_values(status)
    assert values["callback_errors"] == before["callback_errors"]
    with tester.lock:
        messages = [m.status[0].message for m in tester.diagnostics]
    assert any("malformed Image message (200 bytes)" in m for m in messages), messages[-5:]
    assert process.poll() is None


def test_diagnostics_report_health_and_silence(raw_node):
    tester, _ = raw_node
    tester.reset()
    tester.stream(2.0)
    tester.wait_for(lambda: len(tester.drift) >= 2)
    _, values = tester.last_status()
    for key in ("input_rate_hz", "frames_received", "frames_sampled", "chunks_processed",
                "chunks_dropped", "queue_depth", "questions_waiting", "kv_tokens",
                "budget_tokens", "memory_bytes", "chunk_latency_ms", "real_time_factor",
                "last_drift", "device", "model"):
        assert key in values
    assert values["budget_tokens"] == "120" and values["device"] == "cpu"
    assert values["lifecycle"] == "active" and values["camera_publishers"] == "1"
    # The camera went silent: WARN once silence_warn_s (2 s) has passed.
    tester.wait_for_status(lambda s: s.level == DiagnosticStatus.WARN
                           and s.message.startswith("no camera frames"))


def test_stamps_jumping_back_reset_the_memory_after_saving_it(raw_node, ros_domain):
    tester, _ = raw_node
    tester.reset()
    _, before = tester.last_status()
    tester.stream(3.0, start=BASE_STAMP + 100)
    tester.wait_for(lambda: len(tester.drift) >= 3)
    tester.stream(2.0, start=BASE_STAMP)  # the bag looped
    tester.wait_for(lambda: len(tester.drift) >= 5)
    status = tester.wait_for_status(
        lambda s: int(status_values(s)["time_jumps_back"]) > int(before["time_jumps_back"]))
    assert indices(tester.drift) == [0, 1, 2, 0, 1]
    assert tester.drift[3].stream_time < 0.5
    # What the reset forgot is in memory_dir, loadable.
    assert int(status_values(status)["reset_saves"]) == int(before["reset_saves"]) + 1
    memory_dir = Path(ros_domain["ROS_HOME"]) / "deltas_ros"
    saved = max(memory_dir.glob("before-reset-*.safetensors"), key=lambda p: p.stat().st_mtime)
    assert read_metadata(saved)["stream"]["chunks_seen"] == 3


def test_ask_command_line_prints_the_answer(raw_node, ros_domain):
    tester, _ = raw_node
    tester.reset()
    tester.stream(2.0)
    # --wait-idle waits for chunks queued in the node, not for frames still on their way to it
    # (late on a busy machine): the answer must see both chunks.
    tester.wait_for(lambda: len(tester.drift) >= 2, timeout=120)
    result = subprocess.run(
        [sys.executable, "-m", "deltas_ros.tools.cli", "ask", "What did you see?",
         "--wait-idle", "--max-new-tokens", "3", "--timeout", "60"],
        env=ros_domain, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert "answer:" in result.stdout and "evidence (stream time):" in result.stdout
    assert "covering 0.2-1.2 s" in result.stdout  # both chunks were in memory


def test_parameters_are_validated_at_runtime(raw_node):
    tester, _ = raw_node

    refused = set_parameter(tester, "max_new_tokens", 0)
    assert not refused.successful and "max_new_tokens" in refused.reason
    assert not set_parameter(tester, "budget_tokens", 500).successful  # read-only
    assert set_parameter(tester, "max_new_tokens", 3).successful


def test_questions_are_validated(raw_node):
    tester, _ = raw_node
    empty = tester.ask("   ")
    assert not empty.success and "empty" in empty.error
    long = tester.ask("x" * 5000)
    assert not long.success and "limit" in long.error
    broken = tester.ask("where is the c\ufffdp?")  # how bytes that are not UTF-8 arrive
    assert not broken.success and "UTF-8" in broken.error


def fresh_status(tester: Tester) -> dict[str, str]:
    """The values of a diagnostics report published after this call."""
    with tester.lock:
        seen = len(tester.diagnostics)
    tester.wait_for(lambda: len(tester.diagnostics) >= seen + 2)
    return tester.last_status()[1]


def file_client(tester: Tester, service: str):
    return tester.node.create_client(MemoryFile, f"/deltas_memory/{service}")


def test_attacks_over_dds_are_refused_and_leave_the_memory_bit_identical(raw_node, ros_domain,
                                                                        tmp_path):
    """Saves outside memory_dir or over a file that is not a memory
    file, answers longer than the parameter's range, empty questions and a 1 MB frame_id are
    refused or bounded; the drift of the stream they hit equals a run without them."""
    tester, _ = raw_node
    memory_dir = Path(ros_domain["ROS_HOME"]) / "deltas_ros"
    notes = memory_dir / "notes.txt"
    notes.write_text("not a memory")
    (memory_dir / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    save, load = file_client(tester, "save_memory"), file_client(tester, "load_memory")
    replies = []

    def attack() -> None:
        for path in (str(tmp_path / "evil.safetensors"), "../evil.safetensors", "notes.txt",
                     "link.safetensors", "new_folder/evil.safetensors"):
            replies.append(tester.call(save, MemoryFile.Request(path=path)))
        for client in (save, load):  # a name too long to look up once ended the node
            replies.append(tester.call(client, MemoryFile.Request(path="a" * 256)))
        replies.append(tester.ask("what do you see?", max_new_tokens=2**32 - 1))
        replies.append(tester.ask("what do you see?", max_new_tokens=65535))
        replies.append(tester.ask(" "))

    def huge_frame_id(i: int, stamp: float) -> Image:
        msg = raw_frame(i, stamp)
        msg.header.frame_id = "f" * 1_000_000 if i >= 60 else "camera"
        return msg

    runs = []
    for attacked in (False, True):
        tester.reset()
        thread = threading.Thread(target=attack, daemon=True)

        def on_frame(i: int, attacked=attacked, thread=thread) -> None:
            if attacked and i == 30:  # 1 s into the stream, from another thread
                thread.start()

        tester.stream(3.0, make=huge_frame_id, on_frame=on_frame)
        if attacked:
            thread.join(120)
        tester.wait_for(lambda: len(tester.drift) >= 3, timeout=120)
        time.sleep(0.5)
        with tester.lock:
            runs.append([(m.chunk_index, m.drift, m.kv_tokens) for m in tester.drift])
            frame_ids = [m.header.frame_id for m in tester.drift]
    assert runs[0] == runs[1]  # bit-identical: nothing the attacks did reached the memory
    assert len(replies) == 10 and not any(r.success for r in replies)
    assert all("outside memory_dir" in r.message or "'..'" in r.message
               for r in replies[:2]), [r.message for r in replies]
    assert "not a deltas_ros memory file" in replies[2].message
    assert "outside memory_dir" in replies[3].message and "does not exist" in replies[4].message
    assert all("File name too long" in r.message for r in replies[5:7])
    assert "limit 4096" in replies[7].error and "limit 4096" in replies[8].error
    assert notes.read_text() == "not a memory"
    assert not (tmp_path / "evil.safetensors").exists()
    assert not (tmp_path / "outside.safetensors").exists()
    assert not (memory_dir / "new_folder").exists()
    assert max(len(f) for f in frame_ids) <= 256
    # Client mistakes are counted apart and are no failure: diagnostics do not turn ERROR.
    status = tester.wait_for_status(lambda s: int(status_values(s)["questions_refused"]) >= 3)
    values = status_values(status)
    assert status.level != DiagnosticStatus.ERROR and values["questions_failed"] == "0"
    assert int(values["requests_refused"]) >= 7 and values["saves_failed"] == "0"


def test_a_tiny_ask_timeout_on_an_idle_node_does_not_say_busy(raw_node):
    tester, _ = raw_node

    def set_timeout(value: float) -> None:
        request = SetParameters.Request(parameters=[Parameter(
            name="ask_timeout_s", value=ParameterValue(type=ParameterType.PARAMETER_DOUBLE,
                                                       double_value=value))])
        assert tester.call(tester.params_client, request).results[0].successful

    tester.reset()
    set_timeout(0.1)
    try:
        reply = tester.ask("what do you see?", max_new_tokens=64)
    finally:
        set_timeout(120.0)
    assert not reply.success and "no answer within 0.1 s" in reply.error
    assert "busy" not in reply.error, reply.error


def test_save_after_reset_and_load_while_streaming_keep_the_stream(raw_node, ros_domain):
    """Findings 3 and 4 over DDS: a save right after a reset records an empty stream; a load
    while the camera streams continues the loaded stream (indices go on from the file's, no
    jump back, the loaded chunks are still in memory)."""
    tester, _ = raw_node
    save, load = file_client(tester, "save_memory"), file_client(tester, "load_memory")
    tester.reset()
    tester.stream(3.0)
    tester.wait_for(lambda: len(tester.drift) >= 3, timeout=120)
    saved = tester.call(save, MemoryFile.Request(path="three.safetensors"), timeout=120)
    assert saved.success and saved.chunks == 3, saved.message
    assert saved.message.startswith("saved 3 chunks ("), saved.message
    tester.reset()
    empty = tester.call(save, MemoryFile.Request(path="empty.safetensors"), timeout=120)
    assert empty.success and empty.chunks == 0, empty.message
    jumps = int(fresh_status(tester)["time_jumps_back"])

    memory_dir = Path(ros_domain["ROS_HOME"]) / "deltas_ros"
    assert read_metadata(memory_dir / "empty.safetensors")["extra"]["stream"] == {}

    # The live camera is on a clock behind the file's (its stamps before the file's last one):
    # its next frame after the load must not count as a jump back and wipe what was loaded.
    # It has made more chunks than the file holds: their indices are never given twice.
    loaded = []
    tester.stream(5.0, start=BASE_STAMP - 100.0)
    tester.wait_for(lambda: len(tester.drift) >= 5, timeout=120)
    tester.stream(3.0, start=BASE_STAMP - 95.0, on_frame=lambda i: i == 15 and loaded.append(
        tester.call(load, MemoryFile.Request(path="three.safetensors"), timeout=120)))
    assert loaded[0].success and loaded[0].chunks == 3, loaded[0].message
    assert loaded[0].message.startswith("loaded 3 chunks ("), loaded[0].message
    final = tester.call(save, MemoryFile.Request(path="after.safetensors"), timeout=120)
    assert final.success and final.chunks >= 4, final.message  # the loaded 3, and more
    with tester.lock:
        after_load = [m for m in tester.drift if m.chunk_index >= 5]
        published = indices(tester.drift)
    assert after_load and all(m.stream_time > 2.5 for m in after_load)
    assert len(published) == len(set(published)) > 5, published
    assert int(fresh_status(tester)["time_jumps_back"]) == jumps


@pytest.fixture
def own_domain(ros_domain, new_domain_id, monkeypatch) -> dict[str, str]:
    """ros_domain under another domain id, for a test that starts its own node: raw_node's node
    lives until the module ends and must not answer this test's calls under the same names."""
    monkeypatch.setenv("ROS_DOMAIN_ID", new_domain_id())
    return dict(os.environ)


def test_compressed_input_corrupt_jpeg_and_sim_time(tiny_model_dir, own_domain):
    process = start(tiny_model_dir, own_domain, topic="/camera/image_raw/compressed",
                    compressed="true", reliable_qos="true", use_sim_time="true")
    tester = Tester(topic="/camera/image_raw/compressed", compressed=True)

    def jpeg(i: int, stamp: float) -> CompressedImage:
        ok, encoded = cv2.imencode(".jpg", scene(i))
        data = encoded.tobytes() if i >= 30 else b"\xff\xd8 not really a jpeg"
        if i == 45:  # a sampled frame (1.5 s) that libjpeg reports corrupt
            data = corrupted_jpeg(data)
        msg = CompressedImage(format="jpeg", data=data)
        msg.header.stamp = stamp_msg(stamp)
        return msg

    try:
        tester.wait_ready(process)
        tester.stream(4.0, make=jpeg)
        # A fresh process: its first chunks pay one-time costs (see raw_node).
        tester.wait_for(lambda: len(tester.drift) >= 2, timeout=120)
        tester.wait_for(lambda: tester.diagnostics
                        and tester.diagnostics[-1].header.stamp.sec == int(BASE_STAMP) + 3)
        tester.wait_for_frames()
        _, values = tester.last_status()
        # The 30 frames before the first good one were each tried (no stream yet), and the
        # damaged one at 1.5 s.
        assert int(values["frames_bad"]) == 31
        assert process.poll() is None
    finally:
        tester.close()
        code, err = stop(process, signal.SIGTERM)
    assert code == 0 and "Traceback" not in err


def test_missing_model_refuses_to_start(tmp_path, own_domain):
    process = start(tmp_path / "nothing-here", own_domain)
    process.wait(timeout=180)
    assert process.returncode == 1
    assert "no model at" in process.stderr.read()


def test_corrupt_model_stops_the_node_with_the_reason(tmp_path, own_domain):
    (tmp_path / "config.json").write_text("{ this is not json")
    process = start(tmp_path, own_domain)
    process.wait(timeout=180)
    assert process.returncode == 1
    assert "cannot load the model" in process.stderr.read()


def test_saved_memory_continues_bit_identically_after_a_restart(tiny_model_dir, own_domain,
                                                                 tmp_path):
    """Save after 3 s, restart with load_on_start, feed seconds 3-6: the same drift as a node
    that never stopped, and the chunk indices go on."""
    memory_file = tmp_path / "memory.safetensors"
    runs = []
    for load in (False, True):
        process = start(tiny_model_dir, own_domain, reliable_qos="true",
                        memory_dir=str(tmp_path), load_on_start=str(load).lower())
        tester = Tester()
        try:
            tester.wait_ready(process)
            if not load:
                tester.stream(3.0)
                tester.wait_for(lambda t=tester: len(t.drift) >= 3, timeout=120)
                time.sleep(0.5)
                saved = tester.call(tester.node.create_client(
                    MemoryFile, "/deltas_memory/save_memory"), MemoryFile.Request())
                assert saved.success and saved.chunks == 3, saved.message
                assert oct(memory_file.stat().st_mode & 0o777) == "0o600"
            tester.stream(3.0, start=BASE_STAMP + 3.0)
            tester.wait_for(lambda t=tester: sum(m.chunk_index >= 3 for m in t.drift) >= 3,
                            timeout=120)
            time.sleep(0.5)
            with tester.lock:
                runs.append([(m.chunk_index, m.stream_time, m.drift, m.kv_tokens)
                             for m in tester.drift if m.chunk_index >= 3])
        finally:
            tester.close()
            stop(process)
    assert [r[0] for r in runs[1]] == [3, 4, 5]
    assert runs[0] == runs[1]
