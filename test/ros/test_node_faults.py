"""The node in this process, so that a test can hold its model load or make a chunk run out of
memory; the tester still talks to it over DDS, from its own context.

test_node.py starts the node as its own process, as launch does; these faults need a hand inside.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import rclpy
from deltas_ros.action import AskMemory as AskAction
from deltas_ros.srv import MemoryFile
from diagnostic_msgs.msg import DiagnosticStatus
from engine_helpers import fail_on_call, wait_until
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.parameter import Parameter
from ros_helpers import SMALL, Tester, send_goal, set_parameter, status_values, wait_future
from std_srvs.srv import Trigger
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from deltas_ros.ros import lifecycle
from deltas_ros.ros import node as node_module
from deltas_ros.ros.lifecycle_state import lifecycle_state
from deltas_ros.ros.node import EXECUTOR_THREADS, FINALIZED, NOT_READY, QUESTION_SLOTS, MemoryNode
from deltas_ros.runtime import health
from deltas_ros.runtime import session as session_module
from deltas_ros.runtime.session import NOT_ACTIVE, NOT_CONFIGURED


@contextmanager
def node_in_process(model_dir: Path, **overrides: str) -> Iterator[MemoryNode]:
    """MemoryNode spun by a MultiThreadedExecutor on a thread, as `main` spins it."""
    context = rclpy.Context()
    rclpy.init(context=context)
    values = {"model_path": str(model_dir), "reliable_qos": True, "max_new_tokens": 4,
              "memory_dir": str(model_dir.parent / "memory")} | {
        key: typed(key, value) for key, value in (SMALL | overrides).items()}
    node = MemoryNode(context=context,
                      parameter_overrides=[Parameter(k, value=v) for k, v in values.items()])
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS, context=context)
    executor.add_node(node)

    def spin() -> None:
        try:
            executor.spin()
        except ExternalShutdownException:
            pass

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield node
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        thread.join(5)


def typed(name: str, text: str):
    """A command-line parameter value as its parameter's type ("false" is False)."""
    from deltas_ros.runtime.params import PARAMS

    kind = type(next(p.default for p in PARAMS if p.name == name))
    return text.lower() == "true" if kind is bool else kind(text)


def wait_ready(tester: Tester, node: MemoryNode) -> None:
    """The model is loaded and the camera matched both ways (discovery is asymmetric): frames
    sent before the node's subscription has matched the tester's publisher are lost."""
    assert wait_until(lambda: node.session is not None and node.session.active
                      and tester.camera.get_subscription_count() > 0
                      and node.camera.subscription.get_publisher_count() > 0)


def statuses(tester: Tester) -> list[tuple[int, str]]:
    with tester.lock:
        return [(m.status[0].level, m.status[0].message) for m in tester.diagnostics]


def test_services_answer_not_ready_while_the_model_loads(tiny_model_dir, ros_env, monkeypatch):
    """From the node's first instant: also before autostart's configure has a session (held
    here; a suite run under load once asked in that instant and heard "configure it first")."""
    configure, release = threading.Event(), threading.Event()
    real_configure, real_load = session_module.Session.configure, session_module.load_model

    def held_configure(values):
        configure.wait(60)
        return real_configure(values)

    def slow_load(*args, **kwargs):
        release.wait(60)  # a 9B model takes a while to load
        return real_load(*args, **kwargs)

    monkeypatch.setattr(session_module.Session, "configure", staticmethod(held_configure))
    monkeypatch.setattr(session_module, "load_model", slow_load)
    tester = Tester()
    try:
        with node_in_process(tiny_model_dir) as node:
            assert wait_until(lambda: tester.ask_client.service_is_ready())
            assert node.session is None
            assert tester.ask("what do you see?").error == NOT_READY
            assert wait_until(lambda: statuses(tester))
            assert statuses(tester)[-1] == (DiagnosticStatus.WARN, "loading the model")
            configure.set()
            assert wait_until(lambda: node.session is not None)
            assert tester.ask("what do you see?").error == NOT_READY
            assert tester.call(tester.reset_client, Trigger.Request()).message == NOT_READY
            save = tester.node.create_client(MemoryFile, "/deltas_memory/save_memory")
            assert wait_until(save.service_is_ready)
            assert tester.call(save, MemoryFile.Request()).message == NOT_READY
            assert wait_until(lambda: statuses(tester))
            assert statuses(tester)[-1] == (DiagnosticStatus.WARN, "loading the model")

            release.set()
            assert wait_until(lambda: not tester.ask(" ").error.startswith("not ready"))
            answer = tester.ask("what do you see?", timeout=120)
            assert answer.success, answer.error
    finally:
        configure.set()
        release.set()
        tester.close()


def test_a_chunk_that_runs_out_of_memory_turns_diagnostics_error_and_the_node_goes_on(
        tiny_model_dir, ros_env, monkeypatch):
    monkeypatch.setattr(health, "ERROR_HOLD_S", 2.0)  # 10 s on a robot
    tester = Tester()
    try:
        with node_in_process(tiny_model_dir, silence_warn_s="30.0") as node:
            wait_ready(tester, node)
            calls = fail_on_call(monkeypatch, Qwen3_5VisionModel, "forward", 3)  # chunk 2
            tester.stream(5.0)
            tester.wait_for(lambda: len(tester.drift) >= 4, timeout=120)
            assert calls[:3] == [1, 2, 3]
            assert [m.chunk_index for m in tester.drift][:4] == [0, 1, 3, 4]
            assert node.session.worker.counters.chunks_failed == 1
            assert wait_until(lambda: any(level == DiagnosticStatus.ERROR for level, _ in
                                   statuses(tester)))
            error = next(m for lvl, m in statuses(tester) if lvl == DiagnosticStatus.ERROR)
            assert "chunk 2 failed" in error and "out of memory" in error
            # Still serving, and the ERROR clears once the hold has passed.
            assert tester.ask("what do you see?", timeout=120).success
            assert wait_until(lambda: statuses(tester)[-1][0] == DiagnosticStatus.OK)
            _, values = tester.last_status()
            assert values["chunks_failed"] == "1"
    finally:
        tester.close()


def test_questions_asked_together_are_answered_before_waiting_chunks(tiny_model_dir, ros_env):
    """Planners' questions must not alternate with a backlog of video: each would wait a whole
    chunk forward per question ahead of it (on a 9B model ~0.1 s each; here 1 s)."""
    tester = Tester()
    log: list[str] = []
    try:
        with node_in_process(tiny_model_dir, queue_chunks="8") as node:
            wait_ready(tester, node)
            memory, worker = node.session.memory, node.session.worker
            add_chunk, ask = memory.add_chunk, memory.ask

            def slow_chunk(*args, **kwargs):
                time.sleep(1.0)  # a big model: the stream runs ahead and chunks wait
                log.append("chunk")
                return add_chunk(*args, **kwargs)

            def logged_ask(*args, **kwargs):
                log.append("ask")
                return ask(*args, **kwargs)

            memory.add_chunk, memory.ask = slow_chunk, logged_ask
            tester.stream(6.0, speed=2.0)  # six chunks in 3 s
            assert wait_until(lambda: worker.queue_depth >= 2)
            answers = []
            planners = [threading.Thread(target=lambda: answers.append(
                tester.ask("what do you see?", timeout=120))) for _ in range(QUESTION_SLOTS)]
            for planner in planners:
                planner.start()
            for planner in planners:
                planner.join(120)
            assert len(answers) == QUESTION_SLOTS and all(a.success for a in answers)
            first = log.index("ask")
            # The chunks that were waiting come after the questions. (Not "all six chunks":
            # on a busy machine the in-process camera burst can lose frames, and so chunks.)
            assert wait_until(lambda: "chunk" in log[first + QUESTION_SLOTS:], timeout_s=120)
    finally:
        tester.close()
    assert log[first:first + QUESTION_SLOTS] == ["ask"] * QUESTION_SLOTS, log


def test_a_callback_that_raises_answers_a_failure_and_the_next_request_is_served(
        tiny_model_dir, ros_env, monkeypatch):
    """Each service, the action and the parameter service, with an exception injected inside
    its callback: a failed reply naming it (counted), never an exception into the executor,
    which would end the process and the memory with it."""
    tester = Tester()
    try:
        with node_in_process(tiny_model_dir) as node:
            wait_ready(tester, node)
            session = node.session
            save = tester.node.create_client(MemoryFile, "/deltas_memory/save_memory")
            load = tester.node.create_client(MemoryFile, "/deltas_memory/load_memory")
            goal = AskAction.Goal(question="what do you see?", max_new_tokens=2)

            def calls() -> list:
                """One request of each kind; their replies (the action's: its result)."""
                handle = send_goal(tester.action, goal)
                result = wait_future(handle.get_result_async(), 120).result \
                    if handle.accepted else None
                return [tester.ask("what do you see?"),
                        tester.call(tester.reset_client, Trigger.Request()),
                        tester.call(save, MemoryFile.Request(path="a.safetensors")),
                        tester.call(load, MemoryFile.Request(path="a.safetensors")),
                        result, set_parameter(tester, "max_new_tokens", 3)]

            def injected(*args, **kwargs):
                raise KeyError("injected")

            for owner in (session, session.worker, node_module.params):
                name = {session: "question_refusal", session.worker: "call"}.get(owner,
                                                                                 "validate")
                monkeypatch.setattr(owner, name, injected)
            failed = calls()
            monkeypatch.undo()
            assert all(reply is not None and not reply.success for reply in failed[:5])
            assert all("failed inside the node: KeyError" in reply.message
                       for reply in failed[:5]), [r.message for r in failed[:5]]
            assert not failed[5].successful and "KeyError" in failed[5].reason

            served = calls()
            assert all(reply.success for reply in served[:5]), [r.message for r in served]
            assert served[5].successful and node.values["max_new_tokens"] == 3
            assert node.requests_failed == 6
            tester.wait_for_status(lambda s: status_values(s).get("requests_failed") == "6")
    finally:
        tester.close()


def test_after_shutdown_requests_hear_finalized_and_the_process_leaves(tiny_model_dir, ros_env,
                                                                       monkeypatch):
    monkeypatch.setattr(lifecycle, "EXIT_DELAY_S", 5.0)  # a window wide enough to ask
    tester = Tester()
    try:
        with node_in_process(tiny_model_dir) as node:
            wait_ready(tester, node)
            assert tester.transition("shutdown") and tester.lifecycle_state() == "finalized"
            assert tester.ask("what do you see?").error == FINALIZED
            assert wait_until(lambda: not node.context.ok(), 30)  # spin ends: main returns 0
    finally:
        tester.close()


def test_serving_and_the_answers_without_a_session_follow_rclpys_state(tiny_model_dir, ros_env):
    """The node keeps no lifecycle flags of its own: driven by its own triggers (no manager),
    the session serves exactly while rclpy's state is active, and a request without a session
    hears what the state says. SIGINT's `stopping` ends serving without a transition."""
    context = rclpy.Context()
    rclpy.init(context=context)
    values = {"model_path": str(tiny_model_dir), "autostart": False,
              "memory_dir": str(tiny_model_dir.parent / "memory")} | {
        key: typed(key, value) for key, value in SMALL.items()}
    node = MemoryNode(context=context,
                      parameter_overrides=[Parameter(k, value=v) for k, v in values.items()])
    try:
        assert node.no_session() == NOT_CONFIGURED and not node.autostarting()
        assert node.trigger_configure() == lifecycle.SUCCESS
        session = node.session
        assert session.ready and not session.active
        assert session.question_refusal("what do you see?", 0) == NOT_ACTIVE
        node.trigger_activate()
        assert session.active and session.serving_questions
        node.trigger_deactivate()
        assert lifecycle_state(node) == "inactive" and not session.serving_questions
        node.trigger_activate()
        node.stopping.set()  # what SIGINT does first; rclpy's state stays active
        assert lifecycle_state(node) == "active" and not session.serving_questions
        node.stopping.clear()
        assert node.trigger_shutdown() == lifecycle.SUCCESS
        assert node.session is None and node.no_session() == FINALIZED
        assert node.threads_ended()
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_cleanup_lets_go_of_the_memory_and_the_model(tiny_model_dir, ros_env):
    """Configured, streamed, asked, then cleanup: nothing refers to the session, the memory,
    the model, a weight or the tokenizer any more (weak references die), in a first cycle and
    in one configured again after it. What a cycle leaves in RSS is bench.cleanup_memory's."""
    tester = Tester()
    try:
        with node_in_process(tiny_model_dir) as node:
            for _ in range(2):
                wait_ready(tester, node)
                tester.stream(2.0, fps=10.0)
                tester.wait_for(lambda: len(tester.drift) >= 1)
                assert tester.ask("what did you see?").success
                memory = node.session.memory
                objects = {"session": node.session, "memory": memory, "model": memory.model,
                           "weight": next(memory.model.parameters()),
                           "tokenizer": memory.tokenizer}
                refs = {name: weakref.ref(value) for name, value in objects.items()}
                del memory, objects
                assert tester.transition("deactivate") and tester.transition("cleanup")
                gc.collect()
                assert [name for name, ref in refs.items() if ref() is not None] == []
                assert tester.transition("configure") and tester.transition("activate")
                with tester.lock:
                    tester.drift.clear()
    finally:
        tester.close()
