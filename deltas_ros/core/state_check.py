"""Whether a stored stream state may replace a memory's: checked whole before anything changes.

A memory file comes from outside; a doctored one must not be partly accepted, leave counters that
make later requests fail (a chunk count of 2^40), or states that poison every later chunk (NaN).
"""

from __future__ import annotations

import torch

from .results import MemoryState
from .slot_table import MAX_CHUNKS, SlotTable


def expected_tensors(ours: dict[str, torch.Tensor],
                     slots: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, shape) of a state holding `slots` cache slots, from a memory's own
    tensors `ours` (MemoryState.tensors): only the slot dimension may differ."""
    expected = {}
    for name, tensor in ours.items():
        shape = list(tensor.shape)
        if name.startswith("slots."):
            shape[-1] = slots
        elif name.endswith((".keys", ".values")):
            shape[-2] = slots
        expected[name] = (tensor.dtype, tuple(shape))
    return expected


def check_state(state: MemoryState, ours: dict[str, torch.Tensor], budget: int,
                max_positions: int) -> SlotTable:
    """The state's slot table, or ValueError: tensor names, dtypes and shapes as the memory's own
    (`ours`) with at most `budget` slots, finite states and keys/values, counters in range, and
    slots that agree with the counters (SlotTable.check)."""
    counters = {"next_position": state.next_position, "chunks_seen": state.chunks_seen,
                "compactions": state.compactions}
    for name, value in counters.items():
        if type(value) is not int or not 0 <= value < MAX_CHUNKS:
            raise ValueError(f"{name} must be an integer in [0, 2^31), got {value!r}")
    if not 0 < state.next_position <= max_positions:
        raise ValueError(f"next_position {state.next_position} is outside this model's "
                         f"max_position_embeddings ({max_positions})")
    times = state.tensors.get("slots.time")
    slots = times.shape[-1] if isinstance(times, torch.Tensor) and times.dim() else 0
    if slots > budget:
        raise ValueError(f"the state holds {slots} slots; the budget is {budget}")
    expected = expected_tensors(ours, slots)
    check_tensor_names(state.tensors.keys(), expected)
    for name, tensor in state.tensors.items():
        dtype, shape = expected[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name} is {tensor.dtype} {tuple(tensor.shape)}, this memory "
                             f"needs {dtype} {shape}")
        if name.startswith("layers.") and not torch.isfinite(tensor).all():
            raise ValueError(f"{name} holds NaN or infinite values")
    if not isinstance(state.chunk_stamps, dict):
        raise ValueError("chunk_stamps must be a dict")
    if not isinstance(state.chunk_poses, dict):
        raise ValueError("chunk_poses must be a dict")
    return SlotTable.from_export(state.tensors, state.chunk_stamps, state.chunks_seen,
                                 state.next_position, state.chunk_poses)


def check_tensor_names(names, expected: dict) -> None:
    """ValueError unless `names` are exactly the tensors `expected` names (a file's header or
    a state's tensors against this model's)."""
    if names != expected.keys():
        missing, extra = expected.keys() - names, names - expected.keys()
        raise ValueError(f"the state's tensors do not fit this model: missing "
                         f"{sorted(missing) or 'none'}, unexpected {sorted(extra) or 'none'}")
