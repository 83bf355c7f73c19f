"""The busy world with full memory: does the model tell many objects apart over minutes?

Why: the sparse streams of bench/answers.py (at most three objects of distinct shapes) saturate;
a robot sees many things, of the same kinds, some again and again. Before any retention policy
can be judged there, the model must answer with everything kept.

How: held-out busy streams (scenes.BUSY with a fixed object count; seeds below
train.VALIDATION_SEEDS, never used in training or model selection; --validation: streams
kept for choosing a training's settings instead) of each --settings
OBJECTS:SECONDS (default 8 objects in 120 s and 12 in 300 s) run through `StreamingMemory`
chunk by chunk with no eviction, then are asked, per stream:
- "Did you see a <colour> <shape>?" about every object (seen: shown, the truth is yes) and, per
  object, about a pair that was never shown, sharing its shape or colour when one is left
  (seen: never shown, the truth is no); scored by the verdict;
- "What color was the <shape>?" for every shape in the stream and "Which shape was <colour>?"
  for every colour, reported apart where one object has it (unique) and where several do
  (shared: all of them, oldest first).
Answers are the model's greedy words, scored by questions.is_correct; 95 % Wilson intervals.
--hour: the hour world instead (scenes.HOUR with OBJECTS objects of its own in every 5-minute
part, 60 identities), asked only the hour's questions: "seen" about every object and a
never-shown control per object (the forms that list every match would list dozens).

    python -m bench.busy --streams 8 --out bench/results/busy
    python -m bench.busy --model OUT/model --streams 8 --out OUT/busy   # a training's export
    python -m bench.busy --hour --model OUT/model --streams 4 --settings 3:1800 --out OUT/hour

Honest limits: the question forms and scoring are the ones the model was trained on; a few
streams per setting give wide intervals (read them).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from deltas_ros.core.loader import (
    LoadedModel,
    resolve_pixel_budget,
)
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.training.palette import COLOURS, SHAPES, identities
from deltas_ros.training.questions import QA, TEMPLATES, answer_for, identities_of, is_correct
from deltas_ros.training.samples import TRAIN_SEEDS, VALIDATION_SEEDS, sampled_chunks
from deltas_ros.training.scenes import BUSY, HOUR, SceneStream

from .answers import wilson
from .common import add_answers_args, finish, md_table, memory_config, run_answers

KINDS = ("seen: shown", "seen: never shown", "colour: unique", "shape: unique",
         "colour: shared", "shape: shared")
NEAR_NEGATIVE = 0.7  # share of negatives that share the shape or colour of a shown object
# The busy world's validation streams (--validation): past the trainer's own (VALIDATION_SEEDS on).
BUSY_VALIDATION = VALIDATION_SEEDS + 100_000


def busy_questions(events: list[dict], seed: int, hour: bool = False) -> list[tuple[str, QA]]:
    """(kind, question) about one stream, as the module docstring lists them (`hour`: the hour
    world's identities and questions)."""
    rng = np.random.default_rng((seed, 13))
    objects = identities_of(events)
    shown = {(o["colour"], o["shape"]) for o in objects}
    colours, shapes = identities(hour)
    unseen = [(c, s) for c in colours for s in shapes if (c, s) not in shown]
    out: list[tuple[str, QA]] = []
    for colour, shape in sorted(shown, key=lambda p: (shapes.index(p[1]), p[0])):
        out.append(("seen: shown", ask_about("seen", events, colour, shape)))
    negatives = []
    for obj in objects:
        near = [p for p in unseen if p not in negatives
                and (p[0] == obj["colour"] or p[1] == obj["shape"])]
        rest = [p for p in unseen if p not in negatives]
        pool = near if near and rng.random() < NEAR_NEGATIVE else rest
        if pool:
            negatives.append(pool[int(rng.integers(len(pool)))])
    out += [("seen: never shown", ask_about("seen", events, c, s)) for c, s in negatives]
    if hour:
        return out
    for shape in sorted({s for _, s in shown}, key=SHAPES.index):
        many = sum(s == shape for _, s in shown) > 1
        kind = f"colour: {'shared' if many else 'unique'}"
        out.append((kind, ask_about("colour", events, "", shape)))
    for colour in sorted({c for c, _ in shown}, key=list(COLOURS).index):
        many = sum(c == colour for c, _ in shown) > 1
        kind = f"shape: {'shared' if many else 'unique'}"
        out.append((kind, ask_about("shape", events, colour, "")))
    return out


def ask_about(form: str, events: list[dict], colour: str, shape: str) -> QA:
    """One question of `form` about this colour and/or shape, with its true answer."""
    question = TEMPLATES[form].format(colour=colour, shape=shape)
    return QA(form, question, answer_for(form, events, colour=colour, shape=shape))


def parse_setting(text: str) -> tuple[int, int]:
    """ "8:120" -> (8 objects, 120 seconds)"""
    objects, seconds = (int(v) for v in text.split(":"))
    return objects, seconds


class BusyStream(NamedTuple):
    """One held-out busy stream, streamed whole into its memory."""

    objects: int
    seconds: int
    seed: int
    scene: SceneStream
    memory: StreamingMemory
    started: float  # perf_counter before the stream was made

    @property
    def setting(self) -> str:
        return f"{self.objects}:{self.seconds}"

    def log(self, detail: str = "") -> None:
        """The stream's progress line: which stream, `detail`, the seconds it took."""
        print(f"{self.objects} objects {self.seconds} s seed {self.seed}{detail} "
              f"({time.perf_counter() - self.started:.1f} s)", flush=True)


def stream_seeds(args: argparse.Namespace) -> range:
    """--streams seeds from --first-seed: held-out ones (below VALIDATION_SEEDS), or with
    --validation the busy world's validation streams (from BUSY_VALIDATION on, apart from the
    trainer's own validation streams and below every training seed), to choose a training's
    settings without looking at the held-out streams."""
    base = BUSY_VALIDATION if getattr(args, "validation", False) else 0
    seeds = range(base + args.first_seed, base + args.first_seed + args.streams)
    if seeds and not base <= seeds[0] <= seeds[-1] < (TRAIN_SEEDS if base else VALIDATION_SEEDS):
        raise ValueError(f"seeds {seeds[0]}-{seeds[-1]} leave the "
                         f"{'validation' if base else 'evaluation'} range")
    return seeds


def busy_streams(args: argparse.Namespace, loaded: LoadedModel,
                 config: MemoryConfig) -> Iterator[BusyStream]:
    """Each of --streams held-out busy streams per --settings OBJECTS:SECONDS, streamed chunk by
    chunk into a fresh memory of `config` (made as it is asked for: one at a time in memory)."""
    for objects, seconds in map(parse_setting, args.settings):
        options = replace(HOUR if getattr(args, "hour", False) else BUSY,
                          objects=(objects, objects))
        for seed in stream_seeds(args):
            started = time.perf_counter()
            scene = SceneStream(seconds, args.width, args.height, seed, options)
            memory = StreamingMemory(loaded, config)
            for frames, times in sampled_chunks(scene):
                memory.add_chunk(frames, times)
            yield BusyStream(objects, seconds, seed, scene, memory, started)


def evaluate(args: argparse.Namespace, loaded: LoadedModel, records_path: Path) -> None:
    pixel_budget = resolve_pixel_budget(args.pixel_budget, loaded.path)
    config = memory_config(args, budget_tokens=10**8, pixel_budget=pixel_budget,
                           max_new_tokens=args.max_new_tokens, evidence_candidates=0)
    with records_path.open("a") as out:
        for stream in busy_streams(args, loaded, config):
            asked = busy_questions(stream.scene.events(), stream.seed, args.hour)
            right = 0
            for kind, qa in asked:
                text = stream.memory.ask(qa.question).text
                correct = is_correct(qa, text)
                right += correct
                out.write(json.dumps({
                    "setting": stream.setting, "seed": stream.seed, "kind": kind,
                    "question": qa.question, "truth": qa.answer, "answer": text,
                    "correct": correct}) + "\n")
            out.flush()
            stream.log(f": {right}/{len(asked)}")


def aggregate(records: list[dict]) -> dict[str, dict[str, list[int]]]:
    """{setting: {kind: [hits, n]}}"""
    table: dict[str, dict[str, list[int]]] = {}
    for r in records:
        hits = table.setdefault(r["setting"], {}).setdefault(r["kind"], [0, 0])
        hits[0] += bool(r["correct"])
        hits[1] += 1
    return table


def _cell(hits: list[int] | None) -> str:
    if not hits:
        return "-"
    lo, hi = wilson(*hits)
    return f"{100 * hits[0] / hits[1]:.0f} ({100 * lo:.0f}-{100 * hi:.0f}, n={hits[1]})"


def report(table: dict[str, dict[str, list[int]]], records: list[dict]) -> str:
    settings = sorted(table, key=lambda s: tuple(map(int, s.split(":"))))
    streams = {s: len({r["seed"] for r in records if r["setting"] == s}) for s in settings}
    headers = ["question"] + [f"{s.split(':')[0]} objects, {s.split(':')[1]} s "
                              f"({streams[s]} streams)" for s in settings]
    rows = [[kind] + [_cell(table[s].get(kind)) for s in settings] for kind in KINDS]
    return ("Full memory, % correct (95 % Wilson interval, questions):\n\n"
            + md_table(headers, rows))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8, help="streams per setting")
    parser.add_argument("--settings", nargs="+", default=["8:120", "12:300"],
                        help="OBJECTS:SECONDS per setting")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--hour", action="store_true",
                        help="the hour world: OBJECTS objects of its own in every 5-min part")
    parser.add_argument("--validation", action="store_true",
                        help="validation streams instead of the held-out ones: for choosing a "
                             "training's settings")
    add_answers_args(parser)
    args, results, records, _ = run_answers("busy", parser, argv, evaluate)
    results["table"] = table = aggregate(records)
    world = "hour" if args.hour else "busy"
    kind = "validation" if args.validation else "held-out"
    title = (f"The {world} world with full memory: {Path(results['model']).name} on {kind} "
             f"{world} streams")
    return finish(args.out, results, title, report(table, records))


if __name__ == "__main__":
    main()
