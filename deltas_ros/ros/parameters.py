"""The node's parameters declared on rclpy: params.PARAMS with descriptions, ranges and
choices, and a refused override said in one line."""

from __future__ import annotations

from typing import Any

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.exceptions import InvalidParameterTypeException, ParameterException
from rclpy.node import Node

from ..runtime import params


def declare_parameters(node: Node) -> dict[str, Any]:
    """Declare params.PARAMS on `node` with descriptions and ranges; their values.

    ValueError "<parameter>: <reason>" for an override rclpy refuses (a value out of range, of
    another type), instead of rclpy's exception, so the node can say it in one line."""
    for param in params.PARAMS:
        descriptor = ParameterDescriptor(description=param.description,
                                         read_only=param.read_only)
        if isinstance(param.default, float) and param.low is not None:
            descriptor.floating_point_range = [
                FloatingPointRange(from_value=param.low, to_value=param.high)]
        elif isinstance(param.default, int) and not isinstance(param.default, bool) \
                and param.low is not None:
            descriptor.integer_range = [
                IntegerRange(from_value=int(param.low), to_value=int(param.high))]
        if param.choices:
            descriptor.additional_constraints = "one of: " + ", ".join(param.choices)
        try:
            node.declare_parameter(param.name, param.default, descriptor)
        except ParameterException as error:
            wrong_type = isinstance(error, InvalidParameterTypeException)
            raise ValueError(f"{param.name}: {params.expectation(param, of_type=wrong_type)}"
                             + (", given another type" if wrong_type else "")) from None
    return {p.name: node.get_parameter(p.name).value for p in params.PARAMS}
