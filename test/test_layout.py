"""Which layer may import what (docs/architecture.md), read from the source without importing.

The folders are the layers: `core` (the engine), `runtime` (the node's state without ROS),
`ros` (the ROS 2 side), `tools` (the command line) and `training`. Imports run downward only:
ros -> runtime -> core, tools -> training -> core; tools reach the ROS side only through
`replay`, `ask_client` and `dashboard`. Everything but `ros` imports without ROS, so
`pip install .` gives a working core; only the backend and its kernel binding reach into
transformers' Qwen3.5 modelling code. Within a layer no two modules import each other, however
long the way round: an import inside a function or under `if TYPE_CHECKING:` counts, because a
circle hidden that way still ties the modules into one.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "deltas_ros"
LAYERS = {"core", "runtime", "ros", "tools", "training"}
# What each layer may import of this package besides itself.
ALLOWED = {
    "core": set(),
    "runtime": {"core"},
    "ros": {"runtime", "core"},
    "training": {"core"},
    "tools": {"training", "core", "ros.replay", "ros.ask_client", "ros.dashboard"},
}
GENERATED = ("deltas_ros.msg", "deltas_ros.srv", "deltas_ros.action")
ROS_PACKAGES = ("rclpy", "rcl_interfaces", "builtin_interfaces", "std_msgs", "std_srvs",
                "sensor_msgs", "diagnostic_msgs", "rosgraph_msgs", "geometry_msgs", "nav_msgs",
                "lifecycle_msgs", "action_msgs", "visualization_msgs")


def modules() -> list[str]:
    """Every source module as "layer.name"."""
    return sorted(f"{p.parent.name}.{p.stem}" for p in PACKAGE.glob("*/*.py")
                  if p.stem != "__init__")


def source(module: str) -> str:
    return (PACKAGE / f"{module.replace('.', '/')}.py").read_text()


def imports(module: str, text: str | None = None) -> set[str]:
    """Absolute names a module imports (its source, or `text` in its place), relative ones
    resolved, at any depth: in functions and under `if TYPE_CHECKING:` too."""
    layer = module.split(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source(module) if text is None else text)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = {0: "", 1: f"deltas_ros.{layer}", 2: "deltas_ros"}[node.level]
            name = ".".join(filter(None, [base, node.module or ""]))
            if node.module is None or name in {f"deltas_ros.{x}" for x in LAYERS}:
                names |= {f"{name}.{alias.name}" for alias in node.names}  # from . import x
            else:
                names.add(name)
    return names


def ours(names: set[str]) -> set[str]:
    """The source modules among `names`, as "layer.name" (generated interfaces left out)."""
    return {".".join(n.split(".")[1:3]) for n in names
            if n.startswith("deltas_ros.") and n.split(".")[1] in LAYERS}


def test_the_package_is_its_layers():
    top = {p.name for p in PACKAGE.iterdir() if p.name not in {"__pycache__", "models"}}
    assert top == {"__init__.py"} | LAYERS, top
    assert {m.split(".")[0] for m in modules()} == LAYERS


def test_imports_run_downward_only():
    for module in modules():
        layer = module.split(".")[0]
        for target in ours(imports(module)):
            if target.split(".")[0] == layer:
                continue
            allowed = ALLOWED[layer]
            assert target.split(".")[0] in allowed or target in allowed, \
                f"{module} imports {target}: {layer} may import only {sorted(allowed)}"


def test_only_the_ros_side_imports_ros():
    for module in (m for m in modules() if not m.startswith("ros.")):
        ros = {n for n in imports(module)
               if n.split(".")[0] in ROS_PACKAGES or n.startswith(GENERATED)}
        assert not ros, f"{module} imports {ros}: only the ROS side imports ROS"


def reachable(module: str) -> set[str]:
    """Our modules that importing `module` loads, through any chain of imports."""
    sources, seen, todo = set(modules()), set(), [module]
    while todo:  # bounded: each module is expanded once
        for name in (ours(imports(todo.pop())) & sources) - seen:
            seen.add(name)
            todo.append(name)
    return seen


def test_the_node_never_reaches_the_tools_or_training():
    """Not even through the core: the model loader must not re-export the tiny-model maker's
    training helpers."""
    for module in modules():
        if module.startswith("ros.") and module not in {"ros.replay", "ros.ask_client"}:
            found = {m for m in reachable(module) if m.split(".")[0] in {"tools", "training"}}
            assert not found, f"{module} reaches {found}"


def test_only_the_door_reaches_into_qwen3_5_modelling():
    """The backend and its kernel binding (core/backend.py's docstring lists the private names
    they use)."""
    users = {m for m in modules()
             if any(n.startswith("transformers.models") for n in imports(m))}
    assert users == {"core.backend", "core.kernels"}


def test_only_the_door_loader_maker_and_training_name_transformers():
    """An upgrade of transformers can only break these (docs/architecture.md)."""
    users = {m for m in modules() if "transformers" in source(m)}
    assert users == {"core.backend", "core.kernels", "core.evidence_forward", "core.loader",
                     "core.model_maker", "training.cache", "training.gated_delta",
                     "training.samples"}


def import_graph() -> dict[str, set[str]]:
    """Each source module -> the other source modules it imports."""
    sources = set(modules())
    return {m: (ours(imports(m)) & sources) - {m} for m in sources}


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle in `graph` as the path round it (first module again at the end), or []."""
    done: set[str] = set()

    def walk(path: list[str]) -> list[str]:
        for target in sorted(graph.get(path[-1], ())):
            if target in path:
                return path[path.index(target):] + [target]
            if target not in done and (found := walk(path + [target])):
                return found
        done.add(path[-1])
        return []

    return next((found for m in sorted(graph) if m not in done and (found := walk([m]))), [])


def test_no_import_circle_between_modules():
    found = circle(import_graph())
    assert not found, "import circle: " + " -> ".join(found)


def test_an_import_under_type_checking_closes_a_circle():
    hidden = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n"
              "    from .b import B\n")
    graph = {"core.a": ours(imports("core.a", hidden)), "core.b": {"core.a"}}
    assert circle(graph) == ["core.a", "core.b", "core.a"]
