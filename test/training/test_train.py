"""Training: samples laid out exactly as the memory feeds a stream, a run that trains, checkpoints,
exports a loadable model and resumes to the same weights."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from deltas_ros.core.chunks import ChunkBuilder
from deltas_ros.core.kernels import gated_delta_forward, linear_attention_modules
from deltas_ros.core.loader import LoadedModel, load_model, resolve_pixel_budget
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.prompt import ChatLayout
from deltas_ros.tools.cli import main
from deltas_ros.training.config import Stage, TrainConfig, VisionPretrain
from deltas_ros.training.gated_delta import chunk_gated_delta_rule
from deltas_ros.training.palette import COLOURS, SHAPES
from deltas_ros.training.samples import (
    VISION_CHECK_SEEDS,
    VISION_SEEDS,
    forward,
    make_batch,
    qa_ids,
    sampled_chunks,
    stream_input,
    vision_sample,
)
from deltas_ros.training.scenes import SceneStream
from deltas_ros.training.train import Trainer, new_model, scene_tokenizer
from deltas_ros.training.vocabulary import check_extends

TINY = dict(batch=2, questions=3, warmup=1, validation_streams=2, validation_seconds=4,
            log_every=1, width=64, height=48, pixel_budget=4096, max_minutes=600,
            checkpoint_minutes=600, validate_minutes=600, decay_fraction=0.0,
            stages=[Stage(10**9, seconds=(2, 4))],
            vision_pretrain=VisionPretrain(steps=2, batch=2, check=4))


@pytest.fixture(scope="module")
def scene_model():
    from deltas_ros.core.kernels import select_gated_delta_kernels

    tokenizer = scene_tokenizer()
    model = new_model(TrainConfig(**TINY), tokenizer).eval().requires_grad_(False)
    select_gated_delta_kernels(model, torch.device("cpu"))
    return LoadedModel(model, tokenizer, Path("scene"), torch.device("cpu"), torch.float32, False)


def test_sample_is_what_the_memory_feeds(scene_model):
    """Same token ids and 3-D positions as StreamingMemory's cache slots, the question at the
    memory's next position, and the answer logits of the training forward equal those of the
    memory's own prefill of that question."""
    cfg = TrainConfig(**TINY)
    tokenizer = scene_model.tokenizer
    builder = ChunkBuilder.for_model(scene_model.model, tokenizer, cfg.pixel_budget)
    layout = ChatLayout.from_tokenizer(tokenizer)
    options = cfg.stages[0].scenes
    batch = make_batch(builder, layout, cfg, [3, 4], 4, options, cfg.questions)
    with torch.no_grad():
        logits = forward(scene_model.model, batch, torch.device("cpu"))

    stream = batch.streams[1]
    for row in range(cfg.questions, 2 * cfg.questions):  # the questions about stream 1
        memory = StreamingMemory(scene_model, MemoryConfig(
            budget_tokens=10**6, window_tokens=8, pixel_budget=cfg.pixel_budget))
        chunks = sampled_chunks(SceneStream(4, cfg.width, cfg.height, 4, options))
        for frames, times in chunks:
            memory.add_chunk(frames, times)
        assert torch.equal(memory.slots.position, stream.positions)
        assert memory.next_position == stream.next_position
        assert torch.equal(stream.input_ids,
                           stream_input(memory.builder, memory.layout, chunks).input_ids)
        ids, start = qa_ids(tokenizer, layout, batch.qas[row])
        # The memory's question layout, at the memory's next position.
        assert memory.layout.question_ids(tokenizer, batch.qas[row].question) == ids[:start]
        first = memory.next_position
        assert first == stream.next_position
        with torch.inference_mode():
            hidden = memory.backend.prefill_text(
                torch.tensor([ids]), torch.arange(first, first + len(ids)).expand(3, 1, -1))
            expected = scene_model.model.lm_head(hidden)[0]
        torch.testing.assert_close(logits[row, :len(ids)], expected, atol=2e-5, rtol=1e-4)


def test_vision_samples_are_labelled_with_what_their_chunk_shows(scene_model):
    """The vision phase's labels: the shape and colour of the one object in both frames of the
    chunk, or "nothing" (one past the last index) when no object is in view; both occur."""
    cfg = TrainConfig(**TINY)
    builder = ChunkBuilder.for_model(scene_model.model, scene_model.tokenizer, cfg.pixel_budget)
    labels = []
    for seed in range(VISION_SEEDS, VISION_SEEDS + 24):
        pixels, grid, shape, colour = vision_sample(builder, cfg, seed)
        assert pixels.shape[0] == int(grid.prod()) and grid[0, 0] == 1  # one chunk
        scene = SceneStream(4, cfg.width, cfg.height, seed, replace(cfg.stages[-1].scenes,
                                                                    objects=(1, 1)))
        shown = scene.labels[0]
        labels.append((shape, colour))
        assert (shape, colour) in {(len(SHAPES), len(COLOURS)),
                                   (SHAPES.index(shown[1]), list(COLOURS).index(shown[0]))}
    assert (len(SHAPES), len(COLOURS)) in labels and len(set(labels)) > 1


@pytest.mark.parametrize("tied", [False, True])
def test_the_vision_phase_trains_the_tower_and_only_tied_the_words(tmp_path, tied):
    """A vision step changes the vision tower; tied, also the input embeddings of the words
    it classifies against (the spaced " circle" ... " red" the questions use), and no other."""
    cfg = TrainConfig(**TINY | {"vision_pretrain": VisionPretrain(steps=1, batch=4, tied=tied)})
    trainer = Trainer(cfg, tmp_path / "run")
    embeddings = trainer.model.model.language_model.embed_tokens.weight
    before = embeddings.detach().clone()
    patch = trainer.model.model.visual.patch_embed.proj.weight.detach().clone()
    trainer.vision_step()
    assert not torch.equal(patch, trainer.model.model.visual.patch_embed.proj.weight)
    changed = (before != embeddings.detach()).any(1).nonzero().flatten().tolist()
    words = sorted(trainer.tokenizer.convert_tokens_to_ids(f" {w}") for w in (*SHAPES, *COLOURS))
    assert changed == (words if tied else [])


def test_the_vision_check_scores_each_class_and_counts_confusions(tmp_path):
    """A head that always says "circle" and "no colour": circle's accuracy is 1, every other
    shape's 0, and each chunk of another shape or with a colour is counted as a confusion;
    the phase logs the check when it ends."""
    trainer = Trainer(TrainConfig(**TINY), tmp_path)
    samples = [vision_sample(trainer.builder, trainer.cfg, VISION_CHECK_SEEDS + i)
               for i in range(6)]
    trainer.vision_head = lambda pooled: (
        torch.eye(len(SHAPES) + 1)[[0] * len(pooled)],
        torch.eye(len(COLOURS) + 1)[[len(COLOURS)] * len(pooled)])
    check = trainer.vision_check(6)
    shapes, colours = {SHAPES[s[2]] if s[2] < len(SHAPES) else "none" for s in samples}, \
        {[*COLOURS, "none"][s[3]] for s in samples}
    assert check["shape"] == {n: float(n == SHAPES[0]) for n in [*SHAPES, "none"] if n in shapes}
    assert check["colour"] == {n: float(n == "none") for n in [*COLOURS, "none"]
                               if n in colours}
    assert sum(check["confused"].values()) == sum(s[2] != 0 for s in samples) + \
        sum(s[3] != len(COLOURS) for s in samples)
    Trainer(TrainConfig(**TINY, max_steps=1), tmp_path / "run").run()
    assert "vision check (4 held-out chunks): circle=" in (tmp_path / "run" / "train.log"
                                                            ).read_text()


def test_the_head_learns_alone_first_and_keep_holds_todays_identities(tmp_path):
    """During `head_steps` only the head moves; after them the tower does too, and `keep` adds
    how far the tower moved the tokens of today's identities and of empty chunks, not of the
    hour world's new ones."""
    vision = VisionPretrain(steps=2, batch=4, head_steps=1, keep=1.0)
    hour = [Stage.from_mapping({"until_step": 10**9, "seconds": [2, 4], "extended": True})]
    cfg = TrainConfig(**TINY | {"vision_pretrain": vision, "stages": hour})
    trainer = Trainer(cfg, tmp_path / "run")
    tower = trainer.model.model.visual
    patch, head = (m.weight.detach().clone()
                   for m in (tower.patch_embed.proj, trainer.vision_head.linear))
    moved, calls = trainer._moved, []
    trainer._moved = lambda *args: calls.append(args) or moved(*args) + 100.0  # seen in the loss
    trainer.vision_step()
    assert torch.equal(patch, tower.patch_embed.proj.weight) and not calls
    assert not torch.equal(head, trainer.vision_head.linear.weight)
    samples = [vision_sample(trainer.builder, trainer.cfg, VISION_SEEDS + s) for s in range(4)]
    pixels, grids = (torch.cat([s[i] for s in samples]) for i in (0, 1))
    tokens = tower(pixels, grid_thw=grids).pooler_output.view(4, -1, tower.config.out_hidden_size)
    today = torch.tensor([0, 1, 5, 2]), torch.tensor([0, 7, 12, 3])  # 5 and 12: nothing shown
    assert moved(pixels, grids, tokens, *today) == 0  # not moved yet
    assert trainer.vision_step()[0] > 100 and len(calls) == 1  # keep * moved joins the loss
    del trainer._moved
    assert not torch.equal(patch, tower.patch_embed.proj.weight)
    tokens = tower(pixels, grid_thw=grids).pooler_output.view_as(tokens)
    assert trainer._moved(pixels, grids, tokens, *today) > 0
    new = torch.tensor([3, 4, 0, 1]), torch.tensor([0, 1, 8, 11])  # diamond, cross; purple, teal
    assert trainer._moved(pixels, grids, tokens, *new) == 0


def test_train_checkpoint_export_and_resume(tmp_path):
    """Two steps (after the vision phase's two), resumed for a third, give the weights of three
    steps straight; the exported model loads through from_pretrained and carries its pixel
    budget."""
    straight = Trainer(TrainConfig(**TINY, max_steps=3), tmp_path / "straight")
    straight.run()
    first = Trainer(TrainConfig(**TINY, max_steps=2), tmp_path / "resumed")
    first.run()
    with pytest.raises(FileExistsError):
        Trainer(TrainConfig(**TINY, max_steps=3), tmp_path / "resumed")
    resumed = Trainer(TrainConfig(**TINY, max_steps=3), tmp_path / "resumed", resume=True)
    assert resumed.step == 2 and resumed.vision_steps == 2  # the vision phase is not redone
    resumed.run()
    assert resumed.step == 3
    # its Gated DeltaNet layers run training's scan (linear backward), not transformers'
    deltanets = linear_attention_modules(resumed.model)
    scan = gated_delta_forward(False, chunk_gated_delta_rule)
    assert deltanets and all(m.forward.__func__ is scan for m in deltanets)
    for (name, a), b in zip(straight.model.state_dict().items(),
                            resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    assert "loss" in (tmp_path / "resumed" / "train.log").read_text()
    exported = tmp_path / "resumed" / "model"
    final = load_model(tmp_path / "resumed" / "final", "cpu")  # the last weights
    for (name, a), b in zip(resumed.model.state_dict().items(),
                            final.model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    loaded = load_model(exported, "cpu")
    assert resolve_pixel_budget(0, exported) == TINY["pixel_budget"]
    assert loaded.model.config.text_config.layer_types.count("full_attention") == 2
    # `deltas-ros train --export NAME` writes the checkpoint's weights and trains nothing
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(
        {**{k: v for k, v in TINY.items() if k not in ("stages", "vision_pretrain")},
         "stages": [{"until_step": 10**9, "seconds": [2, 4]}],
         "vision_pretrain": {"steps": 2, "batch": 2}}))
    command = ["train", "--config", str(config), "--out", str(tmp_path / "resumed")]
    assert main([*command, "--export", "snapshot"]) == 0
    snapshot = load_model(tmp_path / "resumed" / "snapshot", "cpu")
    for (name, a), b in zip(resumed.model.state_dict().items(),
                            snapshot.model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)["step"] == 3
    command[-1] = str(tmp_path / "never")
    assert main([*command, "--export", "snapshot"]) == 2  # nothing to export: a clear error


def test_busy_config_continues_a_model_and_resumes(tmp_path):
    """config/train_busy.yaml loads, continues the sparse run's export (here the shipped model
    stands in for it) on busy streams rather than a fresh initialization, and two steps resumed
    for a third equal three straight."""
    from deltas_ros.core.loader import SHIPPED_MODEL

    root = Path(__file__).parents[2]
    short = [replace(s, seconds=(2, 3)) for s in
             TrainConfig.from_file(root / "config/train_busy.yaml").stages]
    assert TrainConfig.from_file(root / "config/train_busy.yaml").init == "out/train/model"
    cfg = TrainConfig.from_file(root / "config/train_busy.yaml", batch=2, questions=2,
                                validation_streams=2, validation_seconds=3,
                                init=str(SHIPPED_MODEL))
    assert all(s.scenes.busy for s in short) and cfg.vision_pretrain.steps == 0
    cfg = replace(cfg, stages=short)
    shipped = load_model(SHIPPED_MODEL, "cpu").model.state_dict()
    for name, weights in Trainer(cfg, tmp_path / "init").model.state_dict().items():
        torch.testing.assert_close(weights, shipped[name], msg=name)
    _resumed_equals_straight(cfg, tmp_path, 3)


def _resumed_equals_straight(cfg: TrainConfig, tmp_path: Path, steps: int) -> Trainer:
    """Runs `steps` steps straight, and `steps` - 1 then one more resumed; the same weights.
    Returns the straight run."""
    straight = Trainer(replace(cfg, max_steps=steps), tmp_path / "straight")
    straight.run()
    Trainer(replace(cfg, max_steps=steps - 1), tmp_path / "resumed").run()
    resumed = Trainer(replace(cfg, max_steps=steps), tmp_path / "resumed", resume=True)
    resumed.run()
    for (name, a), b in zip(straight.model.state_dict().items(),
                            resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    return straight


def test_the_hour_worlds_words_extend_the_shipped_model(tmp_path):
    """With the hour world's words the shipped model still loads as the start of a run: every
    word keeps its id and its rows (embedding and output head), every other weight is copied,
    and each new word starts near the mean of its class, apart from the other new words. A
    vocabulary that moves a word is refused."""
    from deltas_ros.core.loader import SHIPPED_MODEL
    from deltas_ros.training.questions import MORE_WORDS
    from deltas_ros.training.train import load_init

    shipped = load_model(SHIPPED_MODEL, "cpu", "float32")
    old = shipped.tokenizer.get_vocab()
    tokenizer = scene_tokenizer(extended=True)
    new = tokenizer.get_vocab()
    assert scene_tokenizer().get_vocab() == old
    assert all(new[t] == i for t, i in old.items())
    added = sorted(new.values())[len(old):]
    assert added == list(range(len(old), len(old) + 2 * len(MORE_WORDS)))
    assert len(tokenizer.encode("Did you see a teal cross?", add_special_tokens=False)) == 7
    cfg = TrainConfig(**TINY | {"vision": {"hidden_size": 64, "intermediate_size": 128},
                                "init": str(SHIPPED_MODEL),
                                "stages": [Stage.from_mapping({"until_step": 10**9,
                                                               "seconds": (2, 4),
                                                               "extended": True})]})
    assert cfg.extended
    model = new_model(cfg, tokenizer)
    before = shipped.model.state_dict()
    for name, weights in model.state_dict().items():
        if before[name].shape == weights.shape:
            torch.testing.assert_close(weights, before[name], msg=name)
            continue
        torch.testing.assert_close(weights[:len(old)], before[name], msg=name)
        rows = before[name]
        for word, members in (("purple", COLOURS), ("cross", SHAPES)):
            for space in ("", " "):
                trained = rows[[old[space + w] for w in members]]
                spread = (trained - trained.mean(0)).norm(dim=1).mean()
                assert (weights[new[space + word]] - trained.mean(0)).norm() < 0.5 * spread
        assert not torch.equal(weights[new[" purple"]], weights[new[" pink"]])
    moved = dict(new)
    moved["red"], moved["purple"] = new["purple"], new["red"]
    with pytest.raises(ValueError):
        check_extends(old, moved)
    with pytest.raises(ValueError):
        load_init(new_model(replace(cfg, init=""), scene_tokenizer()), scene_tokenizer(True),
                  SHIPPED_MODEL)


def test_hour_config_continues_the_shipped_model_and_resumes(tmp_path):
    """config/train_hour.yaml loads and continues the shipped model with the hour world's words;
    its last stage draws scenes.HOUR's streams and half its steps from today's busy world; a run
    through every stage (streams shortened) resumed for its last step equals one straight."""
    from deltas_ros.training.scenes import HOUR

    root = Path(__file__).parents[2]
    cfg = TrainConfig.from_file(root / "config/train_hour.yaml", batch=2, questions=2,
                                validation_streams=2, validation_seconds=3, log_every=1)
    assert cfg.extended and cfg.init == "deltas_ros/models/scenes-tiny"
    last = cfg.stages[-1]
    assert replace(last.scenes, objects=HOUR.objects) == HOUR and last.mix == 0.5
    assert not cfg.stages[last.mix_stage].scenes.extended  # the shipped model's world
    stages = [replace(s, seconds=(2, 3), until_step=k + 1, batch=min(s.batch, 2),
                      questions=min(s.questions, 2)) for k, s in enumerate(cfg.stages)]
    cfg = replace(cfg, stages=stages, vision_pretrain=VisionPretrain(steps=1, batch=2),
                  decay_fraction=0.0)  # the same rates whichever max_steps
    straight = _resumed_equals_straight(cfg, tmp_path, 5)
    assert straight.vision_head.linear.out_features == 5 + 1 + 12 + 1
    assert straight.stage_index == len(stages) - 1
    with pytest.raises(ValueError):
        TrainConfig.from_file(root / "config/train_hour.yaml", batch=1)  # below a stage's
    many = tmp_path / "many.yaml"  # "how many" asked of more objects than it has words for
    many.write_text("stages: [{until_step: 1, objects: [1, 20], shared: true}]\n")
    with pytest.raises(ValueError, match="up to twelve"):
        TrainConfig.from_file(many)
    many.write_text("stages: [{until_step: 1, objects: [1, 12], shared: true}]\n")
    assert TrainConfig.from_file(many).stages[0].scenes.objects == (1, 12)


def test_lm_keep_holds_the_language_models_layers_near_the_init(tmp_path):
    """`lm_keep` adds how far the language model's layers moved from the init's (relative
    squared distance) to a step's loss; its word rows are free, and a resumed run measures from
    the init, not from its checkpoint."""
    plain = Trainer(TrainConfig(**TINY), tmp_path / "plain")
    held = Trainer(TrainConfig(**TINY, lm_keep=1000.0), tmp_path / "held")
    layers = {n: p.detach().clone() for n, p in
              held.model.model.language_model.named_parameters() if "embed" not in n}
    for trainer in (plain, held):
        lm = trainer.model.model.language_model
        with torch.no_grad():
            lm.layers[0].mlp.down_proj.weight.add_(0.1)
            lm.embed_tokens.weight.add_(1.0)  # word rows: not held
    moved = 0.01 * lm.layers[0].mlp.down_proj.weight.numel()
    expected = 1000.0 * moved / sum(float(p.square().sum()) for p in layers.values())
    assert held.train_step()[0] - plain.train_step()[0] == pytest.approx(expected, rel=1e-3)
    held.save()
    resumed = Trainer(TrainConfig(**TINY, lm_keep=1000.0), tmp_path / "held", resume=True)
    initial = dict(zip(layers, (p0 for _, p0 in resumed.initial_lm)))
    assert all(torch.equal(initial[n], layers[n]) for n in layers)
