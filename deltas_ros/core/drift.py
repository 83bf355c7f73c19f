"""State drift (DeltaS, Eq. 3): how far one chunk moved the Gated DeltaNet recurrent states.

    drift(c) = 1/L * sum_i ||S_after^i - S_before^i||_F / ||S_before^i||_F

over the L linear-attention layers, each norm over the layer's whole state (all heads), in float32.
The gated delta rule writes only the residual between a token's value and what the decayed state
already retrieves for its key, so a chunk that moves the state a lot brought something new.

First chunk: before it the state is all zeros and the ratio is undefined. We define the change of a
layer whose previous state is zero as 1.0 (its whole state is new; equivalently the difference is
normalised by the new state's norm), and 0.0 when both are zero. The first chunk is the oldest
candidate and sits in the first temporal bucket, so its exact score rarely matters.
"""

from __future__ import annotations

import torch


def drift_views(work: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(after, scratch, before, scratch and before) views of a (3, L, n) float32 work tensor that
    holds the L states after the chunk in work[0] and before it in work[2] (rows zero-padded to
    the largest state: zeros change no norm); work[1] is scratch. A buffer that lives on
    (backend._StateBuffers) makes them once (at tiny sizes making four views per chunk is much
    of the drift's cost) and passes them to `drift_of_views` for every chunk."""
    if work.dim() != 3 or work.shape[0] != 3 or work.dtype != torch.float32:
        raise ValueError(f"need a (3, L, n) float32 work tensor, got {tuple(work.shape)} "
                         f"{work.dtype}")
    return work[0], work[1], work[2], work[1:]


def drift_of_views(after: torch.Tensor, scratch: torch.Tensor, before: torch.Tensor,
                   pair: torch.Tensor) -> tuple[float, list[float]]:
    """Eq. 3 for all layers in three ops and one host sync: (mean over layers, [ratio per
    layer]) on the views `drift_views` made.

    One subtraction into the scratch row, one norm over the (2, L) rows of the difference and
    the state before, one transfer of the 2L norms; `after` and `before` are only read. The
    first-chunk rule needs no third norm: where the state before is zero the difference is the
    state after, so "the state after is non-zero" is "the change is non-zero".
    `drift_reference.state_drift_reference` is the layer-by-layer version.
    """
    torch.sub(after, before, out=scratch)
    change, reference = torch.linalg.vector_norm(pair, dim=-1).tolist()
    per_layer = [c / r if r > 0 else float(c > 0) for c, r in zip(change, reference)]
    return sum(per_layer) / len(per_layer), per_layer
