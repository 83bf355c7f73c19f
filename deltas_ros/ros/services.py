"""The memory's services: ~/ask_memory (AskMemory), ~/reset_memory (Trigger), ~/save_memory and
~/load_memory (MemoryFile). Each goes through the node's current session (Session.ask,
Session.operate: the worker, between chunks); without one (the node unconfigured) they answer
so.

Questions run in a callback group that admits `QUESTION_SLOTS` at once and reset/save/load in a
mutually exclusive one, so however many planners call, executor threads stay free for the
camera and the timer (node.EXECUTOR_THREADS counts them); further requests wait in their
service queue (`SERVICE_QUEUE` deep) in order of arrival. Whatever a callback raises is
answered as a failure (replying.py), counted in the node's `requests_failed`.
"""

from __future__ import annotations

import time

from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from std_srvs.srv import Trigger

from ..runtime.files import MemoryPathError
from ..runtime.session import STOPPED, Refused
from ..srv import AskMemory, MemoryFile
from .action import window
from .callback_group import BoundedCallbackGroup
from .memory_io import fill_answer
from .replying import replying

SERVICE_QUEUE = 100  # requests held per service beyond those being served; more are dropped
QUESTION_SLOTS = 4  # questions handed to the worker at once


class MemoryServices:
    """The four services of `node`, served through `node.session` (None: unconfigured)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        qos = QoSProfile(depth=SERVICE_QUEUE, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)
        questions = BoundedCallbackGroup(QUESTION_SLOTS)
        memory_ops = MutuallyExclusiveCallbackGroup()
        for srv_type, name, callback, group in (
            (AskMemory, "~/ask_memory", self._ask, questions),
            (Trigger, "~/reset_memory", self._reset, memory_ops),
            (MemoryFile, "~/save_memory", self._save, memory_ops),
            (MemoryFile, "~/load_memory", self._load, memory_ops),
        ):
            node.create_service(srv_type, name, replying(name[2:], callback, node.request_failed),
                                qos_profile=qos, callback_group=group)

    def _ask(self, request: AskMemory.Request, response: AskMemory.Response):
        start, session = time.perf_counter(), self.node.session
        response.error = self.node.no_session() if session is None else ""
        if not response.error:
            try:
                answer = session.ask(request.question, request.max_new_tokens,
                                     **window(request.since, request.until))
            except (RuntimeError, TimeoutError) as error:  # Refused is a RuntimeError
                response.error = str(error)
            else:
                fill_answer(response, answer)
                self.node.memory_view.answered(answer)
                response.success = not answer.cancelled
                response.error = STOPPED if answer.cancelled else ""
        response.message = response.error  # `error` is the deprecated name of `message`
        response.latency_ms = (time.perf_counter() - start) * 1e3
        if not response.success:
            self.node.get_logger().warning(f"question refused: {response.error}")
        return response

    def _reset(self, _request: Trigger.Request, response: Trigger.Response):
        session = self.node.session
        if session is None:
            response.message = self.node.no_session()
            return response
        try:
            result = session.operate("reset")
        except (RuntimeError, TimeoutError) as error:
            response.message = str(error)
        else:
            response.success = True
            response.message = f"memory reset ({result.discarded} waiting chunks discarded)"
        return response

    def _save(self, request: MemoryFile.Request, response: MemoryFile.Response):
        return self._file_service("save", request, response)

    def _load(self, request: MemoryFile.Request, response: MemoryFile.Response):
        return self._file_service("load", request, response)

    def _file_service(self, verb: str, request, response):
        session, response.path = self.node.session, request.path[:1000]
        try:
            if session is None:
                raise Refused(self.node.no_session())
            path = session.resolve_file(request.path)
            response.path = str(path)
            result = session.operate(verb, path)
        except (MemoryPathError, RuntimeError, TimeoutError) as error:
            response.message = str(error)
        else:
            response.success, response.chunks = True, result.chunks
            done = "saved" if verb == "save" else "loaded"
            response.message = f"{done} {result.chunks} chunks ({result.kv_tokens} KV " \
                f"tokens; {result.discarded} waiting chunks discarded)"
        self.node.get_logger().info(f"{verb} {response.path}: {response.message}")
        return response
