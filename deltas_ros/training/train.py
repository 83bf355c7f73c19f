"""Training a tiny Qwen3.5 to answer about scene streams, laid out as the memory feeds them.

    deltas-ros train --config config/train_tiny.yaml --out out/train [--resume] [--device cuda]

A training sample is exactly what `StreamingMemory` sees (test_train.py checks the ids and
positions): the chat prefix of `ChatLayout`, then one chunk per second built by
`ChunkBuilder.build` at the running position (2 frames at 2 fps), then the question closing the
user turn at the next position, then the answer. Each step prefills B streams once and asks Q
questions of each: the linear-attention states are repeated Q times and the questions share the
stream's K/V (`cache.sharing_the_stream`), so one stream forward serves Q supervised answers.
Loss on the answer tokens (and <|im_end|>) only.

Vision first (config `vision_pretrain`), as vision-language models pretrain their vision encoder:
the vision tower and a throwaway linear head learn the shape and colour of the object a chunk
shows (or that it shows none), from chunks built by `ChunkBuilder` exactly as in the streams.
Through the language model alone the shape signal is too weak: colour was learned in minutes,
shape stayed at chance for 12 minutes, while the same tower with a direct head learned it.

Curriculum: config `stages` (stream lengths, objects per stream, cuts, distractors, overlap,
question forms); short streams with one object first, which is what breaks the plateau (see
shared/notes/training-feasibility.md). A stage ends when the running accuracy on the target forms
reaches its `advance_at` (after `min_steps`), or at `until_step` at the latest.

Checkpoints go to OUT/checkpoint.pt every few minutes and at the end; `--resume` continues from it
(steps, stage, optimizer, elapsed time). The model with the best held-out validation accuracy
(validation seeds, never evaluation or training ones) is exported to OUT/model as a
`from_pretrained` directory, and at the end the last weights to OUT/final.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import AddedToken
from tqdm import tqdm

from ..core.chunks import ChunkBuilder
from ..core.kernels import select_gated_delta_kernels
from ..core.loader import MODEL_INFO_FILE, load_model
from ..core.model_maker import (
    TINY_VISION_START_ID,
    init_model,
    make_processor,
    make_tokenizer,
    tiny_config,
)
from ..core.prompt import ChatLayout
from .config import TrainConfig
from .gated_delta import chunk_gated_delta_rule
from .palette import COLOURS, SHAPES, identities
from .questions import (
    DOMAIN_WORDS,
    FORMS,
    MORE_WORDS,
    QA,
    TARGET_FORMS,
    TIME_TEXT_PIECES,
)
from .samples import (
    TRAIN_SEEDS,
    VALIDATION_SEEDS,
    VISION_CHECK_SEEDS,
    VISION_SEEDS,
    forward,
    loss_and_hits,
    make_batch,
    vision_sample,
)
from .vocabulary import extend_state


class VisionHead(torch.nn.Module):
    """The vision phase's throwaway classifier: a chunk's pooled tokens (B, hidden) -> shape
    logits (B, shapes + 1) and colour logits (B, colours + 1), the last class of each "nothing"
    (`classes`: today's 3 shapes and 8 colours, or the hour world's 5 and 12).

    Untied: a linear layer. Tied: the classes are the language model's input embeddings of the
    words that name them (`words()`: rows for the shapes then the colours), by cosine similarity
    with a learned scale, so that a chunk's tokens come out looking like the words for what it
    shows (and those embeddings move towards them); "nothing" has vectors of its own.
    """

    def __init__(self, hidden: int, words: Callable[[], torch.Tensor] | None = None,
                 classes: tuple[int, int] = (len(SHAPES), len(COLOURS))) -> None:
        super().__init__()
        self.words, self.shapes = words, classes[0]
        if words is None:
            self.linear = torch.nn.Linear(hidden, classes[0] + 1 + classes[1] + 1)
        else:
            self.nothing = torch.nn.Parameter(torch.randn(2, hidden) * 0.02)
            self.scale = torch.nn.Parameter(torch.tensor(5.0))

    def forward(self, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.shapes
        if self.words is None:
            logits = self.linear(pooled)
            return logits[:, :n + 1], logits[:, n + 1:]
        rows, unit = self.words(), F.normalize(pooled, dim=-1)
        classes = (torch.cat([rows[:n], self.nothing[:1]]),
                   torch.cat([rows[n:], self.nothing[1:]]))
        return tuple(self.scale * unit @ F.normalize(c, dim=-1).T for c in classes)




# ----------------------------------------------------------------------------- model
CHAT_ROLES = ("user", "assistant")  # the chat template's role names: one token each


def scene_tokenizer(extended: bool = False):
    """The byte-level Qwen3.5 tokenizer plus whole-word tokens for the scene domain, each also
    with its leading space ("What color was the circle?" is 6 tokens, not 26; outside the domain
    a word may split, e.g. "redo" into " red" + "o", and still decodes exactly), the chat roles
    (the question's template tail: 7 tokens instead of 15) and the chunk time text's
    " seconds>" (a chunk's time text: 6 tokens instead of 13-14). `extended`: then the hour
    world's words (questions.MORE_WORDS) the same way, after all of those, so every other word
    keeps the id the shipped model knows it by."""
    tokenizer = make_tokenizer(TINY_VISION_START_ID)
    more = MORE_WORDS if extended else ()
    tokenizer.add_tokens([AddedToken(w, single_word=True, normalized=False)
                          for w in (*DOMAIN_WORDS, *CHAT_ROLES)]
                         + [AddedToken(f" {w}", normalized=False) for w in DOMAIN_WORDS]
                         + [AddedToken(p, normalized=False) for p in TIME_TEXT_PIECES]
                         + [AddedToken(w, single_word=True, normalized=False) for w in more]
                         + [AddedToken(f" {w}", normalized=False) for w in more])
    return tokenizer


def new_model(cfg: TrainConfig, tokenizer) -> torch.nn.Module:
    """model_maker.tiny_config's layout (Gated DeltaNet + full attention 3:1) at the config's
    sizes, with room for the scene tokenizer's added words; with `cfg.init`, that model's weights
    (`load_init`)."""
    model = init_model(tiny_config(cfg.text, cfg.vision, len(tokenizer)), cfg.seed)
    if cfg.init:
        load_init(model, tokenizer, init_path(cfg.init))
    return model


def init_path(init: str) -> Path:
    """`init` as given if it exists, else relative to the package's parent directory."""
    path = Path(init)
    return path if path.exists() or path.is_absolute() else Path(__file__).parents[2] / path


def load_init(model: torch.nn.Module, tokenizer, path: Path) -> None:
    """Copy an exported model's weights into `model`: all of them, same shapes, or, where
    `tokenizer` extends the model's vocabulary (the hour world's words after all of its own),
    its rows copied and the new words' rows made by `vocabulary.extend_state`. Refuses a model
    whose words have other ids here: its rows would mean other words."""
    source = load_model(path, "cpu", "float32")  # the loader every model goes through
    old, new = source.tokenizer.get_vocab(), tokenizer.get_vocab()
    try:
        state = extend_state(source.model.state_dict(), model.state_dict(), old, new)
    except ValueError as error:
        raise ValueError(f"{path}: its tokenizer is not the scene tokenizer ({error})") from None
    model.load_state_dict(state)


def export_model(model, tokenizer, out_dir: str | Path, pixel_budget: int,
                 info: dict[str, Any]) -> Path:
    """Write a directory `load_model` reads: weights (safetensors), tokenizer, processor, and
    MODEL_INFO_FILE with the pixel budget the model was trained at."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    make_processor(tokenizer, model.config, pixel_budget).save_pretrained(out_dir)
    (out_dir / MODEL_INFO_FILE).write_text(
        json.dumps({"pixel_budget": pixel_budget, **info}, indent=2) + "\n")
    return out_dir


# ----------------------------------------------------------------------------- training
class Trainer:
    """One training run in OUT: checkpoint.pt (resumable), model/ (best export), final/ (the
    last weights, at the end), train.log."""

    def __init__(self, cfg: TrainConfig, out: str | Path, device: str = "cpu",
                 resume: bool = False) -> None:
        self.cfg, self.out = cfg, Path(out)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda requested but CUDA is not available")
        torch.set_num_threads(cfg.threads)
        self.tokenizer = scene_tokenizer(cfg.extended)
        self.model = new_model(cfg, self.tokenizer).to(self.device)
        select_gated_delta_kernels(self.model, self.device, chunk=chunk_gated_delta_rule)
        self.builder = ChunkBuilder.for_model(self.model, self.tokenizer, cfg.pixel_budget)
        self.layout = ChatLayout.from_tokenizer(self.tokenizer)
        decay, rest = [], []
        for name, p in self.model.named_parameters():
            (decay if p.ndim >= 2 and "embed" not in name else rest).append(p)
        self.optim = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
        hidden = self.model.config.text_config.hidden_size
        embeddings = self.model.model.language_model.embed_tokens.weight
        colours, shapes = identities(cfg.extended)
        word_ids = torch.tensor([self.tokenizer.convert_tokens_to_ids(f" {w}")
                                 for w in (*shapes, *colours)], device=self.device)
        tied = cfg.vision_pretrain.tied
        self.vision_head = VisionHead(hidden, (lambda: embeddings[word_ids]) if tied else None,
                                      (len(shapes), len(colours))).to(self.device)
        self.vision_optim = torch.optim.AdamW(
            [{"params": [*self.model.model.visual.parameters(),
                         *self.vision_head.parameters()]},
             {"params": [embeddings] if tied else [], "weight_decay": 0.0}],
            lr=cfg.vision_pretrain.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        # the tower as the run starts (the init's), before a checkpoint replaces it
        self.initial_tower = copy.deepcopy(self.model.model.visual).eval().requires_grad_(False) \
            if cfg.vision_pretrain.keep else None
        # the language model's layers as the run starts (the init's), for `lm_keep`
        self.initial_lm = [(p, p.detach().clone()) for name, p in
                           self.model.model.language_model.named_parameters()
                           if "embed" not in name] if cfg.lm_keep else []
        self.initial_lm_norm = sum(float(p0.square().sum()) for _, p0 in self.initial_lm)
        self.vision_steps = 0
        self.step, self.elapsed_s, self.best = 0, 0.0, -1.0
        self.stage_index, self.stage_start = 0, 0
        self.history: list[dict[str, Any]] = []
        checkpoint = self.out / "checkpoint.pt"
        if resume:
            if not checkpoint.is_file():
                raise FileNotFoundError(f"nothing to resume: {checkpoint} is missing")
            state = torch.load(checkpoint, map_location=self.device, weights_only=False)
            self.model.load_state_dict(state["model"])
            self.optim.load_state_dict(state["optim"])
            self.step, self.elapsed_s = state["step"], state["elapsed_s"]
            self.best, self.history = state["best"], state["history"]
            self.stage_index, self.stage_start = state["stage_index"], state["stage_start"]
            self.vision_head.load_state_dict(state["vision_head"])
            self.vision_optim.load_state_dict(state["vision_optim"])
            self.vision_steps = state["vision_steps"]
        elif checkpoint.exists():
            raise FileExistsError(f"{checkpoint} exists: pass --resume or another --out")
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.out / "train.log", "a")

    def log(self, line: str) -> None:
        tqdm.write(line)  # above the progress bar, if there is one
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def lr(self) -> float:
        """Linear warm-up, constant, then linear decay to 10 % over the last `decay_fraction`
        of the run's length (the step or the time limit, whichever is nearer)."""
        cfg = self.cfg
        warm = min(1.0, (self.step + 1) / cfg.warmup)
        done = max(self.step / cfg.max_steps, self.elapsed_s / (cfg.max_minutes * 60))
        decay = min(1.0, max(0.0, (1 - done) / cfg.decay_fraction)) if cfg.decay_fraction else 1
        return cfg.lr * warm * (0.1 + 0.9 * decay)

    def vision_step(self) -> tuple[float, list[bool], list[bool]]:
        """One step of the vision phase: (loss, shape right, colour right) per chunk."""
        cfg = self.cfg
        base = VISION_SEEDS + (cfg.seed * 10**7 + self.vision_steps) * cfg.vision_pretrain.batch
        samples = [vision_sample(self.builder, cfg, base + b)
                   for b in range(cfg.vision_pretrain.batch)]
        shapes, colours = (torch.tensor([s[i] for s in samples], device=self.device)
                           for i in (2, 3))
        self.model.train()
        head_only = self.vision_steps < cfg.vision_pretrain.head_steps
        pixels, grids, tokens, (shape_logits, colour_logits) = self._head(samples, head_only)
        loss = F.cross_entropy(shape_logits, shapes) + F.cross_entropy(colour_logits, colours)
        if self.initial_tower is not None and not head_only:
            loss = loss + cfg.vision_pretrain.keep * self._moved(pixels, grids, tokens,
                                                                 shapes, colours)
        self.vision_optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.model.visual.parameters(), cfg.clip)
        self.vision_optim.step()
        self.vision_steps += 1
        return (loss.item(), (shape_logits.argmax(1) == shapes).tolist(),
                (colour_logits.argmax(1) == colours).tolist())

    def _head(self, samples: list, frozen_tower: bool = False) -> tuple:
        """Vision samples through the tower and the head: (pixels, grid_thw, tokens (B, tokens,
        hidden), (shape logits, colour logits)); frozen_tower: no gradient into the tower."""
        pixels, grids = (torch.cat([s[i] for s in samples]).to(self.device) for i in (0, 1))
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen_tower):
            tokens = self.model.model.visual(pixels, grid_thw=grids).pooler_output
        tokens = tokens.view(len(samples), -1, tokens.shape[-1])  # (B, tokens, hidden): equal
        return pixels, grids, tokens, self.vision_head(tokens.mean(1))

    @torch.no_grad()
    def vision_check(self, chunks: int) -> dict[str, Any]:
        """The vision phase's head on `chunks` held-out chunks: accuracy per shape and per
        colour ("none": no object), and how often each wrong (truth, answer) pair happened."""
        cfg = self.cfg
        colours, shapes = identities(cfg.extended)
        names = ([*shapes, "none"], [*colours, "none"])
        right: tuple[dict, dict] = ({n: [] for n in names[0]}, {n: [] for n in names[1]})
        confused: dict[str, int] = {}
        self.model.eval()
        for first in range(0, chunks, cfg.vision_pretrain.batch):
            samples = [vision_sample(self.builder, cfg, VISION_CHECK_SEEDS + i)
                       for i in range(first, min(first + cfg.vision_pretrain.batch, chunks))]
            logits = self._head(samples)[3]
            for kind in (0, 1):
                for sample, answer in zip(samples, logits[kind].argmax(1).tolist()):
                    truth, said = names[kind][sample[2 + kind]], names[kind][answer]
                    right[kind][truth].append(truth == said)
                    if truth != said:
                        confused[f"{truth}->{said}"] = confused.get(f"{truth}->{said}", 0) + 1
        return {"shape": {n: float(np.mean(v)) for n, v in right[0].items() if v},
                "colour": {n: float(np.mean(v)) for n, v in right[1].items() if v},
                "confused": dict(sorted(confused.items(), key=lambda kv: -kv[1]))}

    def _moved(self, pixels: torch.Tensor, grids: torch.Tensor, tokens: torch.Tensor,
               shapes: torch.Tensor, colours: torch.Tensor) -> torch.Tensor:
        """How far the tower moved the tokens (B, tokens, hidden) of the chunks that show one of
        today's identities or nothing, from where the initial tower put them: squared error over
        the initial tokens' squared norm, averaged over those chunks (0 if none)."""
        with torch.no_grad():
            before = self.initial_tower(pixels, grid_thw=grids).pooler_output.view_as(tokens)
        empty = shapes == len(identities(self.cfg.extended)[1])
        today = (shapes < len(SHAPES)) & (colours < len(COLOURS)) | empty
        if not today.any():
            return tokens.new_zeros(())
        moved = (tokens - before).square().sum((1, 2)) / before.square().sum((1, 2))
        return moved[today].mean()

    def train_step(self) -> tuple[float, list[QA], list[bool]]:
        cfg = self.cfg
        stage = cfg.stages[self.stage_index]
        rng = np.random.default_rng((cfg.seed, self.step))
        if stage.mix and rng.random() < stage.mix:  # a step of an earlier stage's kind
            stage = cfg.stages[stage.mix_stage]
        seconds = int(rng.integers(stage.seconds[0], stage.seconds[1] + 1))
        base = TRAIN_SEEDS + (cfg.seed * 10**7 + self.step) * cfg.batch
        seeds = list(range(base, base + (stage.batch or cfg.batch)))
        batch = make_batch(self.builder, self.layout, cfg, seeds, seconds, stage.scenes,
                           stage.questions or cfg.questions, stage.forms)
        self.model.train()
        loss, hits = loss_and_hits(forward(self.model, batch, self.device), batch)
        if self.initial_lm:
            moved = sum((p - p0).square().sum() for p, p0 in self.initial_lm)
            loss = loss + cfg.lm_keep * moved / self.initial_lm_norm
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip)
        for group in self.optim.param_groups:
            group["lr"] = self.lr()
        self.optim.step()
        self.step += 1
        return loss.item(), batch.qas, hits

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Teacher-forced exact-match accuracy per form on fixed validation streams."""
        cfg = self.cfg
        self.model.eval()
        right: dict[str, list[bool]] = {f: [] for f in FORMS}
        options = cfg.stages[-1].scenes
        for first in range(0, cfg.validation_streams, cfg.batch):
            seeds = [VALIDATION_SEEDS + s for s in
                     range(first, min(first + cfg.batch, cfg.validation_streams))]
            batch = make_batch(self.builder, self.layout, cfg, seeds, cfg.validation_seconds,
                               options, cfg.questions)
            _, hits = loss_and_hits(forward(self.model, batch, self.device), batch)
            for qa, hit in zip(batch.qas, hits):
                right[qa.form].append(hit)
        scores = {f: float(np.mean(v)) for f, v in right.items() if v}
        targets = [scores[f] for f in ("colour", "shape", "seen") if f in scores]
        scores["target"] = float(np.mean(targets)) if targets else 0.0
        return scores

    def save(self) -> None:
        state = {"model": self.model.state_dict(), "optim": self.optim.state_dict(),
                 "step": self.step, "elapsed_s": self.elapsed_s, "best": self.best,
                 "history": self.history, "stage_index": self.stage_index,
                 "stage_start": self.stage_start, "vision_head": self.vision_head.state_dict(),
                 "vision_optim": self.vision_optim.state_dict(),
                 "vision_steps": self.vision_steps,
                 "config": asdict(self.cfg)}
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.out / "checkpoint.pt")

    def export(self, scores: dict[str, float], name: str = "model") -> Path:
        info = {"trained_steps": self.step, "trained_minutes": round(self.elapsed_s / 60, 1),
                "validation": scores, "train_config": asdict(self.cfg)}
        return export_model(self.model, self.tokenizer, self.out / name,
                            self.cfg.pixel_budget, info)

    def run(self) -> Path:
        """The vision phase, then the streams, to max_steps or max_minutes (a resumed run goes
        on where it stopped); the best model is in OUT/model."""
        cfg = self.cfg
        self.log(f"training from step {self.step} ({self.elapsed_s / 60:.1f} min done), "
                 f"{sum(p.numel() for p in self.model.parameters()):,} parameters, "
                 f"device {self.device}")
        self.clock = time.monotonic() - self.elapsed_s
        self.last_save = self.last_val = time.monotonic()
        with tqdm(total=cfg.vision_pretrain.steps + cfg.max_steps, unit="step",
                  initial=self.vision_steps + self.step, dynamic_ncols=True,
                  disable=None) as self.bar:  # a progress bar on a terminal only
            self._vision_phase()
            self._stream_phase()
        # the last weights too: validation streams are short, and a curriculum's last stage
        # (the hour's long streams) may not raise their score
        self.export(self._validate_and_export(), "final")
        self.save()
        self.log(f"done at step {self.step} after {self.elapsed_s / 60:.1f} min; best "
                 f"validation target accuracy {self.best:.3f}; model in {self.out / 'model'}, "
                 f"the last weights in {self.out / 'final'}")
        return self.out / "model"

    def _time_left(self) -> bool:
        self.elapsed_s = time.monotonic() - self.clock
        return self.elapsed_s < self.cfg.max_minutes * 60

    def _progress(self, what: str, losses: deque[float], window: dict[str, list[bool]]) -> None:
        """The bar's loss and running accuracy; a log line every log_every steps."""
        loss, accs = np.mean(losses), {
            name: f"{np.mean(hits):.2f}" for name, hits in window.items() if hits}
        self.bar.update()
        self.bar.set_postfix(loss=f"{loss:.3f}", **accs, refresh=False)
        steps = self.vision_steps if what == "vision" else self.step
        if steps % self.cfg.log_every == 0:
            self.log(f"{what} step {steps} {self.elapsed_s / 60:.1f}min loss {loss:.3f} acc "
                     + " ".join(f"{k}={v}" for k, v in accs.items()))
        if time.monotonic() - self.last_save > self.cfg.checkpoint_minutes * 60:
            self.save()
            self.last_save = time.monotonic()

    def _vision_phase(self) -> None:
        losses: deque[float] = deque(maxlen=self.cfg.log_every)
        window: dict[str, list[bool]] = {"shape": [], "colour": []}
        while self.vision_steps < self.cfg.vision_pretrain.steps and self._time_left():
            loss, *right = self.vision_step()
            losses.append(loss)
            for name, hits in zip(window, right):
                window[name] = (window[name] + hits)[-400:]
            self._progress("vision", losses, window)
        if losses and self.vision_steps == self.cfg.vision_pretrain.steps \
                and self.cfg.vision_pretrain.check:  # the phase ended in this process
            check = self.vision_check(self.cfg.vision_pretrain.check)
            self.log(f"vision check ({self.cfg.vision_pretrain.check} held-out chunks): "
                     + " ".join(f"{n}={a:.2f}" for kind in ("shape", "colour")
                                for n, a in check[kind].items())
                     + " confused " + " ".join(f"{k}:{v}" for k, v in check["confused"].items()))

    def _stream_phase(self) -> None:
        cfg = self.cfg
        losses: deque[float] = deque(maxlen=cfg.log_every)
        window: dict[str, list[bool]] = {f: [] for f in FORMS}
        while self.step < cfg.max_steps and self._time_left():
            loss, qas, hits = self.train_step()
            losses.append(loss)
            for qa, hit in zip(qas, hits):
                window[qa.form] = (window[qa.form] + [hit])[-200:]
            self._progress(f"stage {self.stage_index}", losses, window)
            if self._advance(window):
                window = {f: [] for f in FORMS}
            if time.monotonic() - self.last_val > cfg.validate_minutes * 60:
                self._validate_and_export()
                self.last_val = time.monotonic()

    def _advance(self, window: dict[str, list[bool]]) -> bool:
        """Move to the next stage when this one is learned or its last step has passed."""
        if self.stage_index + 1 >= len(self.cfg.stages):
            return False
        stage = self.cfg.stages[self.stage_index]
        target = [hit for form in TARGET_FORMS for hit in window[form]]
        learned = (self.step - self.stage_start >= stage.min_steps and len(target) >= 100
                   and float(np.mean(target)) >= stage.advance_at)
        if not learned and self.step < stage.until_step:
            return False
        self.stage_index += 1
        self.stage_start = self.step
        why = "learned" if learned else "its last step"
        self.log(f"stage {self.stage_index} from step {self.step} ({why})")
        return True

    def _validate_and_export(self) -> dict[str, float]:
        """Validate; export when better than the best so far. Returns the scores."""
        scores = self.validate()
        self.history.append({"step": self.step, "minutes": round(self.elapsed_s / 60, 1),
                             **scores})
        line = " ".join(f"{k}={v:.2f}" for k, v in scores.items())
        better = scores["target"] > self.best
        if better:
            self.best = scores["target"]
            self.export(scores)
        self.log(f"validation at step {self.step}: {line}{' (exported)' if better else ''}")
        return scores
