"""The node's parameters in one table: defaults, descriptions, ranges, and their validation.

The node declares every parameter from this table; the defaults it shares with the engine come
from core/config.py (MemoryConfig, StreamConfig). Each description is written here only:
config/deltas.yaml and the table in docs/parameters.md are generated from it
(runtime/params_doc.py; test_params.py checks both). `validate` refuses bad values with a
reason a user can act on. No rclpy here, so the rules are tested without a ROS graph.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..core.config import ASK_TIMEOUT_S, DTYPES, POLICY_NAMES, MemoryConfig, StreamConfig
from .files import memory_directory

DEVICES = ("auto", "cpu", "cuda")
MIN_PIXEL_BUDGET = 32 * 32
POSE_TYPES = ("odometry", "pose_stamped", "pose_with_covariance")
TIER_SUBDIR = "tiers"  # the disk tier's folder inside memory_dir
KINDS = {bool: "true or false", int: "an integer", float: "a decimal number (2.0, not 2)",
         str: "a string"}


@dataclass(frozen=True)
class Param:
    """One parameter. Ranges are inclusive; read_only ones take effect only at start-up."""

    name: str
    default: Any
    description: str
    read_only: bool = True
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()


PARAMS: tuple[Param, ...] = (
    Param("image_topic", "/camera/image_raw",
          "Camera topic: sensor_msgs/Image, or sensor_msgs/CompressedImage when compressed"),
    Param("compressed", False, "Subscribe to sensor_msgs/CompressedImage (JPEG/PNG)"),
    Param("reliable_qos", False,
          "true: always subscribe reliable. false: follow the camera's publisher (reliable if "
          "it is, else best effort as REP 2003 sensor data; best effort until one appears)"),
    Param("fps", StreamConfig.fps, "Frames sampled per second of stream time (by header stamp)",
          low=0.1, high=30.0),
    Param("frames_per_chunk", StreamConfig.frames_per_chunk,
          "Sampled frames per chunk (a multiple of the model's temporal patch, 2)",
          low=2, high=16),
    Param("pixel_budget", 0,
          "Pixels per frame after resizing (aspect kept); 320x320 gives ~100 tokens per chunk. "
          "0: the budget stored with the model (the shipped one's), else 320x320",
          low=0, high=4096 * 4096),
    Param("model_path", "",
          "Local directory of a Qwen3.5 model (never fetched from a hub); empty: the shipped "
          "scene model"),
    Param("autostart", True,
          "Walk the lifecycle to active at start-up (configure: load the model; activate: "
          "subscribe); false: stay unconfigured until a lifecycle manager drives it"),
    Param("device", "auto", "auto (CUDA if available), cpu, cuda or cuda:N"),
    Param("dtype", "auto", "auto (bf16 on CUDA, float32 on CPU), float32, bfloat16, float16",
          choices=DTYPES),
    Param("budget_tokens", MemoryConfig.budget_tokens,
          "KV cache budget M in tokens per full-attention layer",
          low=1, high=10_000_000),
    Param("sink_tokens", MemoryConfig.sink_tokens,
          "Attention-sink tokens always kept (stream start)", low=0,
          high=4096),
    Param("window_tokens", MemoryConfig.window_tokens, "Most recent tokens always kept", low=0,
          high=1_000_000),
    Param("buckets", MemoryConfig.buckets,
          "Equal stream-time spans sharing the rest of the budget", low=1,
          high=64),
    Param("policy", MemoryConfig.policy, "Retention signal: " + ", ".join(POLICY_NAMES),
          choices=POLICY_NAMES),
    Param("seed", MemoryConfig.seed, "Seed of the random policy", low=0, high=2**31 - 1),
    Param("max_new_tokens", MemoryConfig.max_new_tokens,
          "Longest answer in tokens (a request may ask for fewer)",
          read_only=False, low=1, high=4096),
    Param("thinking", MemoryConfig.thinking,
          "Let the model reason before it answers (the chat template's enable_thinking); the "
          "reasoning is returned apart from the answer, max_new_tokens bounds both"),
    Param("evidence_chunks", MemoryConfig.evidence_chunks,
          "Chunks reported as an answer's evidence", low=1, high=64),
    Param("evidence_candidates", MemoryConfig.evidence_candidates,
          "Chunks of largest estimated drop (one forward and backward for all) that are each "
          "left out once to find the ones the answer needs (a forward row each; 0: attention "
          "mass only)", low=0, high=1024),
    Param("queue_chunks", StreamConfig.queue_chunks,
          "Chunks waiting for the model at most; beyond it the oldest are dropped and counted",
          low=1, high=1000),
    Param("max_gap_s", StreamConfig.max_gap_s,
          "A forward stamp jump larger than this starts a new segment (memory kept)",
          low=0.5, high=86_400.0),
    Param("timeline_confirm_s", StreamConfig.timeline_confirm_s,
          "Arrival seconds a new camera timeline (stamps jumped back, or forward past max_gap_s) "
          "must keep coming, with no frame on the current one, before it is followed",
          low=0.1, high=60.0),
    Param("max_question_chars", 2000, "Longest question accepted", read_only=False, low=1,
          high=100_000),
    Param("max_question_s", MemoryConfig.max_question_s,
          "Longest a question may hold the model; then the answer so far, marked truncated",
          low=0.1, high=3600.0),
    Param("ask_timeout_s", ASK_TIMEOUT_S, "How long a question may wait for the worker",
          read_only=False, low=0.1, high=3600.0),
    Param("host_budget_mb", MemoryConfig.host_budget_mb,
          "Host memory (MB) for the second tier: chunks budget_tokens evicts wait there for a "
          "question to call them back (recall_tokens), so a long patrol keeps more than the "
          "GPU budget; on a Jetson it shares the GPU's memory (see deltas-ros plan). 0: no host "
          "tier. Off by default: on 5-minute streams recall adds 2 points (not significant) "
          "to the default policy, so it waits for the hour-long measurement",
          low=0.0, high=1_000_000.0),
    Param("disk_budget_mb", MemoryConfig.disk_budget_mb,
          "Disk (MB) for the second tier past host_budget_mb, as files in <memory_dir>/tiers: "
          "hours of evicted chunks kept at disk speed, the oldest lowest-scored dropped beyond "
          "it. 0: no disk tier (off by default: disk space and wear are the robot owner's call)",
          low=0.0, high=10_000_000.0),
    Param("recall_tokens", MemoryConfig.recall_tokens,
          "Tokens a question calls back from the second tier, of the tiered chunks its queries "
          "score highest; they add to the question's GPU peak (deltas-ros plan) and time "
          "(docs/performance.md). 0: no recall (off by default, with the host tier)",
          low=0, high=1_000_000),
    Param("memory_dir", "",
          "The only directory memory files are read from and written to "
          "(empty: $ROS_HOME/deltas_ros; created at start)"),
    Param("memory_file", "",
          "Default file name in memory_dir for ~/save_memory, ~/load_memory, autosave and "
          "load_on_start (empty: memory.safetensors)"),
    Param("memory_key_file", "",
          "File holding the key of memory files' keyed checksum, readable only by the node's "
          "user (empty: unkeyed sha256)"),
    Param("autosave_chunks", 0, "Save the memory every N chunks (0 = never)", read_only=False,
          low=0, high=10_000_000),
    Param("load_on_start", False,
          "Load memory_file at start-up if it exists, to continue where a previous run stopped"),
    Param("silence_warn_s", 3.0, "No camera frame for this long: diagnostics WARN",
          read_only=False, low=0.1, high=3600.0),
    Param("pose_topic", "",
          "Robot pose input tagging each chunk with where it was seen (empty: none)"),
    Param("pose_type", "odometry", "Message type on pose_topic: " + ", ".join(POSE_TYPES),
          choices=POSE_TYPES),
    Param("pose_max_gap_s", StreamConfig.pose_max_gap_s,
          "A chunk's pose is unknown when the nearest pose is farther than this from its stamp",
          low=0.001, high=60.0),
    Param("memory_image_thumbnails", 24,
          "Thumbnails on ~/memory_image, a timeline strip of the retained chunks", low=2,
          high=256),
)
BY_NAME = {p.name: p for p in PARAMS}
# The parameters that are MemoryConfig fields of the same name.
ENGINE_PARAMS = tuple(f.name for f in fields(MemoryConfig) if f.name in BY_NAME)


def defaults() -> dict[str, Any]:
    return {p.name: p.default for p in PARAMS}


def expectation(param: Param, of_type: bool = True) -> str:
    """What a value of `param` must be, as the start of a reason: "must be an integer within
    [1, 1e+07]"; of_type=False leaves the type out (the value has the right one)."""
    parts = [KINDS[type(param.default)]] if of_type else []
    if param.low is not None:
        parts.append(f"within [{param.low:g}, {param.high:g}]")
    if param.choices:
        parts.append(f"one of {', '.join(param.choices)}")
    return "must be " + " ".join(parts)


def validate(values: dict[str, Any]) -> str | None:
    """None if the values are usable together, else the reason they are not
    ("<parameter>: <reason>" for a value that is wrong on its own)."""
    for name, value in values.items():
        param = BY_NAME.get(name)
        if param is None:
            continue
        if type(value) is not type(param.default):
            return f"{name}: {expectation(param)}, got {value!r}"
        if param.low is not None and not param.low <= value <= param.high \
                or param.choices and value not in param.choices:
            return f"{name}: {expectation(param, of_type=False)}, got {value!r}"
    merged = defaults() | values
    if 0 < merged["pixel_budget"] < MIN_PIXEL_BUDGET:
        return f"pixel_budget must be 0 (the model's) or at least {MIN_PIXEL_BUDGET}, got " \
            f"{merged['pixel_budget']}"
    device = merged["device"]
    if device not in DEVICES and not (device.startswith("cuda:") and device[5:].isdigit()):
        return f"device must be auto, cpu, cuda or cuda:N, got {device!r}"
    if merged["frames_per_chunk"] % 2:
        return f"frames_per_chunk must be even (2 frames per temporal patch), got " \
            f"{merged['frames_per_chunk']}"
    if not merged["image_topic"]:
        return "image_topic must not be empty"
    try:
        memory_config(merged)
    except ValueError as error:
        return str(error)
    return None


def resolved(values: dict[str, Any]) -> dict[str, Any]:
    """The values with an empty model_path made the shipped model's directory."""
    from ..core.loader import resolve_model_path  # torch: only where a model is meant

    return values | {"model_path": str(resolve_model_path(values.get("model_path")))}


def memory_config(values: dict[str, Any]) -> MemoryConfig:
    """The engine's configuration from parameter values (raises ValueError if inconsistent)."""
    from ..core.loader import resolve_pixel_budget

    pixel_budget = resolve_pixel_budget(values["pixel_budget"], values["model_path"])
    return MemoryConfig.from_mapping({name: values[name] for name in ENGINE_PARAMS}
                                     | {"pixel_budget": pixel_budget,
                                        "tier_dir": str(tier_dir(values["memory_dir"]))})


def tier_dir(memory_dir: str) -> Path:
    """The disk tier's directory: inside the one directory the node writes memory files to
    (runtime/files.py), so a disk budget needs no path of its own."""
    return memory_directory(memory_dir) / TIER_SUBDIR


class Parameters:
    """The node's current parameter values, the one copy the node and its session share: a
    dict replaced whole on a change, so a reader that takes `values` once sees one version."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
