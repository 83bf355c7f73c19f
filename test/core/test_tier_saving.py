"""A tiered memory saved and loaded: the tier's files beside the memory file (the disk tier's
linked, not copied), checked by sha256 on load; a bad one refused with the memory as it was;
and a compaction moving the tiered chunks with the GPU tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_same_state, feed, frozen
from safetensors import safe_open
from safetensors.torch import save_file

from deltas_ros.core.config import MemoryConfig
from deltas_ros.core.memory import StreamingMemory
from deltas_ros.core.persistence import METADATA_KEY, MemoryFileError, load_memory, save_memory
from deltas_ros.core.recall import key_summary
from deltas_ros.core.tiers import DISK, HOST

SMALL = dict(budget_tokens=40, sink_tokens=4, window_tokens=8, buckets=1, policy="recency",
             pixel_budget=64 * 64, evidence_candidates=0, max_new_tokens=4, recall_tokens=64)
QUESTION = "What did you see?"


@pytest.fixture
def tiered(tiny_model, tmp_path):
    """Memories with a second tier (a disk tier under tmp_path/<name> when `disk`), closed
    after the test."""
    made: list[StreamingMemory] = []

    def make(name: str = "a", disk: bool = False, **fields) -> StreamingMemory:
        tier = dict(host_budget_mb=0.0, disk_budget_mb=64.0, tier_dir=str(tmp_path / name)) \
            if disk else dict(host_budget_mb=64.0)
        made.append(StreamingMemory(tiny_model, MemoryConfig(**{**SMALL, **tier, **fields})))
        return made[-1]

    yield make
    for memory in made:
        memory.close()


def contents(memory: StreamingMemory) -> list[tuple]:
    """Every tiered chunk: its index entry and its piece's tensors."""
    assert memory.tiers.flush(10.0)
    index = memory.tiers.index()
    pieces = memory.tiers.load(index.chunks)
    return [(c, t, p.keys, p.values, p.position, p.score, p.stamp)
            for c, t, p in zip(index.chunks, index.tiers, pieces)]


def assert_same_tiers(a: list[tuple], b: list[tuple]) -> None:
    assert [x[0] for x in a] == [x[0] for x in b]
    for x, y in zip(a, b):
        for u, v in zip(x[2:6], y[2:6]):
            assert torch.equal(u, v)
        assert x[6] == y[6]


def metadata(path: Path) -> dict:
    with safe_open(str(path), "pt") as handle:
        return json.loads(handle.metadata()[METADATA_KEY])


def test_a_host_tier_is_saved_and_loaded_and_answers_as_before(tiered, tmp_path):
    memory = tiered()
    feed(memory, range(8))
    answer = memory.ask(QUESTION)
    assert answer.recalled_chunks >= 1
    path = save_memory(memory, tmp_path / "memory.safetensors")
    saved = metadata(path)["tiers"]
    assert len(saved["chunks"]) == len(memory.stats().tiered)
    other = tiered()
    load_memory(other, path)
    assert_same_state(frozen(other), frozen(memory))
    assert_same_tiers(contents(other), contents(memory))
    again = other.ask(QUESTION)
    assert (again.text, again.recalled_times) == (answer.text, answer.recalled_times)


def test_the_disk_tier_is_linked_not_copied_and_loads_into_another_disk_tier(tiered, tmp_path):
    memory = tiered("a", disk=True)
    feed(memory, range(8))
    before = contents(memory)
    assert {t for _, t, *_ in before} == {DISK}
    path = save_memory(memory, tmp_path / "memory.safetensors")
    folder = path.parent / metadata(path)["tiers"]["folder"]
    saved = sorted(folder.iterdir())
    assert saved and all(f.stat().st_nlink == 2 for f in saved)  # one inode, two names
    other = tiered("b", disk=True)
    load_memory(other, path)
    assert_same_tiers(contents(other), before)
    assert all(f.stat().st_nlink == 3 for f in saved)  # the second store links them too
    other.reset()  # the store drops its names; the saved files stay
    assert all(f.is_file() for f in saved)
    load_memory(other, path)
    assert_same_tiers(contents(other), before)


def test_a_host_tier_loads_into_a_disk_tier_and_the_budgets_apply(tiered, tmp_path):
    memory = tiered()
    feed(memory, range(8))
    path = save_memory(memory, tmp_path / "memory.safetensors")
    small = tiered("b", disk=True, disk_budget_mb=0.002)
    load_memory(small, path)
    stats = small.tiers.current_stats()
    assert stats.disk_bytes <= 0.002 * 2**20 and stats.dropped_chunks >= 1
    assert stats.disk_chunks + stats.dropped_chunks == len(memory.stats().tiered)


def test_a_later_save_replaces_the_earlier_tier_folder(tiered, tmp_path):
    memory = tiered()
    feed(memory, range(6))
    path = save_memory(memory, tmp_path / "memory.safetensors")
    first = metadata(path)["tiers"]["folder"]
    feed(memory, range(6, 9))
    save_memory(memory, path)
    folders = [p.name for p in tmp_path.glob("memory.safetensors.tiers-*")]
    assert folders == [metadata(path)["tiers"]["folder"]] and first not in folders


def damage(folder: Path) -> Path:
    victim = sorted(folder.iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.unlink()  # a new inode: the memory's own link stays intact
    victim.write_bytes(bytes(data))
    return victim


@pytest.mark.parametrize("spoil, reason", [
    (damage, "sha256"),
    (lambda folder: next(folder.iterdir()).unlink(), "cannot be read"),
])
def test_a_bad_tier_file_is_refused_and_the_memory_stays_as_it_was(tiered, tmp_path, spoil,
                                                                    reason):
    memory = tiered()
    feed(memory, range(8))
    path = save_memory(memory, tmp_path / "memory.safetensors")
    spoil(path.parent / metadata(path)["tiers"]["folder"])
    other = tiered()
    feed(other, range(20, 30))
    state, tiers = frozen(other), contents(other)
    with pytest.raises(MemoryFileError, match=reason):
        load_memory(other, path)
    assert_same_state(frozen(other), state)
    assert_same_tiers(contents(other), tiers)


def test_tiers_are_refused_by_a_memory_without_a_second_tier(tiny_model, tiered, tmp_path):
    memory = tiered()
    feed(memory, range(8))
    path = save_memory(memory, tmp_path / "memory.safetensors")
    plain = StreamingMemory(tiny_model, MemoryConfig(**SMALL))
    with pytest.raises(MemoryFileError, match="no second tier"):
        load_memory(plain, path)


def test_a_tier_record_naming_a_file_elsewhere_is_refused(tiered, tmp_path):
    memory = tiered()
    feed(memory, range(8))
    path = save_memory(memory, tmp_path / "memory.safetensors")
    with safe_open(str(path), "pt") as handle:
        header = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    meta = json.loads(header[METADATA_KEY])
    meta["tiers"]["chunks"][0]["file"] = "../../etc/passwd"
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(meta)})
    with pytest.raises(MemoryFileError, match=r"tiers\.chunks\[0\]"):
        load_memory(tiered(), path)


def test_a_compaction_moves_the_tiered_chunks_with_their_keys(tiered):
    memory = tiered()
    feed(memory, range(8))
    before = {c[0]: c for c in contents(memory)}
    end_before = memory.next_position
    index = memory.tiers.index()
    freed = memory.compact_positions()
    assert freed > 0
    moved = memory.tiers.index()  # not the index stacked before the compaction
    assert moved is not index and moved.chunks == index.chunks
    for chunk, _, keys, values, position, *_ in contents(memory):
        torch.testing.assert_close(moved.summaries[moved.chunks.index(chunk)],
                                   key_summary(keys))
        old = before[chunk]
        shift = position - old[4]
        assert (shift == shift[0, 0]).all() and int(shift[0, 0]) <= 0  # one shift, backwards
        torch.testing.assert_close(keys, memory.backend.rotary_shift(old[2], shift),
                                   rtol=0, atol=0)
        assert torch.equal(values, old[3])
        assert 0 <= int(position.min()) and int(position.max()) < memory.next_position
    assert memory.next_position == end_before - freed
    state = frozen(memory)
    answer = memory.ask(QUESTION)
    assert answer.recalled_chunks >= 1
    assert_same_state(frozen(memory), state)


def test_a_saved_compacted_tier_loads_with_its_shift(tiered, tmp_path):
    memory = tiered("a", disk=True)
    feed(memory, range(8))
    memory.compact_positions()
    before = contents(memory)
    path = save_memory(memory, tmp_path / "memory.safetensors")
    assert any(r["shift"] for r in metadata(path)["tiers"]["chunks"])
    other = tiered("b")
    load_memory(other, path)
    assert {t for _, t, *_ in contents(other)} == {HOST}
    assert_same_tiers(contents(other), before)
