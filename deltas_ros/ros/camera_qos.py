"""The camera subscription's QoS overrides, read from rclpy's QoS override parameters
(`qos_overrides.<topic>.subscription.<policy>`) declared on the memory node."""

from __future__ import annotations

from typing import Any

from rcl_interfaces.msg import ParameterDescriptor
from rclpy.node import Node
from rclpy.qos import HistoryPolicy

HISTORIES = {"keep_last": HistoryPolicy.KEEP_LAST, "keep_all": HistoryPolicy.KEEP_ALL}


def reliability_override(node: Node, topic: str) -> str | None:
    """The camera subscription's reliability from rclpy's QoS override parameter
    `qos_overrides.<topic>.subscription.reliability` ("reliable" or "best_effort"); None when
    not given (follow the publisher). Declared with an empty default rather than the first
    choice, which would pin it and stop the subscription following the camera. ValueError for
    another value."""
    value = _qos_override(node, topic, "reliability", "", "reliable or best_effort (empty: "
                          "follow the camera's publisher; reliable_qos:=true is an alias of "
                          "reliable)")
    if value not in ("", "reliable", "best_effort"):
        raise ValueError(f"qos_overrides.{topic}.subscription.reliability must be reliable or "
                         f"best_effort, got {value!r}")
    return value or None


def history_override(node: Node, topic: str, depth: int) -> tuple[HistoryPolicy, int]:
    """(history, depth) of the camera subscription from rclpy's QoS override parameters
    `qos_overrides.<topic>.subscription.history` / `.depth` (defaults keep_last, `depth`), as
    QoSOverridingOptions names them; declared on `node`, the memory node, since the
    subscription itself lives on the camera's own node. ValueError for a bad value."""
    history = _qos_override(node, topic, "history", "keep_last", "keep_last or keep_all")
    depth_value = _qos_override(node, topic, "depth", depth, "messages held for the callback")
    if history not in HISTORIES:
        raise ValueError(f"qos_overrides.{topic}.subscription.history must be keep_last or "
                         f"keep_all, got {history!r}")
    if not isinstance(depth_value, int) or depth_value < 1:
        raise ValueError(f"qos_overrides.{topic}.subscription.depth must be an integer >= 1, "
                         f"got {depth_value!r}")
    return HISTORIES[history], depth_value


def _qos_override(node: Node, topic: str, policy: str, default: Any, description: str) -> Any:
    name = f"qos_overrides.{topic}.subscription.{policy}"
    if node.has_parameter(name):  # activated before
        return node.get_parameter(name).value
    descriptor = ParameterDescriptor(read_only=True, description=description)
    return node.declare_parameter(name, default, descriptor).value

