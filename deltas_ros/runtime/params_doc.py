"""config/deltas.yaml and the table of docs/parameters.md, written from the node's parameter
table (runtime/params.py), so each parameter's default and description exist once.

    python -m deltas_ros.runtime.params_doc --yaml > config/deltas.yaml
    python -m deltas_ros.runtime.params_doc --markdown  # the table in docs/parameters.md

test_params.py fails when either file differs from what these functions write.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .params import PARAMS, Param

YAML_HEAD = """\
# Parameters of the deltas_memory node, written from deltas_ros/runtime/params.py by
# `python -m deltas_ros.runtime.params_doc --yaml` (edit the descriptions and defaults there).
# `/**` applies them whatever the node's name or namespace.
/**:
  ros__parameters:
"""
TABLE_BEGIN = "<!-- written by `python -m deltas_ros.runtime.params_doc --markdown` -->"
TABLE_END = "<!-- end of the written table -->"


def yaml_value(value: Any) -> str:
    """A default as YAML reads it back with its type: true, 2.0, 8, "text"."""
    return json.dumps(value)


def render_yaml() -> str:
    """The parameters file: every parameter at its default, its description above it."""
    lines = [f"    # {p.description}{f' [{values(p)}]' if values(p) else ''}\n"
             f"    {p.name}: {yaml_value(p.default)}\n" for p in PARAMS]
    return YAML_HEAD + "".join(lines)


def markdown_default(value: Any) -> str:
    if isinstance(value, str):
        return f"`{value}`" if value else '""'
    return yaml_value(value)


def number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def values(param: Param) -> str:
    """What a parameter accepts beyond its type and the choices its description names: a range,
    and whether a running node takes a change (`ros2 param set`)."""
    parts = [f"{number(param.low)} to {number(param.high)}"] if param.low is not None else []
    parts += [] if param.read_only else ["changeable at run time"]
    return "; ".join(parts)


def render_markdown() -> str:
    """The table of docs/parameters.md, between its markers."""
    rows = [f"| `{p.name}` | {markdown_default(p.default)} | {values(p)} | "
            f"{p.description.replace('|', '/')} |" for p in PARAMS]
    head = ["| parameter | default | values | meaning |", "|---|---|---|---|"]
    return "\n".join([TABLE_BEGIN, *head, *rows, TABLE_END]) + "\n"


def written_table(document: str) -> str:
    """The table a document holds between the markers, markers included ("" without them)."""
    begin, end = document.find(TABLE_BEGIN), document.find(TABLE_END)
    if begin < 0 or end < begin:
        return ""
    return document[begin:end + len(TABLE_END)] + "\n"


def main(argv: list[str]) -> int:
    """--yaml: print the parameters file; --markdown: the page's table."""
    forms = {"--yaml": render_yaml, "--markdown": render_markdown}
    if len(argv) != 1 or argv[0] not in forms:
        print("usage: python -m deltas_ros.runtime.params_doc --yaml | --markdown",
              file=sys.stderr)
        return 2
    print(forms[argv[0]](), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
