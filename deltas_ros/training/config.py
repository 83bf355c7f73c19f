"""What a training run depends on: the config file's keys (`TrainConfig`), its curriculum stages
and the vision phase, read from YAML (config/train_tiny.yaml, config/train_busy.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .questions import FORMS, NUMBERS
from .scenes import SceneOptions

# A stage's streams where it sets none of the scene options: one or two objects, no cuts and no
# distractors.
STAGE_SCENES = SceneOptions(objects=(1, 2), cuts=(0, 0), distractors=(0, 0))
SCENE_KEYS = frozenset(f.name for f in fields(SceneOptions))


@dataclass
class Stage:
    """One curriculum stage (the last one runs to the end of training).

    until_step: the step at which the next stage starts at the latest
    seconds:    (min, max) length of its streams
    scenes:     what its streams show (scenes.SceneOptions); a config file sets these keys
                (objects, cuts, shared, extended, part_s, ...) flat in the stage
    batch, questions: streams a step and questions a stream (0: the config's; batch at most
                the config's, whose stride the stream seeds keep)
    forms:      question form weights of this stage (default: the config's)
    mix:        share of this stage's steps drawn as stage `mix_stage` draws them (short
                streams kept beside long ones)
    advance_at: running accuracy on the target forms that ends the stage early (> 1: never)
    min_steps:  steps in the stage before advance_at is looked at
    """

    until_step: int
    seconds: tuple[int, int] = (4, 8)
    scenes: SceneOptions = STAGE_SCENES
    batch: int = 0
    questions: int = 0
    forms: dict[str, float] | None = None
    mix: float = 0.0
    mix_stage: int = 0
    advance_at: float = 2.0
    min_steps: int = 100

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> Stage:
        """A stage from a config file's keys, its scene options among them (lists: tuples)."""
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        scenes = {k: values.pop(k) for k in list(values) if k in SCENE_KEYS}
        return cls(**values, scenes=replace(STAGE_SCENES, **scenes))


@dataclass
class VisionPretrain:
    """The vision tower's own first phase (0 steps: none)."""

    steps: int = 0
    batch: int = 32
    lr: float = 3e-3
    empty: float = 0.25  # share of chunks that show no object
    tied: bool = False  # classify against the words' input embeddings (VisionHead)
    # Steps that train the head alone, the tower frozen, before the tower moves: a random head's
    # gradients distort the features that a continued model's language model already reads.
    head_steps: int = 0
    # Weight of a loss that holds the tower's tokens for today's identities (and empty chunks)
    # where the tower the run started from put them (relative squared error), so that a
    # continuation learns new identities without moving what the language model reads.
    keep: float = 0.0
    # Held-out chunks the head classifies when the phase ends (train.log): which shapes and
    # colours the tower still mixes up, before the language model has to tell them apart.
    check: int = 512


@dataclass
class TrainConfig:
    """Everything a run depends on (config/train_tiny.yaml sets these)."""

    seed: int = 0
    batch: int = 8
    questions: int = 4
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.01
    warmup: int = 50
    decay_fraction: float = 0.3
    clip: float = 1.0
    max_steps: int = 100_000
    max_minutes: float = 60.0
    checkpoint_minutes: float = 5.0
    validate_minutes: float = 5.0
    validation_streams: int = 32
    validation_seconds: int = 20
    log_every: int = 20
    threads: int = 1
    width: int = 128
    height: int = 96
    pixel_budget: int = 8192
    forms: dict[str, float] = field(default_factory=lambda: {
        "colour": 3, "shape": 2, "seen": 3, "appeared": 1, "when": 1, "count": 1})
    text: dict[str, Any] = field(default_factory=dict)  # overrides of model_maker.TINY_TEXT
    vision: dict[str, Any] = field(default_factory=dict)  # overrides of model_maker.TINY_VISION
    stages: list[Stage] = field(default_factory=lambda: [Stage(10**9)])
    vision_pretrain: VisionPretrain = field(default_factory=VisionPretrain)
    # A model directory (`export_model`'s) whose weights the run starts from instead of a fresh
    # initialization: same sizes and the same tokenizer. Relative paths are from the package's
    # parent ("deltas_ros/models/scenes-tiny" is the shipped model wherever one runs).
    init: str = ""
    # Weight of a loss that holds the language model's layers (not its word rows) near the
    # init's (relative squared distance), so that a continuation keeps what they already read.
    lm_keep: float = 0.0

    @property
    def extended(self) -> bool:
        """Whether a stage draws the hour world's identities: then the tokenizer has their
        words (train.scene_tokenizer) and the vision phase their classes."""
        return any(stage.scenes.extended for stage in self.stages)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        import yaml

        raw = yaml.safe_load(Path(path).read_text()) or {}
        raw.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
        raw["stages"] = [Stage.from_mapping(s) for s in raw.get("stages", [])] or [Stage(10**9)]
        forms = raw.get("forms") or cls.__dataclass_fields__["forms"].default_factory()
        for index, stage in enumerate(raw["stages"]):
            if set(stage.forms or {}) - set(FORMS):
                raise ValueError(f"{path}: unknown question forms in {stage}")
            # the last stage's streams are also validated with the config's forms
            counted = (stage.forms or forms).get("count", 0) > 0 or \
                (index == len(raw["stages"]) - 1 and forms.get("count", 0) > 0)
            if counted and stage.scenes.objects[1] >= len(NUMBERS):
                raise ValueError(f"{path}: stage {index}: \"how many\" has words up to "
                                 f"{NUMBERS[-1]}, and its streams show up to "
                                 f"{stage.scenes.objects[1]} objects")
            if stage.batch > raw.get("batch", cls.batch) or not \
                    (stage.mix == 0 or 0 <= stage.mix_stage < index):
                raise ValueError(f"{path}: stage {index}: batch above the config's, or a mix "
                                 "with a stage that is not an earlier one")
        if "betas" in raw:
            raw["betas"] = tuple(raw["betas"])
        raw["vision_pretrain"] = VisionPretrain(**raw.get("vision_pretrain", {}))
        unknown_forms = set(raw.get("forms", {})) - set(FORMS)
        if unknown_forms:
            raise ValueError(f"{path}: unknown question forms {sorted(unknown_forms)}")
        return cls(**raw)

