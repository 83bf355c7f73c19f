"""A fleet's memories asked at once: every AskMemory service on the graph, in every namespace,
asked concurrently under one timeout (`deltas-ros ask --all`, or `ask_fleet` from a planner).

A robot that does not answer in time is reported as such; the others still are.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node

from ..srv import AskMemory
from .plain import pose_dict, seconds

SERVICE_TYPE = "deltas_ros/srv/AskMemory"
SUFFIX = "/ask_memory"
POLL_S = 0.02


@dataclass
class RobotAnswer:
    """One memory node's reply: `response` when it answered in time (which may itself be a
    refusal: `response.success`), else `error` says why not."""

    robot: str  # the memory node's full name, e.g. /robot1/deltas_memory
    response: AskMemory.Response | None = None
    error: str = ""

    @property
    def answered(self) -> bool:
        return self.response is not None and self.response.success


def memory_services(node: Node) -> list[str]:
    """The AskMemory services this node's graph knows, sorted by name (the nodes' own
    `~/ask_memory`; a service of another name and the same type counts too)."""
    return sorted(name for name, types in node.get_service_names_and_types()
                  if SERVICE_TYPE in types)


def discover(node: Node, listen_s: float) -> list[str]:
    """memory_services after listening to the graph for `listen_s` seconds: a node that just
    started knows nobody, and DDS discovery takes from a fraction of a second to seconds (on a
    busy machine, one participant's announcements reach us later than another's), so a fleet
    of unknown size cannot be known complete sooner."""
    deadline = time.monotonic() + listen_s
    with _waiting(node) as wait:
        while (left := deadline - time.monotonic()) > 0:
            wait(min(left, 0.1))
    return memory_services(node)


def ask_fleet(node: Node, question: str, timeout: float, max_new_tokens: int = 0,
              since: float = 0.0, until: float = 0.0,
              services: list[str] | None = None) -> list[RobotAnswer]:
    """Ask every memory on the graph (or `services`) the same question at once and wait at most
    `timeout` seconds in all; one RobotAnswer per memory, sorted by name.

    Works with a node an executor already spins (in another thread: the replies arrive there)
    and with one nobody spins (it is spun here until the replies are in or the time is up)."""
    deadline = time.monotonic() + timeout
    names = memory_services(node) if services is None else sorted(services)
    request = AskMemory.Request(question=question, max_new_tokens=max_new_tokens, since=since,
                                until=until)
    clients = {name: node.create_client(AskMemory, name) for name in names}
    try:
        pending, answers = {}, {}
        with _waiting(node) as wait:
            while time.monotonic() < deadline:
                for name, client in clients.items():
                    if name not in pending and client.service_is_ready():
                        pending[name] = client.call_async(request)
                if len(pending) == len(clients) and all(f.done() for f in pending.values()):
                    break
                wait(POLL_S)
        for name in names:
            robot = name.removesuffix(SUFFIX) or name
            future = pending.get(name)
            if future is None:
                answers[name] = RobotAnswer(robot, error="the service is not available")
            elif future.done() and future.exception() is None:
                answers[name] = RobotAnswer(robot, future.result())
            else:
                future.cancel()
                answers[name] = RobotAnswer(robot, error=f"no answer within {timeout:g} s")
        return [answers[name] for name in names]
    finally:
        for client in clients.values():
            node.destroy_client(client)


@contextmanager
def _waiting(node: Node) -> Iterator:
    """wait(seconds): let time pass while the node's callbacks run. An executor spinning the
    node elsewhere (a planner's) delivers them, so this sleeps; else a private executor spins
    the node meanwhile and lets it go after."""
    if node.executor is not None:
        yield time.sleep
        return
    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    try:
        yield lambda seconds: executor.spin_once(timeout_sec=seconds)
    finally:
        node.executor = None
        executor.shutdown()


def robot_dict(answer: RobotAnswer) -> dict:
    """One robot's reply as plain data (`deltas-ros ask --all --json`)."""
    out: dict = {"robot": answer.robot, "answered": answer.answered}
    response = answer.response
    if response is None:
        return out | {"error": answer.error}
    if not response.success:
        return out | {"error": response.message or response.error}
    return out | {
        "answer": response.answer, "truncated": response.truncated,
        "evidence": [{"time": t, "stamp": seconds(s), "pose": pose_dict(p)}
                     for t, s, p in zip(response.evidence_times, response.evidence_stamps,
                                        response.evidence_poses)],
        "memory_span": [response.memory_span_start, response.memory_span_end],
        "latency_ms": response.latency_ms, "recalled_chunks": response.recalled_chunks,
        "recalled_from_disk": response.recalled_from_disk,
        "recalled_times": list(response.recalled_times)}


def format_fleet(answers: list[RobotAnswer]) -> str:
    """Each robot's answer with its strongest evidence's time and pose, as a person reads it."""
    lines = []
    for a in answers:
        data = robot_dict(a)
        if not a.answered:
            lines.append(f"{a.robot}: {data['error']}")
            continue
        first = data["evidence"][0] if data["evidence"] else None
        where = "no evidence"
        if first:
            pose = first["pose"]
            at = (f" at ({pose['x']:.2f}, {pose['y']:.2f}, {pose['z']:.2f}) in "
                  f"{pose['frame_id']}" if pose else ", pose unknown")
            where = f"evidence {first['time']:.1f} s{at}"
        lines.append(f"{a.robot}: {data['answer']} ({where})")
    return "\n".join(lines)
