"""Shared fixtures: a tiny random Qwen3.5 written once per session, and an isolated ROS domain."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-init Qwen3.5 saved to disk, loaded by tests through from_pretrained."""
    from deltas_ros.core.model_maker import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from deltas_ros.core.loader import load_model

    return load_model(tiny_model_dir, device="cpu")


# ROS domain ids that are safe on Linux (higher ids can collide with ephemeral ports).
DOMAIN_IDS = range(1, 102)


@pytest.fixture(scope="session")
def new_domain_id() -> Callable[[], str]:
    """Hands out a domain id no other test or module of this session has had (a run needs ~30).

    Random ids once collided: a test then saw frames of another test's replay on its own topic
    and signalled its replay before that had even started (rc -2, the CI flake of
    test_replay_stops_cleanly_on_sigint). Under pytest-xdist (scripts/test.sh runs two
    workers) worker k of n takes every n-th id from the k-th, so workers never share one. The
    start depends on the pid, so two suites run at once on one machine are unlikely to overlap.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ... (gw0 alone: no xdist)
    ids = DOMAIN_IDS[int(worker[2:])::int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))]
    order = itertools.count(os.getpid())
    return lambda: str(ids[next(order) % len(ids)])


@pytest.fixture
def ros_env(tmp_path, monkeypatch, new_domain_id) -> dict[str, str]:
    """Environment for ROS processes of one test: its own domain id, log dir, loopback only."""
    env = {
        "ROS_DOMAIN_ID": new_domain_id(),
        "ROS_LOG_DIR": str(tmp_path / "ros_log"),
        "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
        "FASTDDS_BUILTIN_TRANSPORTS": "LARGE_DATA",
        "PYTHONUNBUFFERED": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return dict(os.environ)


@pytest.fixture(scope="module")
def ros_domain(tmp_path_factory, new_domain_id) -> Iterator[dict[str, str]]:
    """Environment for one module's ROS processes, set in os.environ for in-process nodes too."""
    env = {"ROS_DOMAIN_ID": new_domain_id(),
           "ROS_LOG_DIR": str(tmp_path_factory.mktemp("ros_log")),
           "ROS_HOME": str(tmp_path_factory.mktemp("ros_home")),  # memory_dir's default
           "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
           "PYTHONUNBUFFERED": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield dict(os.environ)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# Markers, so a newcomer can run the millisecond unit tests alone:
#   scripts/test.sh -n 0 -m "not ros and not slow"
# CI runs everything. A test is `ros` when it talks to a ROS graph (its module uses rclpy or it
# takes a ROS environment fixture) and `slow` when it needs a model or starts processes.
MODEL_FIXTURES = {"tiny_model", "tiny_model_dir"}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = vars(item.module) if item.module else {}
        fixtures = set(item.fixturenames)
        if "rclpy" in module or any(name.startswith("ros_") for name in fixtures):
            item.add_marker(pytest.mark.ros)
        if fixtures & MODEL_FIXTURES or "subprocess" in module:
            item.add_marker(pytest.mark.slow)
