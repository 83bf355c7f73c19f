"""The managed node's lifecycle state as rclpy holds it, and transitions it refuses answered
as ERROR instead of raised into the executor."""

from __future__ import annotations

from rclpy.impl.implementation_singleton import rclpy_implementation
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.node import Node


def lifecycle_state(node: Node) -> str:
    """The managed node's current lifecycle state label ("unconfigured", "configuring",
    "inactive", "active", "finalized", ...), as rclpy's state machine holds it: rclpy has no
    public getter, and ~/get_state is a service the node would have to call on itself
    (test_lifecycle pins this name). The label is the state being entered while its
    transition callback runs ("configuring" during on_configure, "activating" ...) and the
    goal state once the callback has returned.

    Thread-safe (executor threads, the autostart thread, main at exit): rclpy's binding reads
    the state, and its transitions change it, with the GIL held (src/rclpy/lifecycle.cpp
    releases it in neither); it stays readable after destroy_node."""
    return node._state_machine.current_state[1]


class RefusedTransitions:
    """Mixed in before rclpy's LifecycleNodeMixin: a transition the state machine does not allow
    in the current state (a ChangeState by id, as nav2's manager sends; autostart's configure
    after a manager's) fails with ERROR and a log line. Kilted's rclpy does that itself;
    Jazzy's (7.x) raises RCLError instead, out of the ChangeState service callback, which took
    the node's executor down. Overrides the mixin's private __change_state by its mangled name
    (test_lifecycle pins it)."""

    def _LifecycleNodeMixin__change_state(self, transition_id: int) -> TransitionCallbackReturn:
        try:
            return super()._LifecycleNodeMixin__change_state(transition_id)
        except rclpy_implementation.RCLError as error:
            self.get_logger().error(f"lifecycle transition {transition_id} refused in state "
                                    f"{lifecycle_state(self)}: {error}")
            return TransitionCallbackReturn.ERROR
