"""A trained model's weights under a vocabulary that extends its own (the hour world's words).

Every word keeps its id, and the new words come after all of them, so the trained rows are
copied as they are. A new word's row (input embedding and output head alike) starts at the mean
of its class in the same spelling (" purple" at the mean of " red" ... " orange"; "cross" at
that of "circle", "square", "triangle"), plus noise of a quarter of the class's spread to tell
the new words apart: a
model that reads "the circle was" then rates a new colour like an average old one, below the
colour it means, so its answers about today's objects do not move.
"""

from __future__ import annotations

import torch

from .palette import COLOURS, MORE_COLOURS, MORE_SHAPES, SHAPES

CLASSES = ((tuple(MORE_COLOURS), tuple(COLOURS)), (MORE_SHAPES, SHAPES))
NOISE = 0.25  # the new rows' noise, in standard deviations of their class about its mean


def check_extends(old: dict[str, int], new: dict[str, int]) -> list[str]:
    """The tokens of `new` that `old` lacks (ids past all of old's); raises where a token of
    `old` has another id in `new` (its rows would mean another word there)."""
    moved = [token for token, i in old.items() if new.get(token) != i]
    added = sorted((t for t in new if t not in old), key=new.__getitem__)
    if moved or any(new[t] < len(old) for t in added):
        raise ValueError(f"the vocabulary does not extend the model's: {moved[:5]} moved")
    return added


def class_ids(token: str, vocab: dict[str, int]) -> list[int]:
    """Ids of the trained words of the same class and spelling as a new `token` (all trained
    ids for a token of no class)."""
    space = " " if token.startswith(" ") else ""
    for new, old in CLASSES:
        if token.strip() in new:
            return [vocab[space + word] for word in old]
    return list(range(len(vocab)))


def extend_rows(rows: torch.Tensor, count: int, added: list[str], old: dict[str, int],
                new: dict[str, int], seed: int = 0) -> torch.Tensor:
    """(R, d) trained rows (R >= len(old): the model rounds its vocabulary up) -> (count, d)
    rows: the words' rows, one per added token (`class_ids` mean plus NOISE), and the mean row
    for the unused rest."""
    out = rows[:len(old)].mean(0).expand(count, -1).clone()
    out[:len(old)] = rows[:len(old)]
    generator = torch.Generator().manual_seed(seed)
    for token in added:
        members = rows[class_ids(token, old)]
        noise = torch.randn(rows.shape[1], generator=generator, dtype=rows.dtype)
        out[new[token]] = members.mean(0) + NOISE * (members - members.mean(0)).std() * noise
    return out


def extend_state(state: dict[str, torch.Tensor], target: dict[str, torch.Tensor],
                 old: dict[str, int], new: dict[str, int]) -> dict[str, torch.Tensor]:
    """A model's `state` with every tensor of one row per word (embeddings, output head)
    grown to `target`'s shape by `extend_rows`; any other difference in shape, or new words
    that no tensor grows for, raises."""
    added = check_extends(old, new)
    out, grown = {}, 0
    for name, tensor in state.items():
        shape = target[name].shape
        if tensor.shape != shape:
            if tensor.shape[1:] != shape[1:] or min(tensor.shape[0], shape[0] - len(added)) \
                    < len(old):
                raise ValueError(f"{name}: {tuple(tensor.shape)} cannot become {tuple(shape)}")
            tensor = extend_rows(tensor, shape[0], added, old, new)
            grown += 1
        out[name] = tensor
    if added and not grown:
        raise ValueError(f"no rows for the {len(added)} new words")
    return out
