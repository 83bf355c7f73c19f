"""Where the per-chunk path reads values back to the host: the GPU-readiness guard.

A CPU-only machine cannot count CUDA synchronisations, so this test records every call that
would be one on a device tensor (item, tolist, cpu, numpy, bool/int/float of a tensor, nonzero,
unique, boolean-mask indexing: a data-dependent size) made from deltas_ros code while the tiny
model streams through steady-state evictions, and compares the call sites with the list below.
Each allowed site says why it is not a per-chunk device sync: under DeltaS the only device read
is the drift's one transfer of 2L norms; a per-token state policy (the default `surprise`) reads
its chunk's n token scores once more, right after it; the rest run on the slot table and
the chunk's inputs, which live on the host by design (a few KiB per slot row; selection runs in
numpy on the host and the device only receives the index tensors, host-to-device).
A new host read of a device tensor (e.g. an `.item()` on a cache tensor in memory.py or
backend.py) fails this test. The model's own forward (transformers' vision code) reads grid
sizes back too; that is outside deltas_ros and not counted here.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from engine_helpers import TINY_FRAMES, frames_for
from torch.overrides import TorchFunctionMode

from deltas_ros.core.memory import MemoryConfig, StreamingMemory

T = torch.Tensor
READS = {T.item, T.tolist, T.cpu, T.numpy, T.__bool__, T.__int__, T.__float__, T.__index__,
         T.nonzero, torch.nonzero, T.unique, torch.unique, T.masked_select, torch.masked_select}

DEVICE_SYNCS = {("drift.py", "drift_of_views", "tolist")}  # the one: 2L norms, documented
TOKEN_SYNCS = {("signals.py", "layer_mean", "cpu")}  # per-token policies: the chunk's n scores
HOST_TABLE = {  # slot table, selection and chunk inputs: host tensors by design
    ("chunks.py", "build", "tolist"),  # the chunk's grid, before it goes to the device
    ("slot_table.py", "extend", "cpu"),  # host positions / scores: a no-op on host tensors
    # numpy views of the host slot table (.numpy() raises on a device tensor: never a sync)
    ("memory.py", "slots_to_keep", "numpy"), ("slot_table.py", "arrival_order", "numpy"),
    ("slot_table.py", "keep_slots", "numpy"), ("slot_table.py", "moved", "numpy"),
    ("slot_table.py", "held", "numpy"),
    ("slot_table.py", "append", "numpy"),  # the scores' host copy
    ("memory.py", "_ingest", "item"),  # the mean of the token scores, already on the host
}


class HostReads(TorchFunctionMode):
    """Counts host reads by the innermost deltas_ros frame that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        boolean_index = (func is T.__getitem__ and isinstance(args[1], torch.Tensor)
                         and args[1].dtype == torch.bool)
        if func in READS or boolean_index:
            stack = traceback.extract_stack()[:-1]
            ours = [i for i, f in enumerate(stack)
                    if "/deltas_ros/" in f.filename and "site-packages" not in f.filename]
            # Reads inside the model's forward (transformers) are the model's, not ours.
            if ours and not any("/transformers/" in f.filename for f in stack[ours[-1]:]):
                site = stack[ours[-1]]
                self.sites[(site.filename.rsplit("/", 1)[-1], site.name, func.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy, syncs", [("deltas", DEVICE_SYNCS),
                                           ("surprise", DEVICE_SYNCS | TOKEN_SYNCS)])
def test_the_per_chunk_path_reads_the_device_only_where_listed(tiny_model, policy, syncs):
    memory = StreamingMemory(tiny_model, MemoryConfig(budget_tokens=80, window_tokens=20,
                                                      policy=policy, **TINY_FRAMES))
    for chunk in range(10):  # the cache fills, the buffers are allocated
        memory.add_chunk(frames_for(chunk), [chunk, chunk + 0.5])
    chunks = 4
    with HostReads() as reads:
        for chunk in range(10, 10 + chunks):
            assert memory.add_chunk(frames_for(chunk), [chunk, chunk + 0.5]).evicted_tokens
    sites = set(reads.sites)
    assert sites - HOST_TABLE - syncs == set(), "new host reads in the per-chunk path"
    assert syncs <= sites  # the guard sees the ones it allows (it can fail)
    for site in syncs:
        assert reads.sites[site] == chunks  # exactly once per chunk each
