"""Every default in one place: how a camera stream becomes chunks (StreamConfig) and what the
memory holds and how it chooses (MemoryConfig); the question rules and the memory's errors.

The node's parameter table, the command line, offline runs, training, the policies' signatures
and config/deltas.yaml take their defaults from here (test/core/test_config.py changes one and
watches it spread). Plain Python, no torch: the frame gate and the command line read it cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# The retention signals a memory can rank tokens by (policy.make_policy builds each one).
POLICY_NAMES = ("deltas", "recency", "uniform", "random", "value_norm", "key_norm",
                "write_strength", "surprise", "deltas_surprise", "infinipot_v", "streammem",
                "beta_error", "pixel_difference")
# Pixels per frame after resizing (aspect kept): 320x320 gives ~100 tokens per 2-frame chunk.
DEFAULT_PIXEL_BUDGET = 320 * 320
# The weights' types a model can be loaded in ("auto": bf16 on CUDA, float32 on CPU).
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The memory node's name, and its full name when started without a namespace (the default of
# every client: ask, dashboard, benchmarks).
NODE_NAME = "deltas_memory"
DEFAULT_NODE = f"/{NODE_NAME}"
# How long a question may wait: the node's ask_timeout_s, the ask client's and the dashboard's.
ASK_TIMEOUT_S = 120.0


class ChunkFailed(RuntimeError):
    """A chunk could not be ingested; the memory was rolled back to its state before it."""


class QuestionFailed(RuntimeError):
    """A question could not be answered; the memory was left as it was before it."""


@dataclass(frozen=True)
class StreamConfig:
    """How camera frames become chunks (defaults: the paper's 2 fps, 1-second chunks).

    Every field but tolerance_s is a node parameter of the same name, described once in the
    node's parameter table (runtime/params.py). tolerance_s: how early a frame may come and
    still fill its sampling slot (stamp jitter).
    """

    fps: float = 2.0
    frames_per_chunk: int = 2
    max_gap_s: float = 10.0
    tolerance_s: float = 0.005
    timeline_confirm_s: float = 1.0
    queue_chunks: int = 8
    pose_max_gap_s: float = 0.5


@dataclass
class MemoryConfig:
    """How much the memory holds and how it chooses.

    Budget, sinks, window and buckets default to the paper's; the policy to `surprise`, the
    per-token state signal, which kept the most of every state-based policy in the busy-world
    evaluation (`deltas` is the paper's per-chunk DeltaS). The fields that are node parameters
    of the same name are described once, in the node's parameter table (runtime/params.py);
    pixel_budget is the resolved one (the node's 0 becomes the model's stored budget).

    compact_margin: positions kept free below max_position_embeddings for questions and their
    answers; positions are compacted when a chunk would reach into them.
    max_question_tokens, max_answer_tokens: a question longer than this many tokens, or asking
    for a longer answer, is refused before anything changes (bounded work per request).
    host_budget_mb, disk_budget_mb, tier_dir: the second tier (core/tiers.py): the slots an
    eviction lets go wait in host memory up to host_budget_mb, then in files under tier_dir up
    to disk_budget_mb (0 and 0: no second tier, evicted is gone).
    recall_tokens: a question calls back at most this many tokens of tiered chunks, those its
    queries score highest (0: no recall; the answer is as without a second tier).
    """

    budget_tokens: int = 8192
    sink_tokens: int = 4
    window_tokens: int = 1024
    buckets: int = 4
    policy: str = "surprise"
    seed: int = 0
    pixel_budget: int = DEFAULT_PIXEL_BUDGET
    max_new_tokens: int = 64
    evidence_chunks: int = 3
    evidence_candidates: int = 4
    compact_margin: int = 4096
    max_question_tokens: int = 2048
    max_answer_tokens: int = 4096
    max_question_s: float = 60.0
    thinking: bool = False
    host_budget_mb: float = 0.0
    disk_budget_mb: float = 0.0
    tier_dir: str = ""
    recall_tokens: int = 0

    def __post_init__(self) -> None:
        if self.budget_tokens < self.sink_tokens + self.window_tokens:
            raise ValueError(
                f"budget_tokens ({self.budget_tokens}) must be at least sink_tokens + "
                f"window_tokens ({self.sink_tokens} + {self.window_tokens})"
            )
        if self.buckets < 1 or min(self.sink_tokens, self.window_tokens) < 0:
            raise ValueError("buckets must be >= 1, sink_tokens and window_tokens >= 0")
        if self.compact_margin < 0:
            raise ValueError(f"compact_margin must be >= 0, got {self.compact_margin}")
        if min(self.max_question_tokens, self.max_answer_tokens) < 1:
            raise ValueError("max_question_tokens and max_answer_tokens must be >= 1")
        if not 1 <= self.max_new_tokens <= self.max_answer_tokens:
            raise ValueError(f"max_new_tokens must be in [1, max_answer_tokens "
                             f"({self.max_answer_tokens})], got {self.max_new_tokens}")
        if self.evidence_chunks < 1 or self.evidence_candidates < 0:
            raise ValueError("evidence_chunks must be >= 1 and evidence_candidates >= 0")
        if not (math.isfinite(self.max_question_s) and self.max_question_s > 0):
            raise ValueError(f"max_question_s must be > 0, got {self.max_question_s}")
        budgets = (self.host_budget_mb, self.disk_budget_mb)
        if not all(math.isfinite(b) and b >= 0 for b in budgets) or self.recall_tokens < 0:
            raise ValueError("host_budget_mb, disk_budget_mb and recall_tokens must be >= 0")
        if self.disk_budget_mb and not self.tier_dir:
            raise ValueError("disk_budget_mb needs tier_dir, the directory of the disk tier")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of "
                             f"{', '.join(POLICY_NAMES)}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> MemoryConfig:
        """The configuration from named values (the node's parameters, a command line's or a
        benchmark's options), the rest defaults; a name that is no field is refused, so a
        misspelt setting cannot pass silently."""
        unknown = sorted(set(values) - {field.name for field in fields(cls)})
        if unknown:
            raise ValueError(f"not MemoryConfig fields: {', '.join(unknown)}")
        return cls(**values)


def question_problem(question: str, max_chars: int | None = None, wire: bool = False) -> str:
    """Why a question is refused, or "" when it is fine.

    wire: the question came in a ROS message. A string that was not valid UTF-8 on the wire
    reaches Python with U+FFFD in place of the bad bytes (rclpy decodes with "replace");
    answering a mangled question would hide the client's bug, so it is refused. (From Python, a
    U+FFFD is just a character.)
    """
    if not question.strip():
        return "the question is empty"
    if max_chars is not None and len(question) > max_chars:
        return f"the question has {len(question)} characters; the limit is {max_chars}"
    if wire and "\ufffd" in question:
        return ("the question contains U+FFFD: it was not valid UTF-8 when sent (or carried a "
                "replacement character)")
    return ""
