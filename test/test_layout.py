"""Which module may import what (README "Architecture"), read from the source without importing.

Everything but the ROS side and the command line (which hands `replay` and `ask` to the ROS
side) imports without ROS, so `pip install .` gives a working core; the node's modules never
import the tools; only the backend reaches into transformers' Qwen3.5 modelling code.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "deltas_ros"
# The ROS side: rclpy and generated interfaces allowed.
ROS_SIDE = {"node", "memory_node", "ros_adapters", "ask_action", "memory_services", "ros_memory",
            "replay", "ask_client"}
# Tools: command line, generators, offline runs, plots, the tiny-model maker, training.
TOOLS = {"cli", "synth", "bag", "offline", "plot", "maker", "train", "questions"}
NODE = {"node", "memory_node", "ros_adapters", "ask_action", "memory_services", "ros_memory"}
ROS_PACKAGES = ("rclpy", "rcl_interfaces", "builtin_interfaces", "std_msgs", "std_srvs",
                "sensor_msgs", "diagnostic_msgs", "rosgraph_msgs", "geometry_msgs", "nav_msgs",
                "lifecycle_msgs", "action_msgs")


def imports(module: str) -> set[str]:
    """Absolute names a module imports (relative ones as deltas_ros.<name>), at any depth."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = f"deltas_ros.{base}" if base else "deltas_ros"
                if not node.module:  # from . import x
                    names |= {f"deltas_ros.{alias.name}" for alias in node.names}
                    continue
            names.add(base)
    return names


def modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def ours(names: set[str]) -> set[str]:
    return {n.split(".")[1] for n in names if n.startswith("deltas_ros.") and n.count(".") >= 1}


def test_the_listed_modules_exist():
    assert (ROS_SIDE | TOOLS) <= set(modules())


def test_the_core_never_imports_ros():
    for module in set(modules()) - ROS_SIDE - {"cli"}:
        found = imports(module)
        ros = {n for n in found if n.split(".")[0] in ROS_PACKAGES
               or n.startswith(("deltas_ros.msg", "deltas_ros.srv", "deltas_ros.action"))}
        assert not ros, f"{module} imports {ros}: the core must import without ROS"
        assert not ours(found) & ROS_SIDE, f"{module} imports the ROS side"


def reachable(module: str) -> set[str]:
    """Our modules that importing `module` loads, through any chain of imports (generated
    interfaces, msg/srv/action, are no source modules and are left out)."""
    sources, seen, todo = set(modules()), set(), [module]
    while todo:  # bounded: each module is expanded once
        for name in (ours(imports(todo.pop())) & sources) - seen:
            seen.add(name)
            todo.append(name)
    return seen


def test_the_node_never_imports_the_tools():
    """Not even through the core: the model loader once re-exported the tiny-model maker."""
    for module in NODE:
        assert not reachable(module) & TOOLS, f"{module} reaches {reachable(module) & TOOLS}"


def test_only_the_backend_reaches_into_qwen3_5_modelling():
    users = {m for m in modules()
             if any(n.startswith("transformers.models") for n in imports(m))}
    assert users == {"backend"}


def test_only_the_backend_loader_and_maker_name_transformers():
    """An upgrade of transformers can only break these three (README "Architecture")."""
    users = {m for m in modules() if "transformers" in (PACKAGE / f"{m}.py").read_text()}
    assert users == {"backend", "model", "maker"}
