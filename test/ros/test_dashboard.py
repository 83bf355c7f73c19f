"""The browser dashboard: its HTTP rules without ROS, then against a real memory node over DDS,
then in a real headless chromium, then as launch/deltas.launch.py starts it beside a node in a
namespace.

`ros2 launch` itself is not installable here (launch and launch_ros are not on PyPI), so the
launch file's dashboard command is read from its source (as runtime/test_params.py reads its
arguments), formed for a namespace the way launch joins a substitution list, and run as it is."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from dashboard_helpers import SlowMemory, chromium, open_events
from deltas_ros.action import AskMemory as AskAction
from deltas_ros.msg import MemoryChunks
from engine_helpers import wait_until
from geometry_msgs.msg import PoseStamped
from ros_helpers import BASE_STAMP, SMALL, Tester, node_command, stamp_msg, start, stop

from bench.dashboard_page import dashboard_url
from deltas_ros.ros.dashboard import held_dict, result_dict
from deltas_ros.ros.dashboard_access import check_bind
from deltas_ros.ros.dashboard_http import DashboardHttp
from deltas_ros.ros.dashboard_limits import Limits
from deltas_ros.ros.dashboard_state import DashboardState

REPO = Path(__file__).resolve().parents[2]


def fake_ask(question, on_feedback, left) -> dict:
    on_feedback({"answer": "a red", "tokens": 2})
    return {"success": True, "answer": "a red cube", "evidence_times": [1.0]}


@pytest.fixture
def server():
    state = DashboardState(Limits(chunks=5, max_subscribers=2))
    for i in range(3):
        state.add_chunk({"index": i, "stream_time": float(i), "drift": 0.1, "kv_tokens": 10,
                         "evicted_tokens": 4 if i == 2 else 0})
    srv = DashboardHttp(state, "127.0.0.1", 0, token="secret", ask=fake_ask,
                        cancel=lambda: True)
    port = srv.start()
    yield state, f"http://127.0.0.1:{port}"
    srv.stop()


def get(url: str, data: bytes | None = None, headers: dict | None = None):
    """GET, or POST `data` as JSON (the only body the dashboard accepts)."""
    sent = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data=data, headers=sent | (headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def sse_result(reply: str) -> dict:
    return json.loads(reply.split("event: result\ndata: ")[1].split("\n")[0])


def test_a_non_loopback_host_needs_a_token():
    check_bind("127.0.0.1", "")
    check_bind("::1", "")
    check_bind("0.0.0.0", "t")
    with pytest.raises(ValueError, match="token"):
        check_bind("0.0.0.0", "")
    with pytest.raises(ValueError, match="token"):
        DashboardHttp(DashboardState(), "192.168.1.2", 0)


def test_buffers_and_subscribers_are_bounded():
    state = DashboardState(Limits(chunks=4, max_subscribers=2))
    for i in range(10):
        state.add_chunk({"index": i, "evicted_tokens": i % 2})
    snap = state.snapshot()
    assert [c["index"] for c in snap["chunks"]] == [6, 7, 8, 9]
    assert all(c["evicted_tokens"] > 0 for c in snap["evictions"])
    first, second = state.subscribe(), state.subscribe()
    third = state.subscribe()  # the oldest gives way: a new page always gets its view
    assert state.subscribers == [second, third]
    assert first.queue.get_nowait() is None  # its stream ends


def test_the_second_tier_and_the_recalled_chunks_reach_the_page():
    """~/memory_chunks' second tier with each tier by name (only as many as the timeline keeps
    chunks, the newest), and an answer's recalled chunks' times."""
    msg = MemoryChunks(stream_time=[5.0], tokens=[10], bucket=[-1],
                       tiered_time=[1.0, 2.0, 3.0], tiered_tokens=[12, 6, 4],
                       tiered_tier=[MemoryChunks.TIER_DISK, MemoryChunks.TIER_DISK,
                                    MemoryChunks.TIER_HOST])
    state = DashboardState(Limits(chunks=2))
    state.set_held(held_dict(msg))
    held = state.snapshot()["held"]
    assert (held["stream_time"], held["tokens"], held["bucket"]) == ([5.0], [10], [-1])
    assert (held["tiered_time"], held["tiered_tokens"], held["tiered_tier"]) == (
        [2.0, 3.0], [6, 4], ["disk", "host"])
    result = result_dict(AskAction.Result(success=True, recalled_chunks=2, recalled_from_disk=1,
                                          recalled_times=[1.0, 3.0]))
    assert (result["recalled_chunks"], result["recalled_from_disk"],
            result["recalled_times"]) == (2, 1, [1.0, 3.0])


def test_http_state_token_and_body_limit(server):
    state, url = server
    assert get(f"{url}/state")[0] == 401
    code, body = get(f"{url}/state?token=secret")
    assert code == 200 and [c["index"] for c in json.loads(body)["chunks"]] == [0, 1, 2]
    assert json.loads(body)["evictions"][0]["index"] == 2
    assert get(f"{url}/", headers={"X-Token": "secret"})[1].startswith(b"<!doctype html>")
    assert get(f"{url}/memory.jpg?token=secret")[0] == 404
    assert get(f"{url}/ask?token=secret", data=b"x" * 5000)[0] == 413
    assert get(f"{url}/ask?token=secret", data=b"{}", headers={"Content-Type": "text/plain"}
               )[0] == 415
    code, body = get(f"{url}/ask?token=secret", data=json.dumps({"question": "what?"}).encode())
    assert code == 200
    assert b"event: feedback" in body and b'"a red cube"' in body
    assert json.loads(get(f"{url}/cancel?token=secret", data=b"{}")[1]) == {"cancelled": True}
    assert get(f"{url}/reset?token=secret", data=b"{}")[0] == 404  # read-only


def wait_state(url: str, predicate, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, body = get(f"{url}/state")
        if code == 200 and predicate(state := json.loads(body)):
            return state
        time.sleep(0.5)
    raise TimeoutError("the dashboard never saw that")


def wait_matched(url: str, tester: Tester, node: str) -> None:
    """Until the dashboard hears the node (its diagnostics) and subscribes to its drift: a
    chunk published before that is never seen by the dashboard (~/drift is volatile), and these
    tests stream only three."""
    wait_state(url, lambda s: s["health"])
    tester.wait_for(lambda: tester.node.count_subscribers(f"{node}/drift") >= 2)


def robot_pose(stamp: float) -> PoseStamped:
    """Where the test's robot is at `stamp`: along a circle of 2 m, facing along it."""
    angle = 0.8 * (stamp - BASE_STAMP)
    msg = PoseStamped()
    msg.header.stamp, msg.header.frame_id = stamp_msg(stamp), "odom"
    msg.pose.position.x, msg.pose.position.y = 2 * math.cos(angle), 2 * math.sin(angle)
    msg.pose.orientation.z = math.sin((angle + math.pi / 2) / 2)
    msg.pose.orientation.w = math.cos((angle + math.pi / 2) / 2)
    return msg


@pytest.fixture(scope="module")
def live(tiny_model_dir, ros_domain):
    """A memory node fed a few seconds of frames and the robot's poses, and `deltas-ros
    dashboard` beside it; the budget is small enough that the last chunk evicts."""
    node = start(tiny_model_dir, ros_domain, reliable_qos="true", budget_tokens="48",
                 window_tokens="16", pose_topic="/robot_pose", pose_type="pose_stamped")
    env = dict(ros_domain, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    dash = subprocess.Popen(
        [sys.executable, "-m", "deltas_ros.tools.cli", "dashboard", "--port", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tester = Tester()
    try:
        url = dashboard_url(dash)
        assert url.startswith("http://127.0.0.1:"), url
        tester.wait_ready(node)
        wait_matched(url, tester, "/deltas_memory")
        poses = tester.node.create_publisher(PoseStamped, "/robot_pose", 100)
        # Each pose a little ahead of its frame: a chunk's stamp always lies between two.
        tester.stream(3.0, on_frame=lambda i: poses.publish(robot_pose(BASE_STAMP + i / 30
                                                                       + 0.1)))
        tester.wait_for(lambda: len(tester.drift) >= 3, timeout=180)
        yield url
    finally:
        tester.close()
        dash.terminate()
        dash.wait(timeout=30)
        stop(node)


@pytest.mark.ros
@pytest.mark.slow
def test_dashboard_sees_chunks_and_answers(live):
    state = wait_state(live, lambda s: len(s["chunks"]) >= 3 and s["health"] and s["held"]
                       and s["held"]["stream_time"][-1] == s["chunks"][-1]["stream_time"])
    assert state["chunks"][0]["stream_time"] >= 0 and state["health"]["values"]["lifecycle"]
    assert all(c["pose"]["frame_id"] == "odom" for c in state["chunks"])
    held = state["held"]
    assert held["stream_time"] == sorted(held["stream_time"])
    assert held["bucket"][-1] == max(held["bucket"])
    assert any(c["evicted_tokens"] for c in state["chunks"])
    assert sum(held["tokens"]) < sum(
        c["chunk_tokens"] for c in state["chunks"])
    code, body = get(f"{live}/ask", data=json.dumps({"question": "What did you see?"}).encode())
    result = sse_result(body.decode())
    assert code == 200 and result["success"], result
    assert result["evidence_times"] and len(result["evidence_stamps"]) == len(
        result["evidence_times"])
    assert all(p["frame_id"] == "odom" for p in result["evidence_poses"])
    assert result["recalled_chunks"] == result["recalled_from_disk"] == 0  # no second tier
    assert result["recalled_times"] == [] and held["tiered_time"] == held["tiered_tier"] == []


# Records what the page sends to /ask and the reply it streams back (a clone of the response).
FETCH_SPY = """
window.asked = [];
const plain = window.fetch;
window.fetch = async (url, options) => {
  const response = await plain(url, options);
  if (String(url).startsWith("/ask"))
    window.asked.push({body: options.body, reply: response.clone().text()});
  return response;
};
"""
TIP = "return document.getElementById('maptip').textContent"
TIPS = "return [...document.querySelectorAll('#timeline rect.bar title')].map(t => t.textContent)"
LAST_ASK = """
const done = arguments[arguments.length - 1];
const last = window.asked[window.asked.length - 1];
last.reply.then((reply) => done({body: last.body, reply}));
"""


@pytest.mark.ros
@pytest.mark.slow
def test_the_page_in_headless_chromium(live):
    browser = chromium()
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    def value(input_id: str) -> float:
        return float(browser.find_element(By.ID, input_id).get_attribute("value"))

    try:
        browser.get(f"{live}/")
        wait = WebDriverWait(browser, 60)
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#timeline rect.bar")))
        # Each bar says where its chunk is held (~/memory_chunks): its bucket and tokens.
        wait.until(lambda b: len(b.execute_script(TIPS)) >= 3 and all(
            "tokens held" in tip for tip in b.execute_script(TIPS)))
        # Health at a glance: one tile per concern, each with its level and reason.
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, '#tiles .tile[data-name="Memory"]'))
        # Read in one script: the tiles are redrawn at every diagnostics report (1 Hz), and an
        # element found before a redraw is stale after it.
        tiles = browser.execute_script(
            "return [...document.querySelectorAll('#tiles .tile')].map("
            "t => [t.className, (t.querySelector('.why') || {}).textContent || ''])")
        assert tiles
        for classes, why in tiles:
            assert classes.split()[-1] in ("ok", "warn", "error") and why, (classes, why)
        # The map: a point per posed chunk; hovering the newest gives its time, clicking it
        # sets the question's window around it.
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#map circle.pt")) >= 3)
        assert "Frame odom" in browser.find_element(By.ID, "map-note").text
        spelled = browser.execute_script(  # in one script: a chunk that arrives redraws the map
            "const p = document.querySelectorAll('#map circle.pt');"
            "return p[p.length - 1].getAttribute('data-t')")
        t = float(spelled)
        shown = browser.execute_script("return `t=${arguments[0].toFixed(2)} s`", t)

        def on_point(act) -> bool:  # found again each try: a chunk that arrives redraws the map
            point = browser.find_element(By.CSS_SELECTOR, f'#map circle.pt[data-t="{spelled}"]')
            act(ActionChains(browser), point).perform()
            return True

        retry = WebDriverWait(browser, 60, ignored_exceptions=[StaleElementReferenceException])
        retry.until(lambda b: on_point(lambda chain, point: chain.move_to_element(point)))
        wait.until(lambda b: shown in b.execute_script(TIP))
        retry.until(lambda b: on_point(lambda chain, point: chain.click(point)))
        assert value("since") <= t <= value("until") <= value("since") + 0.2
        # Drag from 40 % of the timeline to its right end: the newer chunks only.
        timeline = browser.find_element(By.ID, "timeline")
        width = timeline.size["width"]
        ActionChains(browser).move_to_element_with_offset(timeline, int(-0.1 * width), 0) \
            .click_and_hold().move_by_offset(int(0.59 * width), 0).release().perform()
        since, until = value("since"), value("until")
        assert 0 < since < until, (since, until)
        assert browser.find_elements(By.CSS_SELECTOR, "#timeline rect.window")
        browser.execute_script(FETCH_SPY)
        browser.find_element(By.ID, "question").send_keys("What did you see?")
        browser.find_element(By.ID, "ask").click()
        wait = WebDriverWait(browser, 180)
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#evidence.has-evidence")))
        assert browser.find_element(By.ID, "answer").text.strip() not in ("", "…")
        assert browser.find_elements(By.CSS_SELECTOR, "#timeline rect.bar.evidence")
        assert browser.find_elements(By.CSS_SELECTOR, "#map .pt.evidence")
        asked = browser.execute_async_script(LAST_ASK)
        assert json.loads(asked["body"])["window"] == [since, until]
        result = sse_result(asked["reply"])
        assert result["success"] and result["evidence_times"], result
        assert all(since <= t <= until for t in result["evidence_times"]), (since, until, result)
        browser.find_element(By.ID, "clear").click()
        assert (value("since"), value("until")) == (0, 0)
        assert not browser.find_elements(By.CSS_SELECTOR, "#timeline rect.window")
    finally:
        browser.quit()


@pytest.mark.ros
@pytest.mark.slow
def test_a_page_closed_mid_answer_leaves_the_dashboard_serving(ros_env):
    """A tab closed while its answer streams ends only its own request, and its goal is
    cancelled (nobody waits for that answer any more); the dashboard process lives on, serves
    and answers the next question. The page is opened beside more idle /events streams than
    the cap, and still gets its live view (the node's health)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chromium()
    memory = SlowMemory()
    env = dict(ros_env, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    dash = subprocess.Popen(
        [sys.executable, "-m", "deltas_ros.tools.cli", "dashboard", "--port", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    quick = json.dumps({"question": "quick"}).encode()
    flood: list = []
    try:
        url = dashboard_url(dash)
        # Until the dashboard has discovered the action (each try waits up to 5 s for it).
        assert wait_until(lambda: sse_result(get(f"{url}/ask", data=quick)[1].decode())
                          ["success"], 120)
        port = int(url.rsplit(":", 1)[1])
        flood = [open_events(port) for _ in range(Limits().max_subscribers + 4)]
        browser.get(f"{url}/")
        WebDriverWait(browser, 60).until(
            lambda b: SlowMemory.HEALTH in b.find_element(By.ID, "status").text)
        browser.find_element(By.ID, "question").send_keys("What did you see?")
        browser.find_element(By.ID, "ask").click()
        WebDriverWait(browser, 60).until(
            lambda b: "red red" in b.find_element(By.ID, "answer").text)
        browser.quit()  # mid-answer: the goal streams for a minute more
        browser = None
        assert wait_until(memory.cancelled.is_set, 60)
        assert dash.poll() is None
        assert get(f"{url}/state")[0] == 200
        assert sse_result(get(f"{url}/ask", data=quick)[1].decode())["success"]
        assert dash.poll() is None
    finally:
        for sock in flood:
            sock.close()
        if browser is not None:
            browser.quit()
        dash.terminate()
        _, err = dash.communicate(timeout=30)
        memory.close()
    assert "Traceback" not in err, err


def substitute(node: ast.expr, arguments: dict[str, str]) -> str:
    """A launch substitution as text: a string, LaunchConfiguration(name), or a list of them
    (launch concatenates a list)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "LaunchConfiguration":
        return arguments[node.args[0].value]
    if isinstance(node, ast.List):
        return "".join(substitute(part, arguments) for part in node.elts)
    raise AssertionError(f"unexpected substitution in the launch file: {ast.unparse(node)}")


def dashboard_command(namespace: str) -> list[str]:
    """The dashboard ExecuteProcess's cmd for `namespace:=<namespace>`."""
    tree = ast.parse((REPO / "launch" / "deltas.launch.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "ExecuteProcess")
    cmd = next(k.value for k in call.keywords if k.arg == "cmd")
    return [substitute(part, {"namespace": namespace}) for part in cmd.elts]


def test_the_launch_command_names_the_node_in_its_namespace():
    assert dashboard_command("") == ["deltas-ros", "dashboard", "--node", "/deltas_memory"]
    assert dashboard_command("robot1")[-1] in ("robot1/deltas_memory", "/robot1/deltas_memory")
    setup = (REPO / "setup.py").read_text()
    assert '"deltas-ros = deltas_ros.tools.cli:main"' in setup  # what cmd[0] runs


@pytest.mark.ros
@pytest.mark.slow
@pytest.mark.parametrize("namespace", ["robot1", ""])
def test_the_launched_dashboard_sees_a_namespaced_node(namespace, tiny_model_dir, ros_env):
    """As `ros2 launch deltas_ros deltas.launch.py namespace:=<ns> dashboard:=true` would run
    them (launch_ros makes a relative namespace absolute for the node)."""
    command = node_command(tiny_model_dir, "/camera/image_raw", reliable_qos="true", **SMALL)
    if namespace:
        command += ["-r", f"__ns:=/{namespace}"]
    node = subprocess.Popen(command, env=ros_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    cmd = dashboard_command(namespace)
    env = dict(ros_env, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    # `deltas-ros` is deltas_ros.tools.cli:main; port 0 only so that tests never collide.
    dash = subprocess.Popen([sys.executable, "-m", "deltas_ros.tools.cli", *cmd[1:],
                             "--port", "0"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    name = f"/{namespace}/deltas_memory" if namespace else "/deltas_memory"
    tester = Tester(namespace=name)
    try:
        url = dashboard_url(dash)
        assert url.startswith("http://127.0.0.1:"), url
        tester.wait_ready(node)
        wait_matched(url, tester, name)
        tester.stream(3.0)
        tester.wait_for(lambda: len(tester.drift) >= 3, timeout=180)
        state = wait_state(url, lambda s: len(s["chunks"]) >= 3 and s["health"] and s["image"])
        assert [c["index"] for c in state["chunks"]][:3] == [m.chunk_index
                                                             for m in tester.drift[:3]]
        code, body = get(f"{url}/ask", data=json.dumps({"question": "What?"}).encode())
        assert code == 200 and sse_result(body.decode())["success"]
    finally:
        tester.close()
        dash.terminate()
        dash.wait(timeout=30)
        stop(node)
