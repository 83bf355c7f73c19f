"""Helpers shared by the engine tests: tiny streams, views of a memory's state, comparisons.

Not a test module (pytest does not collect it); test files import from here, never from each
other.
"""

import time

import numpy as np
import torch

from deltas_ros.core.memory import MemoryState, StreamingMemory

TINY_FRAMES = dict(pixel_budget=64 * 64)  # 4 vision tokens per chunk: fast streams on CPU


def frames_for(chunk: int, size: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(chunk)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(2)]


def feed(memory: StreamingMemory, chunks: range, size: int = 64) -> list:
    return [memory.add_chunk(frames_for(c, size), [c, c + 0.5], stamp=1000.0 + c)
            for c in chunks]


def kv(memory: StreamingMemory) -> list[torch.Tensor]:
    return [t for name, t in memory.backend.export_tensors().items()
            if name.endswith((".keys", ".values"))]


def states(memory: StreamingMemory) -> list[torch.Tensor]:
    return [t for name, t in memory.backend.export_tensors().items()
            if name.endswith("_state")]


def question_ids(memory: StreamingMemory, question: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A question's ids (1, L) and positions (3, 1, L) at the memory's running position."""
    ids = memory.layout.question_ids(memory.tokenizer, question)
    start = memory.next_position
    return torch.tensor([ids]), torch.arange(start, start + len(ids)).expand(3, 1, -1)


def next_logits(memory: StreamingMemory, attention_mask=None) -> torch.Tensor:
    ids, positions = question_ids(memory, "what is on the table?")
    with torch.inference_mode():
        hidden = memory.model.model(input_ids=ids, position_ids=positions,
                                    cache=memory.backend.cache, attention_mask=attention_mask,
                                    use_cache=True)
    return memory.model.lm_head(hidden.last_hidden_state)


def frozen(memory: StreamingMemory) -> MemoryState:
    """A copy of the memory's whole state that later changes to the memory cannot reach."""
    state = memory.export_state()
    state.tensors = {name: t.clone() for name, t in state.tensors.items()}
    return state


def assert_same_state(a: MemoryState, b: MemoryState) -> None:
    """Bitwise equal tensors and equal counters."""
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    assert (a.next_position, a.chunks_seen, a.compactions, a.chunk_stamps, a.chunk_poses) == (
        b.next_position, b.chunks_seen, b.compactions, b.chunk_stamps, b.chunk_poses)


def any_call(*args, **kwargs) -> bool:
    return True


def fail_on_call(monkeypatch, owner, name: str, n: int, only=any_call) -> list[int]:
    """Make owner.name raise CUDA out of memory on its n-th call that `only` selects."""
    original = getattr(owner, name)
    calls = []

    def failing(*args, **kwargs):
        if only(*args, **kwargs):
            calls.append(len(calls) + 1)
            if len(calls) == n:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return calls


def wait_until(predicate, timeout_s: float = 60.0) -> bool:
    """Poll instead of sleeping a fixed time (CI machines are slow and busy); the caller asserts
    the result, so a timeout fails where the condition is named."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def corrupted_jpeg(jpeg: bytes) -> bytes:
    """`jpeg` with one byte of its coded data flipped where libjpeg reports the data corrupt
    ("Corrupt JPEG data: N extraneous bytes") and OpenCV still returns a picture: the frame a
    damaged link delivers and the node once took without a count."""
    import cv2
    import simplejpeg

    for position in range(len(jpeg) // 2, len(jpeg) - 2):
        damaged = bytearray(jpeg)
        damaged[position] ^= 0x55
        try:
            simplejpeg.decode_jpeg(bytes(damaged), strict=True)
        except ValueError as error:
            if "Corrupt JPEG data" in str(error) and cv2.imdecode(
                    np.frombuffer(bytes(damaged), np.uint8), cv2.IMREAD_COLOR) is not None:
                return bytes(damaged)
    raise AssertionError("no byte of this JPEG makes libjpeg report corrupt data")
