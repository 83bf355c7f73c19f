"""A fleet asked at once over DDS: three memory nodes in three namespaces, one of them made slow
(its process stopped), asked by `ask_fleet` from a planner's node and by `deltas-ros ask --all`;
and an answer's evidence turned into a goal on /goal_pose."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from builtin_interfaces.msg import Time
from deltas_ros.srv import AskMemory
from geometry_msgs.msg import PoseStamped
from ros_helpers import (
    BASE_STAMP,
    PREFIX,
    SMALL,
    Tester,
    node_command,
    stamp_msg,
    stop,
)

from deltas_ros.ros.ask_client import evidence_goal, format_response
from deltas_ros.ros.fleet import RobotAnswer, ask_fleet, discover, format_fleet, robot_dict
from deltas_ros.tools import cli

ROBOTS = ("/robot1", "/robot2", "/robot3")
TRANSPORTS = "FASTDDS_BUILTIN_TRANSPORTS"
SLOW = "/robot2"
QUESTION = "Where was the red cup?"


class FleetTester(Tester):
    """The camera and pose publisher all three robots listen to, and a /goal_pose listener."""

    __test__ = False

    def __init__(self) -> None:
        super().__init__(namespace=f"{ROBOTS[0]}/deltas_memory")
        self.pose_pub = self.node.create_publisher(PoseStamped, "/robot_pose", 100)
        self.goals: list[PoseStamped] = []
        self.node.create_subscription(PoseStamped, "/goal_pose", self._on_goal, 10)
        self.goal_pub = self.node.create_publisher(PoseStamped, "/goal_pose", 10)

    def _on_goal(self, msg: PoseStamped) -> None:
        with self.lock:
            self.goals.append(msg)

    def publish_pose(self, stamp: float) -> None:
        msg = PoseStamped()
        msg.header.stamp, msg.header.frame_id = stamp_msg(stamp), "map"
        msg.pose.position.x, msg.pose.position.y = 0.5 * (stamp - BASE_STAMP), 1.0
        msg.pose.orientation.w = 1.0
        self.pose_pub.publish(msg)


def ask_robot(tester: FleetTester, robot: str, question: str) -> AskMemory.Response:
    client = tester.node.create_client(AskMemory, f"{robot}/deltas_memory/ask_memory")
    try:
        return tester.call(client, AskMemory.Request(question=question, max_new_tokens=2),
                           timeout=120)
    finally:
        tester.node.destroy_client(client)


def loaded(tester: FleetTester, robot: str, process: subprocess.Popen) -> bool:
    """Whether the robot's model is in: a blank question is refused as empty, not "not ready"
    (three nodes importing torch at once on a loaded machine take a while)."""
    assert process.poll() is None, f"{robot} exited: {process.stderr.read()[-3000:]}"
    client = tester.node.create_client(AskMemory, f"{robot}/deltas_memory/ask_memory")
    try:
        if not client.wait_for_service(timeout_sec=1.0):
            return False
    finally:
        tester.node.destroy_client(client)
    return "empty" in ask_robot(tester, robot, " ").message


def wait_until_true(check, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet_env(ros_domain):
    """UDP only, as between robots on different computers: over the shared-memory transport of
    one machine, a stopped process's full port held up everybody's discovery, a fault a real
    fleet does not have."""
    saved = os.environ.get(TRANSPORTS)
    os.environ[TRANSPORTS] = "UDPv4"
    yield ros_domain | {TRANSPORTS: "UDPv4"}
    if saved is None:
        os.environ.pop(TRANSPORTS)
    else:
        os.environ[TRANSPORTS] = saved


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, fleet_env):
    processes = {}
    for robot in ROBOTS:
        command = node_command(tiny_model_dir, "/camera/image_raw", **(SMALL | dict(
            reliable_qos="true", pose_topic="/robot_pose", pose_type="pose_stamped")))
        at = command.index("--ros-args") + 1
        command[at:at] = ["-r", f"__ns:={robot}"]
        processes[robot] = subprocess.Popen(command, env=fleet_env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True)
    tester = FleetTester()
    try:
        for robot, process in processes.items():
            wait_until_true(lambda r=robot, p=process: loaded(tester, r, p),
                            f"{robot} did not come up")
        wait_until_true(lambda: tester.camera.get_subscription_count() >= len(ROBOTS)
                        and tester.pose_pub.get_subscription_count() >= len(ROBOTS),
                        "the robots do not all listen to the camera and the poses")
        tester.stream(6.0, speed=2.0,
                      on_frame=lambda i: tester.publish_pose(BASE_STAMP + i / 30 + 0.1))
        for robot in ROBOTS:
            wait_until_true(lambda r=robot: ask_robot(tester, r, QUESTION).evidence_times,
                            f"{robot} took no chunk")
        yield tester, processes
    finally:
        tester.close()
        for robot, process in processes.items():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
            code, err = stop(process)
            print(f"{robot} exited {code}; stderr:\n{err[-3000:]}")


@pytest.fixture
def slow_robot(fleet):
    """robot2's process stopped (SIGSTOP): on the graph, but it answers nothing until resumed."""
    _, processes = fleet
    processes[SLOW].send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        processes[SLOW].send_signal(signal.SIGCONT)


def test_every_memory_on_the_graph_is_found(fleet):
    tester, _ = fleet
    assert discover(tester.node, 1.0) == [f"{r}/deltas_memory/ask_memory" for r in ROBOTS]


def test_ask_fleet_reports_each_robot_and_the_slow_one_as_late(fleet, slow_robot):
    tester, _ = fleet
    started = time.monotonic()
    answers = ask_fleet(tester.node, QUESTION, timeout=20.0, max_new_tokens=2)
    assert time.monotonic() - started < 40  # one timeout for all, not one each
    assert [a.robot for a in answers] == [f"{r}/deltas_memory" for r in ROBOTS]
    by_robot = {a.robot.split("/")[1]: a for a in answers}
    assert not by_robot["robot2"].answered
    assert by_robot["robot2"].error == "no answer within 20 s"
    for name in ("robot1", "robot3"):
        answer = by_robot[name]
        assert answer.answered, answer
        data = robot_dict(answer)
        assert data["evidence"] and data["evidence"][0]["pose"]["frame_id"] == "map"
        assert data["evidence"][0]["pose"]["y"] == pytest.approx(1.0)
        assert data["recalled_chunks"] == data["recalled_from_disk"] == 0  # no second tier
    text = format_fleet(answers)
    assert "/robot2/deltas_memory: no answer within 20 s" in text
    assert " in map)" in text


def ask_all(env: dict[str, str]) -> tuple[int, list[dict]]:
    """`deltas-ros ask --all --json` in a process of its own: (exit code, robots)."""
    command = [str(PREFIX / "bin" / "deltas-ros"), "ask", "--all", "--json", "--timeout", "20",
               "--discovery", "6", "--max-new-tokens", "2", QUESTION]  # a loaded machine
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def test_ask_all_command_prints_one_object_per_robot(fleet, fleet_env):
    code, robots = ask_all(fleet_env)
    assert code == 0
    assert [r["robot"] for r in robots] == [f"{r}/deltas_memory" for r in ROBOTS]
    for robot in robots:
        assert robot["answered"] and robot["answer"] is not None
        assert robot["evidence"][0]["pose"]["frame_id"] == "map"
        assert robot["evidence"][0]["time"] > 0


def test_a_robot_gone_quiet_before_the_command_started_is_not_listed(fleet, slow_robot,
                                                                     fleet_env):
    """A new process discovers only participants that answer discovery: robot2, stopped, is
    not on its graph (ask_fleet above reports one that stopped after it was seen)."""
    code, robots = ask_all(fleet_env)
    assert code == 0
    assert [r["robot"] for r in robots] == ["/robot1/deltas_memory", "/robot3/deltas_memory"]


def test_an_answers_evidence_becomes_a_goal_on_goal_pose(fleet):
    tester, _ = fleet
    response = ask_robot(tester, ROBOTS[0], QUESTION)
    goal = evidence_goal(response)
    assert goal is not None and goal.header.frame_id == "map"
    assert goal.header.stamp == Time()  # the navigator's newest transform
    assert goal.pose == response.evidence_poses[0].pose
    deadline = time.monotonic() + 30
    while not tester.goals:
        assert time.monotonic() < deadline, "no goal arrived on /goal_pose"
        tester.goal_pub.publish(goal)
        time.sleep(0.2)
    with tester.lock:
        assert tester.goals[0].pose == goal.pose


def test_no_goal_without_a_known_evidence_pose():
    unknown = AskMemory.Response(success=True, evidence_times=[1.0],
                                 evidence_poses=[PoseStamped()])
    assert evidence_goal(unknown) is None
    assert evidence_goal(AskMemory.Response(success=False)) is None


def test_an_answer_says_how_many_chunks_it_recalled_and_from_where():
    response = AskMemory.Response(success=True, answer="red", memory_tokens=8,
                                  recalled_chunks=3, recalled_from_disk=1,
                                  recalled_times=[0.5, 2.5, 4.5])
    assert "; 3 chunks recalled (1 from disk);" in format_response(response)
    data = robot_dict(RobotAnswer("/robot1/deltas_memory", response))
    assert (data["recalled_chunks"], data["recalled_from_disk"]) == (3, 1)
    assert data["recalled_times"] == [0.5, 2.5, 4.5]
    response.recalled_chunks = response.recalled_from_disk = 0
    assert "recalled" not in format_response(response)


@pytest.mark.parametrize("argv", [["--json"], ["--all", "--node", "/robot1/deltas_memory"],
                                  ["--all", "--wait-idle"], ["--all", "--discovery", "-1"]])
def test_ask_refuses_options_that_do_not_go_together(argv, capsys):
    assert cli.main(["ask", QUESTION, *argv]) == 2
    assert "error:" in capsys.readouterr().err


def test_what_the_middleware_prints_meanwhile_stays_off_stdout(capfd):
    from deltas_ros.ros.ask_client import stdout_to_stderr

    with stdout_to_stderr():
        os.write(1, b"RTPS_TRANSPORT_SHM Error\n")
    print("[]", flush=True)
    out, err = capfd.readouterr()
    assert out == "[]\n" and "RTPS_TRANSPORT_SHM Error" in err
