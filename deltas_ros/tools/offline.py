"""Offline runs: a bag or a video file fed straight into the memory, with no ROS graph.

The engine path is the node's: every frame goes through a FrameGate (sampling by header stamp,
decoding only the frames it samples), a stamp jumping back resets the memory, and each completed
chunk goes to `StreamingMemory.add_sampled`. The node makes the same calls on its worker thread
(runtime/session.py queues them in order); here they are made inline, and the node's save before
a jump-back reset is left out (an offline run writes no memory files). So an offline run of a
bag gives the chunks, stream times and drift the node publishes when the bag is replayed to it.

    source = open_source("run.bag")                  # or "run.mp4": stamps = index / fps
    summary = run_file(memory, source, "results.jsonl", questions=["What fell over?"])

Results are JSON lines (one "meta", one "chunk" per chunk, one "summary" record) or, for a
`.csv` output, a CSV of the chunks between a `# meta {...}` first line and a `# summary {...}`
last line. `read_results` reads both. No rclpy here.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import cv2
import numpy as np
from tqdm import tqdm

from ..core.config import StreamConfig
from ..core.decode import FrameError, decode_message, message_stamp
from ..core.frames import FrameGate, FrameSampler, TimeEvent
from ..core.results import DriftRecord
from .bag import image_topics, load_events, message_count, read_images

if TYPE_CHECKING:  # the memory (torch, the model) is not needed to read or plot results
    from ..core.memory import StreamingMemory

log = logging.getLogger(__name__)

FALLBACK_VIDEO_FPS = 30.0

# A frame as read from disk: its stamp in seconds and a callable that decodes it to RGB (called
# only for frames the sampler wants, and only before the next frame is read).
Frame = tuple[float, Callable[[], np.ndarray]]


# ----------------------------------------------------------------------------- sources
@dataclass
class FrameSource:
    """A camera stream on disk, checked and ready to read once."""

    kind: str  # "bag" or "video"
    path: Path
    frames: Iterator[Frame]
    topic: str | None = None  # a bag's image topic
    video_fps: float | None = None  # a video's frame rate: its stamps are index / video_fps
    total_frames: int | None = None  # as the container reports it (progress only)
    events: list[dict] | None = None  # known events (a synth bag's events.json)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "topic": self.topic,
                "video_fps": self.video_fps, "total_frames": self.total_frames}


def open_source(path: str | Path, topic: str | None = None) -> FrameSource:
    """A bag directory or a video file, checked before any frame is read.

    Raises FileNotFoundError for a missing path, ValueError (naming the path) for a directory that
    is not a readable bag or a file OpenCV cannot read frames from.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such bag or video: {path}")
    if path.is_dir():
        topic = _bag_topic(path, topic)
        return FrameSource("bag", path, _bag_frames(path, topic), topic=topic,
                           total_frames=message_count(path, topic), events=load_events(path))
    if topic is not None:
        raise ValueError(f"--topic applies to bags only; {path} is a video file")
    capture, fps = _open_video(path)
    count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    return FrameSource("video", path, _video_frames(capture, fps), video_fps=fps,
                       total_frames=count if count > 0 else None)


def _bag_topic(path: str | Path, topic: str | None) -> str:
    """The topic to read: the given one, or the bag's only image topic (like the node, one)."""
    if topic is not None:
        read_images(path, [topic])  # checks that it is one of the bag's image topics
        return topic
    topics = sorted(image_topics(path))
    if not topics:
        raise ValueError(f"no Image or CompressedImage topic in bag {path}")
    if len(topics) > 1:
        raise ValueError(f"bag {path} has several image topics {topics}: choose one with --topic")
    return topics[0]


def _bag_frames(path: str | Path, topic: str) -> Iterator[Frame]:
    for image in read_images(path, [topic]):
        yield message_stamp(image.message), lambda msg=image.message: decode_message(msg)


def _open_video(path: Path) -> tuple[cv2.VideoCapture, float]:
    """An opened capture positioned on its first frame (grabbed, so an unreadable file fails
    here), and its frame rate (30 with a warning where the container gives none)."""
    if not path.is_file():
        raise FileNotFoundError(f"no such video file: {path}")
    capture = cv2.VideoCapture(str(path))
    if not capture.isOpened():
        raise ValueError(f"not a rosbag2 directory or a video OpenCV can read: {path}")
    if not capture.grab():
        capture.release()
        raise ValueError(f"cannot read any frame of video {path}: corrupt or empty")
    fps = capture.get(cv2.CAP_PROP_FPS)
    if not (math.isfinite(fps) and fps > 0):
        log.warning("video %s reports no frame rate; assuming %g fps", path, FALLBACK_VIDEO_FPS)
        fps = FALLBACK_VIDEO_FPS
    return capture, fps


def _video_frames(capture: cv2.VideoCapture, fps: float) -> Iterator[Frame]:
    """Every frame is grabbed (cheap: demuxing); only called decoders retrieve (decode) one."""

    def retrieve(index: int) -> np.ndarray:
        ok, bgr = capture.retrieve()
        if not ok or bgr is None:
            raise FrameError(f"cannot decode video frame {index}")
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)

    try:
        index, grabbed = 0, True  # _open_video grabbed the first frame
        while grabbed:
            yield index / fps, lambda index=index: retrieve(index)
            index += 1
            grabbed = capture.grab()
    finally:
        capture.release()


# ----------------------------------------------------------------------------- running
CHUNK_FIELDS = tuple(f.name for f in fields(DriftRecord))
INT_FIELDS = {"chunk_index", "chunk_tokens", "kv_tokens", "evicted_tokens"}


@dataclass
class RunSummary:
    """What a run did, and what the memory still holds at its end."""

    frames: int = 0
    sampled: int = 0
    bad_frames: int = 0
    bad_frame_reasons: dict[str, int] = field(default_factory=dict)
    dropped_frames: int = 0  # sampled into a chunk that a time jump or gap cut short
    chunks: int = 0
    resets: int = 0  # stamps jumped back: a new stream, the memory reset
    time_gaps: int = 0
    wall_s: float = 0.0
    kv_tokens: int = 0
    retained_chunks: list[int] = field(default_factory=list)  # memory chunk indices
    retained_times: list[float] = field(default_factory=list)  # their stream times
    retained_tokens: list[int] = field(default_factory=list)  # their slots still cached
    records: list[DriftRecord] = field(default_factory=list)


def run_stream(
    memory: StreamingMemory,
    source: Iterable[Frame],
    fps: float = StreamConfig.fps,
    frames_per_chunk: int = StreamConfig.frames_per_chunk,
    max_gap_s: float = StreamConfig.max_gap_s,
    on_chunk: Callable[[DriftRecord], None] | None = None,
) -> RunSummary:
    """Feed frames to the memory exactly as the node does, as fast as the model goes."""
    sampler = FrameSampler(fps, frames_per_chunk, max_gap_s)
    gate = FrameGate(sampler)
    summary = RunSummary()
    reasons: Counter[str] = Counter()
    start = time.perf_counter()
    for stamp, decode in source:
        summary.frames += 1
        outcome = gate.push(stamp, decode)
        if outcome.event is TimeEvent.JUMP_BACK:
            memory.reset()
            summary.resets += 1
        if outcome.error:
            reasons[outcome.error] += 1
        for chunk in outcome.chunks:
            result = memory.add_sampled(chunk)
            record = DriftRecord.from_result(chunk, result)
            summary.records.append(record)
            if on_chunk is not None:
                on_chunk(record)
    summary.wall_s = time.perf_counter() - start
    summary.sampled, summary.chunks = sampler.sampled, sampler.chunks
    summary.dropped_frames, summary.time_gaps = sampler.dropped_frames, sampler.time_gaps
    summary.bad_frames, summary.bad_frame_reasons = gate.bad_frames, dict(reasons)
    _note_retained(memory, summary)
    return summary


def _note_retained(memory: StreamingMemory, summary: RunSummary) -> None:
    stats = memory.stats()
    summary.kv_tokens = stats.kv_tokens
    summary.retained_chunks = stats.retained_chunks
    for index in stats.retained_chunks:
        summary.retained_times.append(memory.slots.chunk_time(index))
        summary.retained_tokens.append(memory.slots.chunk_tokens(index))


@dataclass
class AskedQuestion:
    """A question asked at the end of a run, with its answer."""

    question: str
    text: str
    evidence_times: list[float]
    evidence_stamps: list[float | None]
    memory_tokens: int
    latency_ms: float
    reasoning: str = ""
    recalled_chunks: int = 0
    recalled_from_disk: int = 0


def run_file(
    memory: StreamingMemory,
    source: FrameSource,
    out: str | Path,
    questions: Sequence[str] = (),
    max_new_tokens: int | None = None,
    fps: float = StreamConfig.fps,
    frames_per_chunk: int = StreamConfig.frames_per_chunk,
    max_gap_s: float = StreamConfig.max_gap_s,
    progress: bool = False,
) -> tuple[RunSummary, list[AskedQuestion]]:
    """Run a source through the memory, ask the questions at its end, and write the results."""
    cfg = memory.config
    meta = {
        "model": str(memory.loaded.path), "device": str(memory.device),
        "dtype": str(memory.loaded.dtype).removeprefix("torch."), "policy": cfg.policy,
        "budget_tokens": cfg.budget_tokens, "sink_tokens": cfg.sink_tokens,
        "window_tokens": cfg.window_tokens, "buckets": cfg.buckets, "seed": cfg.seed,
        "pixel_budget": cfg.pixel_budget, "host_budget_mb": cfg.host_budget_mb,
        "disk_budget_mb": cfg.disk_budget_mb, "recall_tokens": cfg.recall_tokens, "fps": fps,
        "frames_per_chunk": frames_per_chunk,
        "max_gap_s": max_gap_s, "source": source.describe(), "events": source.events,
    }
    with ResultsWriter(out) as writer, tqdm(
        source.frames, total=source.total_frames, unit="frame", file=sys.stderr,
        disable=not (progress and sys.stderr.isatty()),
    ) as frames:
        writer.meta(meta)

        def on_chunk(record: DriftRecord) -> None:
            writer.chunk(record)
            frames.set_postfix(chunk=record.chunk_index, drift=f"{record.drift:.4f}",
                               kv=record.kv_tokens)

        summary = run_stream(memory, frames, fps, frames_per_chunk, max_gap_s, on_chunk)
        asked = []
        for question in questions:
            answer = memory.ask(question, max_new_tokens)
            asked.append(AskedQuestion(question, answer.text, answer.evidence_times,
                                       answer.evidence_stamps, answer.memory_tokens,
                                       answer.latency_ms, answer.reasoning,
                                       answer.recalled_chunks, answer.recalled_from_disk))
        totals = {k: v for k, v in asdict(summary).items() if k != "records"}
        writer.summary(totals | {"answers": [asdict(a) for a in asked]})
    return summary, asked


# ----------------------------------------------------------------------------- results files
class ResultsWriter:
    """Writes records as they come (a long run's partial results survive an interruption)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.csv = self.path.suffix.lower() == ".csv"
        self._file: TextIO = self.path.open("w", newline="" if self.csv else None)
        self._rows = csv.writer(self._file) if self.csv else None

    def meta(self, meta: dict[str, Any]) -> None:
        if self._rows is not None:
            self._file.write(f"# meta {json.dumps(meta)}\n")
            self._rows.writerow(CHUNK_FIELDS)
        else:
            self._line({"type": "meta"} | meta)

    def chunk(self, record: DriftRecord) -> None:
        if self._rows is not None:
            row = asdict(record)
            row["layer_drift"] = ";".join(repr(x) for x in record.layer_drift)
            self._rows.writerow(row[name] for name in CHUNK_FIELDS)
        else:
            self._line({"type": "chunk"} | asdict(record))
        self._file.flush()

    def summary(self, summary: dict[str, Any]) -> None:
        if self._rows is not None:
            self._file.write(f"# summary {json.dumps(summary)}\n")
        else:
            self._line({"type": "summary"} | summary)

    def _line(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@dataclass
class Results:
    """A results file read back: its metadata, chunk records (as dicts) and summary."""

    path: Path
    meta: dict[str, Any]
    chunks: list[dict[str, Any]]
    summary: dict[str, Any] | None  # None when the run did not finish


def read_results(path: str | Path) -> Results:
    """Read a .jsonl or .csv results file written by `run_file`; ValueError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such results file: {path}")
    lines = path.read_text().splitlines()
    try:
        if path.suffix.lower() == ".csv":
            return _read_csv(path, lines)
        records = [json.loads(line) for line in lines if line.strip()]
        by_type = {kind: [r for r in records if r.get("type") == kind]
                   for kind in ("meta", "chunk", "summary")}
        if len(by_type["meta"]) != 1:
            raise ValueError("no meta record")
        summary = by_type["summary"][-1] if by_type["summary"] else None
        return Results(path, by_type["meta"][0], by_type["chunk"], summary)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"not a results file of `deltas-ros run`: {path} ({error})") from error


def _read_csv(path: Path, lines: list[str]) -> Results:
    if not lines or not lines[0].startswith("# meta "):
        raise ValueError("the first line is not '# meta {...}'")
    meta = json.loads(lines[0].removeprefix("# meta "))
    summary = (json.loads(lines[-1].removeprefix("# summary "))
               if lines[-1].startswith("# summary ") else None)
    rows = csv.DictReader(line for line in lines[1:] if not line.startswith("#"))
    chunks = []
    for row in rows:
        chunk: dict[str, Any] = {}
        for name, value in row.items():
            if name == "layer_drift":
                chunk[name] = [float(x) for x in value.split(";") if x]
            else:
                chunk[name] = int(value) if name in INT_FIELDS else float(value)
        chunks.append(chunk)
    return Results(path, meta, chunks, summary)
