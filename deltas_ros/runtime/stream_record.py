"""Where a memory's stream stands, as a save records it and a load continues it.

The stream record (stream start, last stamp, next chunk index) changes only on the worker:
after each chunk, to nothing on a reset, to the file's on a load. `continue_clock` is the rule
by which a loaded stream continues beside a live camera.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.frames import SampledChunk

MAX_STREAM_INDEX = 2**31 - 1


@dataclass(frozen=True)
class StreamRecord:
    """Where the memory's stream stands: what a save records and a load continues from."""

    stream_start: float  # header stamp (s) stream times count from
    last_stamp: float  # header stamp of the newest chunk's last frame
    next_chunk_index: int

    @classmethod
    def after(cls, chunk: SampledChunk) -> StreamRecord:
        return cls(chunk.stamps[-1] - chunk.times[-1], chunk.stamps[-1], chunk.index + 1)

    def to_json(self) -> dict[str, float | int]:
        return {"stream_start": self.stream_start, "last_stamp": self.last_stamp,
                "next_chunk_index": self.next_chunk_index}

    @classmethod
    def from_json(cls, value: Any) -> StreamRecord | None:
        """The record of a file's `extra.stream` ({} = saved before any chunk: None).

        Raises ValueError for anything but finite stamps in order and an index in range.
        """
        if value == {}:
            return None
        if not isinstance(value, dict) or set(value) != {"stream_start", "last_stamp",
                                                          "next_chunk_index"}:
            raise ValueError(f"malformed stream record {str(value)[:200]!r}")
        start, last, index = value["stream_start"], value["last_stamp"], value["next_chunk_index"]
        stamps_ok = all(isinstance(s, (int, float)) and not isinstance(s, bool)
                        and math.isfinite(s) and s >= 0 for s in (start, last))
        if not stamps_ok or start > last:
            raise ValueError(f"stream record stamps are not finite, >= 0 and in order: "
                             f"start {start!r}, last {last!r}")
        if type(index) is not int or not 0 <= index <= MAX_STREAM_INDEX:
            raise ValueError(f"stream record next_chunk_index {index!r} is out of range")
        return cls(float(start), float(last), index)


def continue_clock(record: StreamRecord, live_stamp: float | None, live_index: int,
                   fps: float) -> tuple[float, float, int]:
    """(stream start, last stamp, next index) for FrameSampler.resume after loading `record`.

    The rule: with no chunk from the camera yet (since the start or a reset), the saved stream
    continues as it was (a restart).
    With a live camera at `live_stamp` on or after the saved last stamp (the file's own clock),
    stream times keep the saved start (the time in between is a gap), and indices go on from
    the later of the file's and the camera's (`live_index`): chunks the camera made after the
    save left the memory with the load, but their indices were published and are never given
    twice. With a live camera behind the saved stamps (another clock: a replay, sim time), the
    live stream continues the saved one one frame period after its last frame, its indices too
    from the later of the two. Never a jump back: loading does not wipe what it loaded.
    """
    if live_stamp is None:
        return record.stream_start, record.last_stamp, record.next_chunk_index
    if live_stamp >= record.last_stamp:
        return record.stream_start, live_stamp, max(record.next_chunk_index, live_index)
    saved_span = record.last_stamp - record.stream_start
    return (live_stamp - saved_span - 1.0 / fps, live_stamp,
            max(record.next_chunk_index, live_index))
