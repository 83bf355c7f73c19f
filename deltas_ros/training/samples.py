"""Training samples laid out exactly as `StreamingMemory` feeds the model (test_train.py checks
the ids and positions): the chat prefix, one chunk per second at the running position, then each
question closing the user turn at the next position, then its answer."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from ..core.chunks import ChunkBuilder
from ..core.config import StreamConfig
from ..core.prompt import ChatLayout
from .cache import repeat_cache, sharing_the_stream
from .config import TrainConfig
from .palette import identities
from .questions import QA, sample_questions
from .scenes import SceneOptions, SceneStream

FPS = StreamConfig.fps  # as the node samples a camera
FRAMES_PER_CHUNK = StreamConfig.frames_per_chunk
# Stream seeds: training draws from TRAIN_SEEDS on, validation from VALIDATION_SEEDS on;
# evaluation uses seeds below VALIDATION_SEEDS, never seen in training or model selection.
VALIDATION_SEEDS = 500_000
TRAIN_SEEDS = 1_000_000
VISION_SEEDS = 10**12  # the vision phase's scenes, apart from the streams'
VISION_CHECK_SEEDS = VISION_SEEDS + 10**11  # its held-out check, past any run's steps


@dataclass
class StreamInput:
    """One stream as the memory prefills it, before any question.

    input_ids (L,), positions (3, L), pixel_values (chunks * patches, patch_dim),
    grid_thw (chunks, 3); next_position: where the question starts.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    next_position: int


def chunk_frames(stream: SceneStream) -> list[list[int]]:
    """Frame indices of each chunk: frame k at stream time k / FPS (2 fps from time 0), two per
    chunk, as the node's FrameSampler groups a camera stream (times count from the first
    frame)."""
    n = round(stream.duration_s * FPS) // FRAMES_PER_CHUNK * FRAMES_PER_CHUNK
    return [list(range(i, i + FRAMES_PER_CHUNK)) for i in range(0, n, FRAMES_PER_CHUNK)]


def sampled_chunks(stream: SceneStream) -> list[tuple[list[np.ndarray], list[float]]]:
    """(frames, times) per chunk (`chunk_frames`), rendered."""
    return [([stream.frame(k / FPS, k) for k in frames], [k / FPS for k in frames])
            for frames in chunk_frames(stream)]


def stream_input(builder: ChunkBuilder, layout: ChatLayout,
                 chunks: list[tuple[list[np.ndarray], list[float]]]) -> StreamInput:
    """The chat prefix, then each chunk at the running position, as StreamingMemory does."""
    ids, positions = builder.text(layout.prefix, 0)
    all_ids, all_pos, pixels, grids = [ids[0]], [positions[:, 0]], [], []
    position = positions.max().item() + 1
    for frames, times in chunks:
        chunk = builder.build(frames, times, position)
        all_ids.append(chunk.input_ids[0])
        all_pos.append(chunk.position_ids[:, 0])
        pixels.append(chunk.pixel_values)
        grids.append(chunk.grid_thw)
        position = chunk.next_position
    return StreamInput(torch.cat(all_ids), torch.cat(all_pos, 1), torch.cat(pixels),
                       torch.cat(grids), position)


def qa_ids(tokenizer, layout: ChatLayout, qa: QA) -> tuple[list[int], int]:
    """Question (closing the user turn, opening the answer) + answer + <|im_end|>; and where
    the answer starts."""
    question = layout.question_ids(tokenizer, qa.question)
    answer = tokenizer.encode(qa.answer, add_special_tokens=False)
    return question + answer + [tokenizer.convert_tokens_to_ids("<|im_end|>")], len(question)


@dataclass
class Batch:
    """B streams of equal length (same token layout) and Q questions each."""

    streams: list[StreamInput]
    qas: list[QA]  # B * Q, stream-major
    qa_ids: torch.Tensor  # (B * Q, Lq), right-padded
    answer_mask: torch.Tensor  # (B * Q, Lq) bool: positions whose next token is supervised


def make_batch(builder: ChunkBuilder, layout: ChatLayout, cfg: TrainConfig, seeds: list[int],
               seconds: int, options: SceneOptions, questions: int,
               forms: dict[str, float] | None = None) -> Batch:
    tokenizer = builder.tokenizer
    streams, qas, rows, starts = [], [], [], []
    for seed in seeds:
        scene = SceneStream(seconds, cfg.width, cfg.height, seed, options)
        streams.append(stream_input(builder, layout, sampled_chunks(scene)))
        rng = np.random.default_rng((seed, 7))
        for qa in sample_questions(scene.events(), rng, questions, forms or cfg.forms,
                                   options.extended):
            ids, start = qa_ids(tokenizer, layout, qa)
            qas.append(qa)
            rows.append(ids)
            starts.append(start)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, start) in enumerate(zip(rows, starts)):
        mask[i, start - 1:len(row) - 1] = True  # logits at p predict token p + 1
    return Batch(streams, qas, ids, mask)


def forward(model, batch: Batch, device: torch.device, shared: bool = True) -> torch.Tensor:
    """Logits (B * Q, Lq, vocab) of the questions and answers after their streams; the Q
    questions of a stream share its K/V (cache.sharing_the_stream), or with shared=False each
    attends over its own copy (cache.repeat_cache, the reference)."""
    text_config = model.config.text_config
    streams = batch.streams
    ids = torch.stack([s.input_ids for s in streams]).to(device)
    positions = torch.stack([s.positions for s in streams], 1).to(device)
    cache = DynamicCache(config=text_config)
    model.model(
        input_ids=ids,
        pixel_values_videos=torch.cat([s.pixel_values for s in streams]).to(device),
        video_grid_thw=torch.cat([s.grid_thw for s in streams]).to(device),
        mm_token_type_ids=(ids == model.config.video_token_id).int() * 2,
        position_ids=positions, cache=cache, use_cache=True,
    )
    repeats = batch.qa_ids.shape[0] // len(streams)
    start = streams[0].next_position
    width = batch.qa_ids.shape[1]
    qa_positions = torch.arange(start, start + width, device=device).expand(3, len(batch.qas), -1)
    ask = functools.partial(model.model, input_ids=batch.qa_ids.to(device),
                            position_ids=qa_positions, use_cache=True)
    if not shared:
        return model.lm_head(ask(cache=repeat_cache(cache, repeats, text_config)
                                 ).last_hidden_state)
    with sharing_the_stream(model, cache, repeats, width) as (questions, masks):
        return model.lm_head(ask(cache=questions, attention_mask=masks).last_hidden_state)


def loss_and_hits(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, list[bool]]:
    """Cross-entropy over the answer tokens; per question whether every answer token is the
    argmax (teacher-forced exact match)."""
    targets = batch.qa_ids[:, 1:].to(logits.device)
    mask = batch.answer_mask[:, :-1].to(logits.device)
    picked = logits[:, :-1][mask]
    loss = F.cross_entropy(picked.float(), targets[mask])
    right = (logits[:, :-1].argmax(-1) == targets) | ~mask
    return loss, right.all(1).tolist()


def vision_sample(builder: ChunkBuilder, cfg: TrainConfig, seed: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A chunk of a one-object scene stream (the last stage's cuts and distractors) and what
    it shows: (pixel values, grid_thw, shape index, colour index) into the stage's shapes and
    colours (palette.identities), or their counts for no object (chosen with probability
    vision_pretrain.empty). One object, in one part: the busy and hour worlds' draws aside."""
    options = replace(cfg.stages[-1].scenes, objects=(1, 1), part_s=0.0)
    colours, shapes = identities(options.extended)
    scene = SceneStream(4, cfg.width, cfg.height, seed, options)
    chunks = chunk_frames(scene)  # only the chosen chunk is rendered
    seen = [[scene.visible(k / FPS) for k in frames] for frames in chunks]
    whole = [k for k, s in enumerate(seen) if all(s)]  # the object in both frames
    empty = [k for k, s in enumerate(seen) if not any(s)]
    rng = np.random.default_rng((seed, 5))
    pool = empty if empty and rng.random() < cfg.vision_pretrain.empty else whole
    k = pool[int(rng.integers(len(pool)))]
    chunk = builder.build([scene.frame(i / FPS, i) for i in chunks[k]],
                          [i / FPS for i in chunks[k]], 0)
    if not seen[k][0]:
        return chunk.pixel_values, chunk.grid_thw, len(shapes), len(colours)
    colour, shape = seen[k][0][0]
    return chunk.pixel_values, chunk.grid_thw, shapes.index(shape), list(colours).index(colour)
