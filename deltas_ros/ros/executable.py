"""`ros2 run deltas_ros memory_node`: the memory node (node.py) spun by a multi-threaded
executor, with a clean exit on SIGINT/SIGTERM at any moment: 0, or 1 when autostart could not
configure or activate it (the reason is logged).

Signals: rclpy's handler (installed by rclpy.init, removed when its context shuts down) ends the
spin by shutting the context down, and then calls the Python handler beneath it, `_on_signal`,
which only records; once the exit is under way both are ignored. Nothing raises
KeyboardInterrupt: one raised during the exit (after the `shutdown` transition or a first
signal, when rclpy's handler is already gone) escaped and ended the process by SIGINT (rc -2),
and SIGTERM's default action killed it (rc -15).
"""

from __future__ import annotations

import os
import signal
import sys

import rclpy
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor

from ..core.config import NODE_NAME
from ..runtime.resources import limit_malloc_arenas
from .node import EXECUTOR_THREADS, SHUTDOWN_S, MemoryNode

_signalled: list[int] = []


def _on_signal(signum: int, frame: object) -> None:
    """SIGINT and SIGTERM beneath rclpy's handler, and before or after it: recorded only.
    Before rclpy.init, main acts on the record; afterwards rclpy's handler has shut the context
    down (the spin ends) or the exit is already under way, which is what the signal asks for."""
    _signalled.append(signum)


def main(args: list[str] | None = None) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    limit_malloc_arenas()  # before rclpy's and our threads: cleanup then gives the model back
    rclpy.init(args=args)
    # Before the node: a signal during start-up shuts the context down, after which no executor
    # can be made (it once failed with "the given context is not valid").
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    if _signalled:  # before rclpy.init had its handler in place
        return _close(executor, 0)
    try:
        node = MemoryNode()
    except (ValueError, OSError, RuntimeError) as error:  # RCLError is a RuntimeError
        if not rclpy.ok():  # a signal while constructing: the context is gone, not an error
            return _close(executor, 0)
        rclpy.logging.get_logger(NODE_NAME).fatal(f"cannot start: {error}")
        return _close(executor, 1)
    try:
        executor.add_node(node)
        executor.spin()
    except ExternalShutdownException:
        pass
    except RuntimeError:  # RCLError: a signal shut the context down inside rclpy's wait
        if rclpy.ok():
            raise
    finally:
        ended = node.stop()  # first: service callbacks waiting for the worker return now
        executor.shutdown(timeout_sec=SHUTDOWN_S)
        node.destroy_node()
        rclpy.try_shutdown()  # also removes rclpy's handlers, back to `_on_signal`
        _ignore_signals()
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
    _ignore_signals()
    return code


def _ignore_signals() -> None:
    """The exit is under way: SIGINT and SIGTERM are ignored from here on. `_on_signal` would
    do as well until Python's finalization, which puts a handler set from Python back to the
    default action (a signal then ended the process with rc -2 or -15) but leaves an ignored
    signal ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
