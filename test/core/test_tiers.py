"""The second tier's store, without a model: budgets, spills, the drop rule, the writer falling
behind, damaged files."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import pytest
import torch

from deltas_ros.core.poses import Pose
from deltas_ros.core.recall import key_summary
from deltas_ros.core.tier_piece import write_piece
from deltas_ros.core.tiers import DISK, HOST, TierPiece, TierStore

LAYERS, HEADS, DIM = 2, 2, 4


def piece(chunk: int, tokens: int = 3, score: float = 1.0, seed: int = 0) -> TierPiece:
    g = torch.Generator().manual_seed(seed * 1000 + chunk)
    keys = torch.randn(LAYERS, HEADS, tokens, DIM, generator=g)
    return TierPiece(chunk, float(chunk), keys, -keys, torch.arange(3 * tokens).reshape(3, -1),
                     torch.full((tokens,), score), stamp=100.0 + chunk,
                     pose=Pose("map", (1.0, 2.0, float(chunk))))


PIECE_BYTES = piece(0).nbytes
with tempfile.TemporaryDirectory() as folder:
    FILE_BYTES = write_piece(Path(folder), piece(0))[0].stat().st_size  # the disk tier counts


@pytest.fixture
def store_factory(tmp_path):
    stores = []

    def make(**kwargs) -> TierStore:
        kwargs.setdefault("directory", tmp_path / "tiers")
        stores.append(store := TierStore(**kwargs))
        return store

    yield make
    for store in stores:
        store.close()


def test_pieces_stay_in_host_memory_within_its_budget(store_factory):
    store = store_factory(host_bytes=10 * PIECE_BYTES)
    for chunk in range(4):
        store.put(piece(chunk))
    assert store.flush(5.0)
    index = store.index()
    assert index.chunks == [0, 1, 2, 3] and index.tiers == [HOST] * 4
    assert store.current_stats().host_bytes == 4 * PIECE_BYTES
    back = store.load([2])[0]
    assert torch.equal(back.keys, piece(2).keys) and back.pose == piece(2).pose


def test_summaries_count_in_host_memory_and_the_index_is_stacked_once_a_change(store_factory):
    """A chunk's key summary stays in host memory in either tier: counted once through a spill,
    out with a drop or a clear. A question's index is built again only after a change."""
    store = store_factory(host_bytes=PIECE_BYTES, disk_bytes=2 * FILE_BYTES)
    one = key_summary(piece(0).keys).nbytes
    for chunk in range(2):
        store.put(piece(chunk))
    assert store.flush(5.0)
    index = store.index()
    assert index.tiers == [DISK, HOST] and store.index() is index
    assert store.current_stats().summary_bytes == 2 * one
    for chunk in range(2, 6):
        store.put(piece(chunk))
    assert store.flush(5.0)
    stats = store.current_stats()
    assert stats.dropped_chunks == 3 and stats.summary_bytes == 3 * one
    assert store.index() is not index and store.index().chunks == [3, 4, 5]
    store.clear()
    assert store.current_stats().summary_bytes == 0 and store.index().chunks == []


def test_the_oldest_spill_to_disk_and_come_back_exactly(store_factory, tmp_path):
    store = store_factory(host_bytes=2 * PIECE_BYTES, disk_bytes=10 * PIECE_BYTES)
    store.put(piece(0))
    assert store.flush(5.0) and [c.tier for c in store.chunks()] == [HOST]
    for chunk in range(1, 5):
        store.put(piece(chunk))
    assert store.flush(5.0)
    index = store.index()
    assert index.tiers == [DISK, DISK, DISK, HOST, HOST]
    # the viewer's list follows every move between tiers
    assert [(c.index, c.tier) for c in store.chunks()] == list(zip(range(5), index.tiers))
    stats = store.current_stats()
    assert (stats.host_chunks, stats.disk_chunks) == (2, 3)
    files = list((tmp_path / "tiers").iterdir())
    assert len(files) == 3 and stats.disk_bytes == sum(f.stat().st_size for f in files)
    back = store.load([1])[0]
    want = piece(1)
    for name in ("keys", "values", "position", "score"):
        assert torch.equal(getattr(back, name), getattr(want, name))
    assert (back.chunk, back.time_s, back.stamp, back.pose) == (1, 1.0, 101.0, want.pose)


def test_past_both_budgets_the_lowest_score_of_the_oldest_part_goes(store_factory):
    store = store_factory(host_bytes=0, disk_bytes=8 * FILE_BYTES)
    scores = [5.0, 1.0, 3.0, 0.5, 4.0, 4.0, 4.0, 4.0]  # oldest quarter: chunks 0 and 1
    for chunk, score in enumerate(scores):
        store.put(piece(chunk, score=score))
    store.put(piece(8, score=9.0))
    assert store.flush(5.0)
    assert 1 not in store.index().chunks and 3 in store.index().chunks  # 3 is not in the part
    stats = store.current_stats()
    assert stats.dropped_chunks == 1 and stats.disk_bytes <= 8 * FILE_BYTES


def test_without_a_disk_tier_the_oldest_host_chunk_is_dropped(store_factory):
    store = store_factory(host_bytes=2 * PIECE_BYTES, directory=None)
    for chunk in range(3):
        store.put(piece(chunk))
    assert store.flush(5.0)
    assert store.index().chunks == [1, 2]
    assert store.current_stats().dropped_chunks == 1


def test_a_chunk_dropped_twice_is_counted_once(store_factory):
    store = store_factory(host_bytes=PIECE_BYTES, directory=None)
    for chunk in (0, 1, 0):  # the last: a later piece of chunk 0, evicted after its drop
        store.put(piece(chunk))
    assert store.flush(5.0)
    assert store.index().chunks == [1]
    assert store.current_stats().dropped_chunks == 1


def test_the_viewers_list_counts_what_is_on_its_way_to_the_writer(store_factory):
    store = store_factory(host_bytes=10 * PIECE_BYTES, directory=None)
    store.put(piece(0))
    assert store.flush(5.0)
    gate, started = threading.Event(), threading.Event()

    def held_summary(keys: torch.Tensor) -> torch.Tensor:
        started.set()
        assert gate.wait(5.0)
        return key_summary(keys)

    store.summarize = held_summary
    for item in (piece(2, tokens=2), piece(1), piece(0, tokens=2)):
        store.put(item)
    assert started.wait(5.0)  # the writer holds chunk 2's piece, the others wait in the queue
    coming = store.chunks()
    gate.set()
    assert store.flush(5.0)
    assert [(c.index, c.tokens, c.tier) for c in coming] == [(0, 5, HOST), (1, 3, HOST),
                                                             (2, 2, HOST)]
    assert store.chunks() == coming


def test_pieces_of_one_chunk_merge_and_their_summary_is_their_mean_key(store_factory):
    store = store_factory(host_bytes=10 * PIECE_BYTES, disk_bytes=10 * PIECE_BYTES)
    first, second = piece(7, tokens=2, seed=1), piece(7, tokens=3, seed=2)
    store.put(first)
    store.put(second)
    assert store.flush(5.0)
    whole = store.load([7])[0]
    assert whole.tokens == 5
    assert torch.equal(whole.keys, torch.cat([first.keys, second.keys], 2))
    torch.testing.assert_close(store.index().summaries[0], key_summary(whole.keys))


def test_a_piece_of_a_chunk_on_disk_brings_it_back_to_host_memory(store_factory):
    store = store_factory(host_bytes=PIECE_BYTES * 3, disk_bytes=10 * PIECE_BYTES)
    store.put(piece(0))
    store.put(piece(1))
    store.put(piece(2))
    store.put(piece(3))  # chunk 0 spills
    assert store.flush(5.0) and store.index().tiers[0] == DISK
    store.put(piece(0, tokens=1, seed=5))
    assert store.flush(5.0)
    assert store.load([0])[0].tokens == 4


def test_a_writer_behind_drops_the_oldest_pending_piece_and_counts_it(store_factory):
    store = store_factory(host_bytes=100 * PIECE_BYTES, pending=2)
    entered, gate = threading.Event(), threading.Event()
    # the writer stuck on its first piece
    store.summarize = lambda keys: (entered.set(), gate.wait(5.0), key_summary(keys))[2]
    store.put(piece(0))
    assert entered.wait(5.0)
    for chunk in range(1, 5):
        store.put(piece(chunk))
    gate.set()
    assert store.flush(5.0)
    assert store.current_stats().dropped_pieces == 2
    assert store.index().chunks == [0, 3, 4]


def test_a_damaged_tier_file_is_refused_with_its_name(store_factory, tmp_path):
    store = store_factory(host_bytes=0, disk_bytes=10 * PIECE_BYTES)
    store.put(piece(0))
    assert store.flush(5.0)
    path = next((tmp_path / "tiers").iterdir())
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(RuntimeError, match=path.name):
        store.load([0])


def test_clear_forgets_every_chunk_and_its_files(store_factory, tmp_path):
    store = store_factory(host_bytes=PIECE_BYTES, disk_bytes=10 * PIECE_BYTES)
    for chunk in range(3):
        store.put(piece(chunk))
    assert store.flush(5.0)
    store.clear()
    assert store.index().chunks == [] and not list((tmp_path / "tiers").iterdir())
    assert store.current_stats().host_bytes == 0


def test_budgets_are_checked():
    with pytest.raises(ValueError, match="directory"):
        TierStore(host_bytes=1, disk_bytes=1)
    with pytest.raises(ValueError):
        TierStore(host_bytes=-1)


def test_a_new_store_starts_empty_on_disk(store_factory, tmp_path):
    (tmp_path / "tiers").mkdir()
    (tmp_path / "tiers" / "chunk-00000042.safetensors").write_bytes(b"left by an earlier run")
    (tmp_path / "tiers" / "notes.txt").write_text("not ours")
    store = store_factory(host_bytes=0, disk_bytes=10 * PIECE_BYTES)
    assert sorted(p.name for p in (tmp_path / "tiers").iterdir()) == ["notes.txt"]
    assert store.index().chunks == []
