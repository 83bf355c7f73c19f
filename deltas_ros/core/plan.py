"""What a model, a budget M and a pixel budget take in memory, and whether that fits a device.

    plan = make_plan(read_config("/models/Qwen3.5-9B"), PlanInputs(budget_tokens=8192),
                     torch.device("cuda"), torch.bfloat16)
    plan.fits, plan.peak_bytes, plan.summary()

Why: a robot has one fixed memory (8 or 16 GB on a Jetson), and a model, budget and pixel
budget that do not fit fail at the first chunk or question, minutes after start-up. Every
term below is computed from the config's dimensions (the weights by a parameter count on the
meta device: nothing is loaded), one function per term, so that a change in how the memory
spends bytes changes one function:

- weights: parameters x the dtype's bytes (tied embeddings once);
- KV cache: for each full-attention layer, K and V of kv_heads x head_dim per token, in the
  model's dtype (keys are cached after rotary, so nothing else is kept per token); M tokens;
- linear-attention states: per Gated DeltaNet layer a recurrent state of value_heads x key_dim x
  value_dim, always float32, and a conv state of (2 key_heads key_dim + value_heads value_dim)
  x kernel in the model's dtype;
- snapshot: the backend holds the states in three-row buffers (live, the drift's scratch, the
  snapshot a chunk or a question rolls back to): two more copies, allocated once;
- the largest of three transient peaks, each above the resident terms: a chunk's forward
  (`chunk_forward_bytes`), a question and its answer (`question_bytes`), and the evidence search
  after the answer (`evidence_search_bytes`);
- with the second tier's recall (`recall_tokens`), a question's full-attention layers see M +
  recall_tokens slots: the question and the evidence search are planned over that view, and
  the view itself (`recall_bytes`: every layer's cache joined with the recalled K/V while the
  cached originals are kept, and the recalled K/V moved to the device) adds to both.

- the host tier (`host_budget_mb`) where host and device share one memory: on the CPU, and on
  an integrated GPU such as a Jetson's (`shares_host_memory`); a discrete GPU's plan leaves it
  out (it lives in host RAM). With it, the key summaries of every chunk both tiers hold
  (`disk_budget_mb` too: a disk chunk's summary stays in memory for recall), outside both
  budgets.

The plan leaves out what the process holds before the model (interpreter, libraries: measured
about 0.75 GB on CPU with torch imported) and the CUDA context: they are already in use when
`available_bytes` reads the device, and not in what is left.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .chunks import ChunkBuilder
from .config import DEFAULT_PIXEL_BUDGET, MemoryConfig, StreamConfig
from .evidence_forward import (
    EVIDENCE_BATCH_BYTES,
    GATE_PASS_BYTES,
    evidence_batch_bytes,
    evidence_rows,
    gate_pass_bytes,
)
from .kv_ops import EVIDENCE_SLICE_ELEMENTS
from .loader import Qwen3_5Config, parameter_count, read_config, resolve_device, resolve_dtype
from .recall import REPRESENTATIVES

# Text tokens of a chunk besides its video tokens: "<123.4 seconds>" (Qwen's tokenizer splits
# digits: about 8 tokens) and <|vision_start|>, <|vision_end|>.
CHUNK_TEXT_TOKENS = 10
# A question as the model reads it (the turn's closing and opening text around ~40 words).
QUESTION_TOKENS = 64
DEFAULT_FRAME = (480, 640)  # (height, width) of a VGA camera: 88 video tokens at 320x320


@dataclass(frozen=True)
class PlanInputs:
    """What the node is asked to run: M, the pixel budget, the camera's frame size, the
    sampling, and the question and evidence sizes (defaults: the node's)."""

    budget_tokens: int = MemoryConfig.budget_tokens
    pixel_budget: int = DEFAULT_PIXEL_BUDGET
    frame: tuple[int, int] = DEFAULT_FRAME
    fps: float = StreamConfig.fps
    frames_per_chunk: int = StreamConfig.frames_per_chunk
    question_tokens: int = QUESTION_TOKENS
    answer_tokens: int = MemoryConfig.max_new_tokens
    evidence_candidates: int = MemoryConfig.evidence_candidates
    recall_tokens: int = 0
    host_tier_bytes: int = 0  # the second tier's host budget (counted where memory is shared)
    disk_tier_bytes: int = 0  # its disk budget (whose chunks' key summaries stay in memory)

    @property
    def view_tokens(self) -> int:
        """Slots a question's full-attention layers see: M and the recalled ones."""
        return self.budget_tokens + self.recall_tokens


@dataclass(frozen=True)
class Shape:
    """The dimensions a plan reads from a Qwen3.5 config."""

    parameters: int
    full_layers: int
    linear_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int

    @classmethod
    def of(cls, config: Qwen3_5Config) -> Shape:
        text, vision = config.text_config, config.vision_config
        kinds = text.layer_types
        return cls(
            parameters=parameter_count(config),
            full_layers=kinds.count("full_attention"),
            linear_layers=kinds.count("linear_attention"),
            heads=text.num_attention_heads, kv_heads=text.num_key_value_heads,
            head_dim=text.head_dim, hidden=text.hidden_size,
            intermediate=text.intermediate_size, vocab=text.vocab_size,
            key_heads=text.linear_num_key_heads, value_heads=text.linear_num_value_heads,
            key_dim=text.linear_key_head_dim, value_dim=text.linear_value_head_dim,
            conv_kernel=text.linear_conv_kernel_dim,
            vision_hidden=vision.hidden_size, vision_intermediate=vision.intermediate_size,
            vision_heads=vision.num_heads,
        )

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class Plan:
    """Bytes of each term, the resident and peak totals, and the verdict on one device."""

    device: str
    dtype: str
    budget_tokens: int
    pixel_budget: int
    parameters: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes: int
    state_bytes: int
    conv_state_bytes: int
    snapshot_bytes: int
    chunk_forward_bytes: int
    question_bytes: int
    evidence_bytes: int
    recall_tokens: int
    recall_bytes: int
    host_tier_bytes: int
    tier_summary_bytes: int
    resident_bytes: int
    peak_bytes: int
    tokens_per_chunk: int
    video_tokens_per_chunk: int
    stream_seconds: float
    available_bytes: int
    fits: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """The plan as a few lines a user reads before starting the node."""
        rows = [
            ("weights", self.weights_bytes,
             f"{self.parameters / 1e9:.2f} B parameters, {self.dtype}"),
            ("KV cache", self.kv_bytes,
             f"M = {self.budget_tokens} x {self.kv_bytes_per_token / 1024:.0f} KiB per token"),
            ("linear-attention states", self.state_bytes, "recurrent, float32"),
            ("conv states", self.conv_state_bytes, self.dtype),
            ("snapshot + drift scratch", self.snapshot_bytes, "two more state copies"),
            ("chunk forward (peak)", self.chunk_forward_bytes,
             f"{self.tokens_per_chunk} tokens per chunk"),
            ("question (peak)", self.question_bytes, "question and answer"),
            ("evidence search (peak)", self.evidence_bytes, "batched rows, no K/V copy"),
        ]
        if self.recall_tokens:
            rows.append(("recall view (in both)", self.recall_bytes,
                         f"M + {self.recall_tokens} recalled tokens, in the two above"))
        if self.host_tier_bytes:
            rows.append(("host tier", self.host_tier_bytes,
                         "host_budget_mb: this device shares the host's memory"))
        if self.tier_summary_bytes:
            rows.append(("tier key summaries", self.tier_summary_bytes,
                         "one per chunk both tiers hold, kept in memory for recall"))
        lines = [f"{name:<26}{mib(size):>12}  {note}" for name, size, note in rows]
        verdict = "fits" if self.fits else "does NOT fit"
        lines += [f"{'peak':<26}{mib(self.peak_bytes):>12}  resident "
                  f"{mib(self.resident_bytes)} + the largest transient",
                  f"{'available':<26}{mib(self.available_bytes):>12}  on {self.device}: "
                  f"{verdict}",
                  f"M holds {self.stream_seconds:.0f} s of stream "
                  f"({self.video_tokens_per_chunk} video tokens per chunk at "
                  f"{self.pixel_budget} pixels per frame)"]
        return "\n".join(lines)


def markdown_table(plans: list[tuple[str, Plan]]) -> str:
    """(name, plan) pairs as one Markdown table, e.g. every released size at two budgets."""
    rows = ["| model | parameters | M | weights | KV cache | states | snapshot | largest "
            "transient | peak | stream M holds | fits |", "|---" * 11 + "|"]
    for name, plan in plans:
        transient = max(("chunk", plan.chunk_forward_bytes), ("question", plan.question_bytes),
                        ("evidence", plan.evidence_bytes), key=lambda item: item[1])
        rows.append(
            f"| {name} | {plan.parameters / 1e9:.2f} B | {plan.budget_tokens} | "
            f"{gib(plan.weights_bytes)} | {mib(plan.kv_bytes)} | "
            f"{mib(plan.state_bytes + plan.conv_state_bytes)} | {mib(plan.snapshot_bytes)} | "
            f"{mib(transient[1])} ({transient[0]}) | {gib(plan.peak_bytes)} | "
            f"{plan.stream_seconds / 60:.1f} min | "
            f"{'yes' if plan.fits else 'no'} ({gib(plan.available_bytes)}) |")
    return "\n".join(rows)


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


def kv_bytes_per_token(shape: Shape, dtype_bytes: int) -> int:
    """K and V of every full-attention layer for one token."""
    return shape.full_layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes


def state_bytes(shape: Shape) -> int:
    """The recurrent states of every Gated DeltaNet layer (float32 whatever the model's dtype)."""
    return shape.linear_layers * shape.value_heads * shape.key_dim * shape.value_dim * 4


def conv_state_bytes(shape: Shape, dtype_bytes: int) -> int:
    """The short-convolution states of every Gated DeltaNet layer (the model's dtype)."""
    return shape.linear_layers * shape.conv_channels * shape.conv_kernel * dtype_bytes


def chunk_tokens(config: Qwen3_5Config, inputs: PlanInputs) -> tuple[int, int]:
    """(all tokens, video tokens) of one chunk of `inputs.frame`-sized frames: the same resize
    the chunk builder makes, one timestamp text per temporal group."""
    vision = config.vision_config
    builder = ChunkBuilder(None, config.video_token_id, config.vision_start_token_id,
                           config.vision_end_token_id, patch_size=vision.patch_size,
                           merge_size=vision.spatial_merge_size,
                           temporal_patch_size=vision.temporal_patch_size,
                           pixel_budget=inputs.pixel_budget)
    groups = inputs.frames_per_chunk // vision.temporal_patch_size
    video = groups * builder.tokens_per_group(*inputs.frame)
    return video + groups * CHUNK_TEXT_TOKENS, video


def growing_cache_bytes(shape: Shape, tokens: int, new: int, dtype_bytes: int) -> int:
    """A forward of `new` tokens over a cache of `tokens`: the new tokens' K/V, and the copy the
    cache's torch.cat makes of one layer's K (or V) while the old one still lives."""
    per_token = kv_bytes_per_token(shape, dtype_bytes)
    return new * per_token + (tokens + new) * per_token // (2 * shape.full_layers)


def attention_bytes(shape: Shape, tokens: int, new: int, dtype_bytes: int) -> int:
    """One full-attention layer's inputs beyond the cache: the K/V repeated to every query head
    (the masked GQA path copies them) and the boolean mask of `new` queries."""
    total = tokens + new
    repeated = 2 * shape.heads * total * shape.head_dim * dtype_bytes
    return (repeated if shape.heads > shape.kv_heads else 0) + new * total


def layer_bytes(shape: Shape, new: int, dtype_bytes: int) -> int:
    """The widest layer's working set for `new` tokens: the residual stream, plus the larger of
    the MLP's three intermediate-wide tensors and the chunked gated delta rule's float32 copies
    of q, k, v (padded to its 64-token chunks, each several times)."""
    padded = math.ceil(new / 64) * 64
    residual = 4 * new * shape.hidden * dtype_bytes
    mlp = 3 * new * shape.intermediate * dtype_bytes
    delta = 8 * padded * shape.value_heads * (shape.key_dim + shape.value_dim) * 4
    return residual + max(mlp, delta)


def vision_bytes(shape: Shape, patches: int, dtype_bytes: int) -> int:
    """The vision tower on one chunk's patches: the widest block (qkv, MLP) and one float32
    attention map per head (the attention of a frame group is over all its patches)."""
    block = patches * (6 * shape.vision_hidden + shape.vision_intermediate) * dtype_bytes
    return block + shape.vision_heads * patches * patches * 4


def chunk_forward_bytes(shape: Shape, inputs: PlanInputs, tokens: int, patches: int,
                        dtype_bytes: int) -> int:
    """Above the resident terms while one chunk of `tokens` is prefilled over a full cache (M
    tokens: the chunk is evicted only after its forward)."""
    m = inputs.budget_tokens
    return (growing_cache_bytes(shape, m, tokens, dtype_bytes)
            + attention_bytes(shape, m, tokens, dtype_bytes)
            + max(layer_bytes(shape, tokens, dtype_bytes),
                  vision_bytes(shape, patches, dtype_bytes)))


def recall_bytes(shape: Shape, inputs: PlanInputs, dtype_bytes: int) -> int:
    """The question's view with recalled slots (0 without recall): each full-attention layer's
    K/V joined with the recalled ones into new tensors of M + recall_tokens while the cached
    originals stay, and the recalled K/V moved to the device (backend.appended_slots)."""
    if not inputs.recall_tokens:
        return 0
    return (inputs.view_tokens + inputs.recall_tokens) * kv_bytes_per_token(shape, dtype_bytes)


def question_bytes(shape: Shape, inputs: PlanInputs, dtype_bytes: int) -> int:
    """Above the resident terms while a question is prefilled and answered over its view (M
    and any recalled slots): the question and answer's K/V, its attention, and the evidence's
    attention mass of the question's queries on every slot (float32 logits, softmax and
    weights, in slices of EVIDENCE_SLICE_ELEMENTS)."""
    m, new = inputs.view_tokens, inputs.question_tokens + inputs.answer_tokens
    logits = min(EVIDENCE_SLICE_ELEMENTS, shape.heads * inputs.question_tokens * (m + new))
    return (growing_cache_bytes(shape, m, new, dtype_bytes)
            + attention_bytes(shape, m, inputs.question_tokens, dtype_bytes)
            + layer_bytes(shape, inputs.question_tokens, dtype_bytes)
            + 3 * 4 * logits)


def evidence_search_bytes(config: Qwen3_5Config, inputs: PlanInputs, dtype: torch.dtype,
                          device: torch.device) -> int:
    """Above the resident terms while the evidence search runs on `device` (0 without
    candidates).

    First one forward and backward of the question and the answer over the question's view (M
    and any recalled slots) estimates every chunk's drop (`gate_pass_bytes`). Then the
    candidates are rows of batched teacher-forced forwards over the view as it is, each row
    hiding one chunk by the attention mask (one more row hides none): no K/V copy per
    candidate. As many rows go into one forward as `evidence_batch_bytes` keeps within
    EVIDENCE_BATCH_BYTES (at least one). The two never overlap: the larger is the peak. An
    estimate beyond GATE_PASS_BYTES (a long answer) is not run: the attention ranks instead.
    """
    if not inputs.evidence_candidates:
        return 0
    text, m = config.text_config, inputs.view_tokens
    new = inputs.question_tokens + inputs.answer_tokens
    rows = evidence_rows(EVIDENCE_BATCH_BYTES, text, m, new, inputs.answer_tokens, dtype,
                         inputs.evidence_candidates + 1)
    estimate = gate_pass_bytes(text, m, new, inputs.answer_tokens, dtype, device.type)
    return max(evidence_batch_bytes(text, rows, m, new, inputs.answer_tokens, dtype),
               estimate if estimate <= GATE_PASS_BYTES else 0)


def available_bytes(device: torch.device) -> int:
    """Memory a model could still take on `device`: CUDA's free memory, or on the CPU the
    kernel's MemAvailable (what can be allocated without swapping)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the available memory (/proc/meminfo has no MemAvailable)")


def tier_summary_bytes(shape: Shape, inputs: PlanInputs, tokens_per_chunk: int,
                       dtype_bytes: int) -> int:
    """The key summaries (recall.key_summary: REPRESENTATIVES float32 keys per KV head of the
    first full-attention layer) of as many whole chunks as both tiers' budgets hold."""
    tiered = inputs.host_tier_bytes + inputs.disk_tier_bytes
    if not tiered:
        return 0
    chunks = math.ceil(tiered / (tokens_per_chunk * kv_bytes_per_token(shape, dtype_bytes)))
    return chunks * shape.kv_heads * REPRESENTATIVES * shape.head_dim * 4


def shares_host_memory(device: torch.device) -> bool:
    """Whether `device`'s memory is the host's: the CPU, or an integrated GPU (a Jetson). A
    CUDA device this machine does not have (a plan for another machine) counts as discrete."""
    if device.type != "cuda":
        return True
    return torch.cuda.is_available() and bool(
        torch.cuda.get_device_properties(device).is_integrated)


def make_plan(config: Qwen3_5Config, inputs: PlanInputs, device: torch.device,
              dtype: torch.dtype, available: int | None = None) -> Plan:
    """The plan of `config` (a Qwen3.5 config) for `inputs` on `device` in `dtype`; `available`
    replaces the device's free memory (`available_bytes`), e.g. to plan for another machine."""
    shape = Shape.of(config)
    size = torch.empty((), dtype=dtype).element_size()
    tokens, video = chunk_tokens(config, inputs)
    patches = video * config.vision_config.spatial_merge_size ** 2
    per_token = kv_bytes_per_token(shape, size)
    states, conv = state_bytes(shape), conv_state_bytes(shape, size)
    weights = shape.parameters * size
    shared = shares_host_memory(device)
    host_tier = inputs.host_tier_bytes if shared else 0
    summaries = tier_summary_bytes(shape, inputs, tokens, size) if shared else 0
    resident = (weights + inputs.budget_tokens * per_token + 3 * (states + conv) + host_tier
                + summaries)
    chunk = chunk_forward_bytes(shape, inputs, tokens, patches, size)
    view = recall_bytes(shape, inputs, size)
    question = question_bytes(shape, inputs, size) + view
    evidence = evidence_search_bytes(config, inputs, dtype, device) + view
    peak = resident + max(chunk, question, evidence)
    free = available_bytes(device) if available is None else available
    seconds_per_chunk = inputs.frames_per_chunk / inputs.fps
    return Plan(
        device=str(device), dtype=str(dtype).removeprefix("torch."),
        budget_tokens=inputs.budget_tokens, pixel_budget=inputs.pixel_budget,
        parameters=shape.parameters, weights_bytes=weights, kv_bytes_per_token=per_token,
        kv_bytes=inputs.budget_tokens * per_token, state_bytes=states, conv_state_bytes=conv,
        snapshot_bytes=2 * (states + conv), chunk_forward_bytes=chunk, question_bytes=question,
        evidence_bytes=evidence, recall_tokens=inputs.recall_tokens, recall_bytes=view,
        host_tier_bytes=host_tier, tier_summary_bytes=summaries, resident_bytes=resident,
        peak_bytes=peak, tokens_per_chunk=tokens, video_tokens_per_chunk=video,
        stream_seconds=inputs.budget_tokens / tokens * seconds_per_chunk,
        available_bytes=free, fits=peak <= free,
    )


def plan_for_path(path: str | Path, inputs: PlanInputs, device: torch.device,
                  dtype: torch.dtype, available: int | None = None) -> Plan:
    """`make_plan` for a model directory or a config.json-style file."""
    return make_plan(read_config(path), inputs, device, dtype, available)


def require_fit(path: str | Path, config: MemoryConfig, device: str, dtype: str,
                fps: float = StreamConfig.fps,
                frames_per_chunk: int = StreamConfig.frames_per_chunk) -> Plan:
    """The plan of the model at `path` with the memory `config` on `device` ("auto", "cpu",
    "cuda:N") in `dtype` ("auto", ...), or RuntimeError with its figures when its peak exceeds
    what the device has left: the node refuses such a configuration before loading anything,
    instead of failing at the first chunk or question."""
    torch_device = resolve_device(device)
    inputs = PlanInputs(budget_tokens=config.budget_tokens, pixel_budget=config.pixel_budget,
                        fps=fps, frames_per_chunk=frames_per_chunk,
                        answer_tokens=config.max_new_tokens,
                        evidence_candidates=config.evidence_candidates,
                        # a question recalls only from a second tier
                        recall_tokens=(config.recall_tokens if config.host_budget_mb
                                       or config.disk_budget_mb else 0),
                        host_tier_bytes=int(config.host_budget_mb * 2**20),
                        disk_tier_bytes=int(config.disk_budget_mb * 2**20))
    plan = plan_for_path(path, inputs, torch_device, resolve_dtype(dtype, torch_device))
    if not plan.fits:
        raise RuntimeError(
            f"the model and memory do not fit on {plan.device}: they need "
            f"{mib(plan.peak_bytes)} at their peak and {mib(plan.available_bytes)} is "
            f"available (weights {mib(plan.weights_bytes)}, KV cache {mib(plan.kv_bytes)} "
            f"at M = {plan.budget_tokens}, states {mib(plan.state_bytes + plan.conv_state_bytes)}"
            f" and their snapshot {mib(plan.snapshot_bytes)}, largest transient "
            f"{mib(plan.peak_bytes - plan.resident_bytes)}); lower budget_tokens or "
            "pixel_budget, use a smaller model or dtype, or see `deltas-ros plan`")
    return plan
