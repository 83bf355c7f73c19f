"""The ~/ask action: a question answered between chunks, its answer streamed as feedback token by
token (each message with what the question recalled from the second tier), cancellable within
one token. The memory is bit-identical afterwards in every outcome
(StreamingMemory.ask rolls back). A goal whose callback raises is aborted (or rejected) with the
reason, counted in the node's `requests_failed`.

Goals are rejected while the memory is not serving (the node not active, or the model not
loaded) and when `ACTION_SLOTS` goals are already accepted (the action's question queue is
full): a planner gets an immediate no instead of a goal that waits behind others for minutes.
The server's callbacks are reentrant so that a cancel request is taken while its goal decodes;
the executor threads they may hold are counted in node.EXECUTOR_THREADS.
"""

from __future__ import annotations

import threading
import time

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.node import Node

from ..action import AskMemory
from ..runtime.session import STOPPED
from .memory_io import fill_answer

ACTION_SLOTS = 2  # goals accepted at once (each holds an executor thread while it runs)


def window(since: float, until: float) -> dict[str, float | None]:
    """StreamingMemory.ask's window keywords from the interfaces' fields (0 = open side)."""
    return {"since": since or None, "until": until or None}


class AskActionServer:
    """The action server of `node`, asking through `node.session` (Session.ask)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.lock, self.accepted = threading.Lock(), 0
        self.server = ActionServer(node, AskMemory, "~/ask", execute_callback=self._execute,
                                   goal_callback=self._on_goal,
                                   cancel_callback=lambda _goal: CancelResponse.ACCEPT,
                                   callback_group=ReentrantCallbackGroup())

    def _on_goal(self, _goal) -> GoalResponse:
        try:
            return self._admit()
        except Exception as error:  # rejected, not raised into the executor
            self.node.request_failed("ask goal", error)
            return GoalResponse.REJECT

    def _admit(self) -> GoalResponse:
        session = self.node.session
        with self.lock:
            if session is None or not session.serving_questions \
                    or self.accepted >= ACTION_SLOTS:
                return GoalResponse.REJECT
            self.accepted += 1
        return GoalResponse.ACCEPT

    def _execute(self, goal_handle) -> AskMemory.Result:
        try:
            return self._answer(goal_handle)
        except Exception as error:  # aborted with the reason, not raised into the executor
            goal_handle.abort()
            return AskMemory.Result(message=self.node.request_failed("ask", error))
        finally:
            with self.lock:
                self.accepted -= 1

    def _answer(self, goal_handle) -> AskMemory.Result:
        start, goal, session = time.perf_counter(), goal_handle.request, self.node.session
        result = AskMemory.Result()
        result.message = self.node.no_session() if session is None else ""
        answer = None
        if not result.message:
            recalled = AskMemory.Feedback()  # the recall counts every feedback message carries

            def on_recall(chunks: int, from_disk: int) -> None:
                recalled.recalled_chunks, recalled.recalled_from_disk = chunks, from_disk

            def on_token(text: str, tokens: int, reasoning: str) -> None:
                goal_handle.publish_feedback(AskMemory.Feedback(
                    answer=text, tokens=tokens, reasoning=reasoning,
                    recalled_chunks=recalled.recalled_chunks,
                    recalled_from_disk=recalled.recalled_from_disk))

            try:
                answer = session.ask(
                    goal.question, goal.max_new_tokens, on_token=on_token, on_recall=on_recall,
                    cancelled=lambda: goal_handle.is_cancel_requested,
                    **window(goal.since, goal.until))
            except (RuntimeError, TimeoutError) as error:
                result.message = str(error)
        if answer is not None:
            fill_answer(result, answer)
            self.node.memory_view.answered(answer)
            result.generated_tokens = answer.generated_tokens
            result.success = not answer.cancelled
        result.latency_ms = (time.perf_counter() - start) * 1e3
        if answer is not None and answer.cancelled and goal_handle.is_cancel_requested:
            result.message = "cancelled"
            goal_handle.canceled()
        elif answer is not None and answer.cancelled:  # by the node: deactivate, shutdown
            result.message = STOPPED
            goal_handle.abort()
        elif result.success:
            goal_handle.succeed()
        else:
            self.node.get_logger().warning(f"ask goal failed: {result.message}")
            goal_handle.abort()
        return result
