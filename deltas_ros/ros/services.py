"""The memory's services: ~/ask_memory (AskMemory), ~/reset_memory (Trigger), ~/save_memory and
~/load_memory (MemoryFile). Each asks the worker (between chunks) through the node's current
session; without one (the node unconfigured) they answer so.

Questions run in a callback group that admits `QUESTION_SLOTS` at once and reset/save/load in a
mutually exclusive one, so however many planners call, executor threads stay free for the
camera and the timer (node.EXECUTOR_THREADS counts them); further requests wait in their
service queue (`SERVICE_QUEUE` deep) in order of arrival. Whatever a callback raises is
answered as a failure (ros_adapters.replying), counted in the node's `requests_failed`.
"""

from __future__ import annotations

import time
from typing import Any

from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from std_srvs.srv import Trigger

from ..runtime.files import MemoryPathError
from ..runtime.session import NOT_READY, STOPPED, Session
from ..srv import AskMemory, MemoryFile
from .action import window
from .adapters import BoundedCallbackGroup, replying
from .memory_io import fill_answer

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
        values = self.node.values
        response.error = self.node.no_session() if session is None else \
            session.question_refusal(request.question, request.max_new_tokens)
        if not response.error:
            try:
                answer = session.worker.ask(
                    request.question, request.max_new_tokens or values["max_new_tokens"],
                    values["ask_timeout_s"], **window(request.since, request.until))
            except (RuntimeError, TimeoutError) as error:
                response.error = str(error)
            else:
                fill_answer(response, answer)
                response.success = not answer.cancelled
                response.error = STOPPED if answer.cancelled else ""
        response.message = response.error  # `error` is the deprecated name of `message`
        response.latency_ms = (time.perf_counter() - start) * 1e3
        if not response.success:
            self.node.get_logger().warning(f"question refused: {response.error}")
        return response

    def _operation(self, session: Session | None, name: str, function) -> tuple[Any, str]:
        """Run a Session operation on the worker: (its OpResult or None, the error)."""
        if session is None:
            return None, self.node.no_session()
        if not session.ready:
            return None, NOT_READY
        try:
            return session.worker.call(function, self.node.values["ask_timeout_s"], name), ""
        except (RuntimeError, TimeoutError) as error:
            return None, str(error)

    def _reset(self, _request: Trigger.Request, response: Trigger.Response):
        session = self.node.session
        result, response.message = self._operation(session, "reset",
                                                   session and session.reset)
        if result is not None:
            response.success = True
            response.message = f"memory reset ({result.discarded} waiting chunks discarded)"
        return response

    def _save(self, request: MemoryFile.Request, response: MemoryFile.Response):
        return self._file_service("save", request, response)

    def _load(self, request: MemoryFile.Request, response: MemoryFile.Response):
        return self._file_service("load", request, response)

    def _file_service(self, verb: str, request, response):
        session = self.node.session
        if session is None:
            response.path, response.message = request.path[:1000], self.node.no_session()
            return response
        try:
            path = session.files.resolve(request.path)
        except MemoryPathError as error:
            session.refuse_request()
            response.path, response.message = request.path[:1000], str(error)
        else:
            action = session.save if verb == "save" else session.load
            response.path = str(path)
            result, response.message = self._operation(session, verb,
                                                       lambda m: action(m, path))
            if result is not None:
                response.success, response.chunks = True, result.chunks
                done = "saved" if verb == "save" else "loaded"
                response.message = f"{done} {result.chunks} chunks ({result.kv_tokens} KV " \
                    f"tokens; {result.discarded} waiting chunks discarded)"
        self.node.get_logger().info(f"{verb} {response.path}: {response.message}")
        return response
