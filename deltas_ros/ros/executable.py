"""`ros2 run deltas_ros memory_node`: the memory node (node.py) spun by a multi-threaded
executor, with a clean exit on SIGINT/SIGTERM at any moment: 0, or 1 when autostart could not
configure or activate it (the reason is logged)."""

from __future__ import annotations

import os
import sys

import rclpy
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor

from .node import EXECUTOR_THREADS, SHUTDOWN_S, MemoryNode


def main(args: list[str] | None = None) -> int:
    rclpy.init(args=args)
    # Before the node: a signal during start-up shuts the context down, after which no executor
    # can be made (it once failed with "the given context is not valid").
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    try:
        node = MemoryNode()
    except KeyboardInterrupt:  # Ctrl-C before the node was up (and before its threads)
        return _close(executor, 0)
    except (ValueError, OSError, RuntimeError) as error:  # RCLError is a RuntimeError
        if not rclpy.ok():  # SIGTERM while constructing: the context is gone, not an error
            return _close(executor, 0)
        rclpy.logging.get_logger("deltas_memory").fatal(f"cannot start: {error}")
        return _close(executor, 1)
    try:
        executor.add_node(node)
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except RuntimeError:  # RCLError: a signal shut the context down inside rclpy's wait
        if rclpy.ok():
            raise
    finally:
        ended = node.stop()  # first: service callbacks waiting for the worker return now
        executor.shutdown(timeout_sec=SHUTDOWN_S)
        node.destroy_node()
        rclpy.try_shutdown()
    code = 1 if node.failure and node.values["autostart"] else 0
    if not ended:
        # The model is still loading or answering inside torch: leaving the interpreter with
        # that thread running aborts in C++ ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _close(executor: MultiThreadedExecutor, code: int) -> int:
    """Leave before a node existed: the executor and the context, nothing else."""
    executor.shutdown(timeout_sec=0.0)
    rclpy.try_shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
