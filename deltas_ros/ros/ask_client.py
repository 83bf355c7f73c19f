"""`deltas-ros ask`: a planner's question to a running memory node, or to every one on the
graph (`--all`), from the command line.

The same few lines a planner would write in Python: a client for `<node>/ask_memory`, one
request, wait for the response.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PoseStamped
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node

from ..core.config import ASK_TIMEOUT_S, DEFAULT_NODE
from ..srv import AskMemory
from .fleet import RobotAnswer, ask_fleet, discover, format_fleet, robot_dict


def ask(question: str, node_name: str = DEFAULT_NODE, max_new_tokens: int = 0,
        timeout_s: float = ASK_TIMEOUT_S, wait_idle: bool = False) -> AskMemory.Response:
    """Call `<node_name>/ask_memory` once; raises TimeoutError if there is no answer in time.

    wait_idle: first wait until the node's diagnostics show no chunk waiting for the model, so
    that the answer covers everything the camera has sent so far (questions otherwise go before
    waiting chunks).
    """
    context = rclpy.Context()
    rclpy.init(context=context)
    node = Node("deltas_ask", context=context)
    try:
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(node)
        deadline = time.monotonic() + timeout_s
        if wait_idle:
            _wait_until_idle(node, executor, node_name.strip("/").split("/")[-1], deadline)
        client = node.create_client(AskMemory, f"{node_name.rstrip('/')}/ask_memory")
        if not client.wait_for_service(timeout_sec=min(timeout_s, 30.0)):
            raise TimeoutError(f"no {client.srv_name} service: is the memory node running?")
        future = client.call_async(
            AskMemory.Request(question=question, max_new_tokens=max_new_tokens))
        executor.spin_until_future_complete(future, timeout_sec=deadline - time.monotonic())
        if not future.done():
            raise TimeoutError(f"no answer within {timeout_s:.0f} s")
        return future.result()
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def fleet_answers(question: str, max_new_tokens: int, timeout_s: float,
                  discovery_s: float) -> list[RobotAnswer]:
    """Every memory node on the graph asked at once (`fleet.ask_fleet`) from a node of our own,
    after listening `discovery_s` for them; `timeout_s` bounds the questions. What the
    middleware prints meanwhile goes to stderr (`stdout_to_stderr`)."""
    with stdout_to_stderr():
        context = rclpy.Context()
        rclpy.init(context=context)
        node = Node("deltas_ask_all", context=context)
        try:
            services = discover(node, discovery_s)
            return ask_fleet(node, question, timeout_s, max_new_tokens, services=services)
        finally:
            node.destroy_node()
            rclpy.try_shutdown(context=context)


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 on stderr meanwhile: Jazzy's Fast DDS prints its transport errors (a
    shared-memory port it could not lock) on stdout, where they would come before the JSON
    of `ask --all --json`."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def fleet_report(answers: list[RobotAnswer], as_json: bool) -> str:
    """The fleet's answers for a person (a line a robot) or as JSON (an object a robot)."""
    if as_json:
        return json.dumps([robot_dict(a) for a in answers], indent=2)
    return format_fleet(answers)


def _wait_until_idle(node: Node, executor: SingleThreadedExecutor, name: str,
                     deadline: float) -> None:
    """Until a diagnostics status of node `name` reports queue_depth 0 (twice in a row)."""
    idle_reports = []

    def on_diagnostics(msg: DiagnosticArray) -> None:
        for status in msg.status:
            values = {kv.key: kv.value for kv in status.values}
            if status.name.startswith(f"{name}:") and "queue_depth" in values:
                idle_reports.append(values["queue_depth"] == "0")

    subscription = node.create_subscription(DiagnosticArray, "/diagnostics", on_diagnostics, 10)
    try:
        while idle_reports[-2:] != [True, True]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not become idle in time")
            executor.spin_once(timeout_sec=0.2)
    finally:
        node.destroy_subscription(subscription)


def evidence_goal(response: AskMemory.Response) -> PoseStamped | None:
    """Where the answer's strongest evidence was seen, as a navigation goal (RViz's goal tool
    and nav2 take it on `/goal_pose`): the first evidence pose that is known, stamped zero so
    that a navigator transforms it with its newest transform (the chunk's own stamp may lie
    before its tf buffer). None when the question failed or no evidence pose is known."""
    if not response.success:
        return None
    for pose in response.evidence_poses:
        if pose.header.frame_id:
            return PoseStamped(header=type(pose.header)(frame_id=pose.header.frame_id,
                                                        stamp=Time()), pose=pose.pose)
    return None


def format_response(response: AskMemory.Response) -> str:
    """Answer and evidence, as a person reads them."""
    if not response.success:
        return f"error: {response.error}"
    evidence = ", ".join(f"{t:.1f} s" for t in response.evidence_times) or "none"
    reasoning = f"reasoning: {response.reasoning}\n" if response.reasoning else ""
    recalled = (f"; {response.recalled_chunks} chunks recalled ({response.recalled_from_disk} "
                f"from disk)" if response.recalled_chunks else "")
    return (f"{reasoning}answer: {response.answer}\n"
            f"evidence (stream time): {evidence}\n"
            f"memory: {response.memory_tokens} tokens covering "
            f"{response.memory_span_start:.1f}-{response.memory_span_end:.1f} s{recalled}; "
            f"the node answered in {response.latency_ms:.0f} ms")
