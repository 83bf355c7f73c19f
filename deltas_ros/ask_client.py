"""`deltas-ros ask`: a planner's question to a running memory node, from the command line.

The same few lines a planner would write in Python: a client for `<node>/ask_memory`, one
request, wait for the response.
"""

from __future__ import annotations

import time

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node

from .srv import AskMemory


def ask(question: str, node_name: str = "/deltas_memory", max_new_tokens: int = 0,
        timeout_s: float = 120.0) -> AskMemory.Response:
    """Call `<node_name>/ask_memory` once; raises TimeoutError if there is no answer in time."""
    context = rclpy.Context()
    rclpy.init(context=context)
    node = Node("deltas_ask", context=context)
    try:
        client = node.create_client(AskMemory, f"{node_name.rstrip('/')}/ask_memory")
        deadline = time.monotonic() + timeout_s
        if not client.wait_for_service(timeout_sec=min(timeout_s, 30.0)):
            raise TimeoutError(f"no {client.srv_name} service: is the memory node running?")
        future = client.call_async(
            AskMemory.Request(question=question, max_new_tokens=max_new_tokens))
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(node)
        executor.spin_until_future_complete(future, timeout_sec=deadline - time.monotonic())
        if not future.done():
            raise TimeoutError(f"no answer within {timeout_s:.0f} s")
        return future.result()
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def format_response(response: AskMemory.Response) -> str:
    """Answer and evidence, as a person reads them."""
    if not response.success:
        return f"error: {response.error}"
    evidence = ", ".join(f"{t:.1f} s" for t in response.evidence_times) or "none"
    return (f"answer: {response.answer}\n"
            f"evidence (stream time): {evidence}\n"
            f"memory: {response.memory_tokens} tokens covering "
            f"{response.memory_span_start:.1f}-{response.memory_span_end:.1f} s; "
            f"answered in {response.latency_ms:.0f} ms")
