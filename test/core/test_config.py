"""One home for every default: core/config.py (MemoryConfig, StreamConfig). A default changed
there reaches the node's parameter table, the command line, offline runs, training and the
policies' signatures, and the check of config/deltas.yaml notices; no other module writes one."""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from deltas_ros.core.config import MemoryConfig, StreamConfig

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "deltas_ros"

# The defaults the engine, the node, the tools and training share, and the other names they go
# by in signatures and options.
SHARED = {
    "budget_tokens", "budget", "sink_tokens", "sinks", "window_tokens", "window", "buckets",
    "policy", "max_new_tokens", "evidence_chunks", "evidence_candidates", "max_question_s",
    "fps", "frames_per_chunk", "max_gap_s", "tolerance_s", "timeline_confirm_s", "confirm_s",
    "queue_chunks", "pose_max_gap_s",
}
# A camera's frame rate, not the sampling rate: the generated bags are recorded at 30 fps.
CAMERA_RATE = {("training/synth.py", "fps"), ("tools/cli.py", "--fps:30.0")}
# "Not given" markers, which defer to the config: the node's default, the model's budget.
UNSET = (None, 0, "")

PROBE = """
import inspect, json, sys
from deltas_ros.core.frames import FrameSampler
from deltas_ros.core.plan import PlanInputs
from deltas_ros.core.policy import EvictionLimits
from deltas_ros.runtime import params
from deltas_ros.runtime.worker import MemoryWorker
from deltas_ros.tools import offline
from deltas_ros.tools.cli import build_parser
from deltas_ros.training import samples

def default(function, name):
    return inspect.signature(function).parameters[name].default

parser = build_parser()
commands = parser._subparsers._group_actions[0].choices
print(json.dumps({
    "params": params.defaults(),
    "run_help": commands["run"].format_help(),
    "plan_help": commands["plan"].format_help(),
    "limits_sinks": default(EvictionLimits, "sinks"),
    "limits_buckets": default(EvictionLimits, "buckets"),
    "sampler": default(FrameSampler, "fps"),
    "run_stream": default(offline.run_stream, "fps"),
    "run_file": default(offline.run_file, "max_gap_s"),
    "plan": PlanInputs().budget_tokens,
    "worker": default(MemoryWorker, "queue_chunks"),
    "training_fps": samples.FPS,
}))
"""


def changed_package(tmp_path: Path, edits: dict[str, str]) -> Path:
    """A copy of the package's Python files with core/config.py's defaults edited."""
    copy = tmp_path / "deltas_ros"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns(
        "models", "msg", "srv", "action", "*.so", "*.c", "__pycache__"))
    config = copy / "core" / "config.py"
    text = config.read_text()
    for old, new in edits.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    config.write_text(text)
    return tmp_path


def test_a_default_changed_in_the_config_reaches_every_reader(tmp_path):
    root = changed_package(tmp_path, {
        "budget_tokens: int = 8192": "budget_tokens: int = 5000",
        "sink_tokens: int = 4": "sink_tokens: int = 6",
        "buckets: int = 4": "buckets: int = 5",
        "fps: float = 2.0": "fps: float = 3.0",
        "max_gap_s: float = 10.0": "max_gap_s: float = 12.5",
        "queue_chunks: int = 8": "queue_chunks: int = 9",
    })
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True,
                           text=True, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                           timeout=120)
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout)
    assert seen["params"]["budget_tokens"] == 5000 and seen["params"]["fps"] == 3.0
    assert seen["params"]["sink_tokens"] == 6 and seen["params"]["queue_chunks"] == 9
    assert "default: 5000" in seen["run_help"] and "default: 3.0" in seen["run_help"]
    assert "default: [5000]" in seen["plan_help"]
    assert (seen["limits_sinks"], seen["limits_buckets"], seen["sampler"]) == (6, 5, 3.0)
    assert (seen["run_stream"], seen["run_file"], seen["plan"]) == (3.0, 12.5, 5000)
    assert (seen["worker"], seen["training_fps"]) == (9, 3.0)
    # The YAML check (test_params) compares config/deltas.yaml with the table: it would fail.
    listed = yaml.safe_load((REPO / "config" / "deltas.yaml").read_text())
    assert listed["/**"]["ros__parameters"] != seen["params"]


def test_the_yaml_and_the_parameter_table_hold_the_configs_defaults():
    listed = yaml.safe_load((REPO / "config" / "deltas.yaml").read_text())["/**"]
    values = listed["ros__parameters"]
    for config in (MemoryConfig(), StreamConfig()):
        for name, value in vars(config).items():
            if name in values and name != "pixel_budget":  # the node's 0: the model's own
                assert values[name] == value, name


def literal_defaults(path: Path) -> list[tuple[str, object]]:
    """(name, value) of every literal default a module writes for a function's parameter, a
    dataclass field, a node parameter or a command-line option."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [(a.arg, d.value) for a, d in pairs if isinstance(d, ast.Constant)]
        elif isinstance(node, ast.ClassDef):
            found += [(n.target.id, n.value.value) for n in node.body
                      if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                      and isinstance(n.value, ast.Constant)]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Param" \
                and isinstance(node.args[1], ast.Constant):  # the node's parameter table
            found.append((node.args[0].value, node.args[1].value))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if isinstance(default, ast.Constant) and node.args:
                option = node.args[0].value
                found.append((f"{option}:{default.value}", default.value))
    return found


def test_no_other_module_writes_a_shared_default():
    written = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module in ("core/config.py", "training/config.py"):  # training's own run keys
            continue
        for name, value in literal_defaults(path):
            key = name.split(":")[0].lstrip("-").replace("-", "_")
            if key in SHARED and value not in UNSET and (module, name) not in CAMERA_RATE \
                    and (module, key) not in CAMERA_RATE:
                written.append(f"{module}: {name} = {value!r}")
    assert not written, "defaults written outside core/config.py: " + "; ".join(written)
