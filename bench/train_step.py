"""A training step's forward and backward three ways, side by side on the same batches: the
reference (transformers' chunked gated delta kernel, the stream's cache repeated for each
question), with training's kernel (training/gated_delta.py), and as training runs (that kernel,
and the questions sharing the stream's K/V: training/cache.py).

Why: the hour model's long stages spend most of their time in steps over 2-30 minute streams.
The reference kernel's backward grows with the square of the stream (one full-size zero tensor
per chunk read), and 32 questions each copying a 30-minute stream's K/V took half of what was
left. This measures what each change saves at each stream length, and checks that all three
give the same loss and gradients.

How: the trainer of `--config` (its init weights), one batch per `--seconds` of the config's
`--stage` (its streams, questions and forms); per round each way once, in rotating order,
forward + backward timed by the wall clock; medians over `--rounds`, each way's ratio to the
reference, and the largest loss and gradient differences from it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch

from deltas_ros.core.kernels import select_gated_delta_kernels
from deltas_ros.training.config import TrainConfig
from deltas_ros.training.gated_delta import chunk_gated_delta_rule
from deltas_ros.training.samples import forward, loss_and_hits, make_batch
from deltas_ros.training.train import Trainer

from .common import finish, md_table, median, parse, start_results

# name -> (the chunked kernel, or None for transformers'; whether the questions share the stream)
WAYS = {"reference": (None, False), "kernel": (chunk_gated_delta_rule, False),
        "training": (chunk_gated_delta_rule, True)}


def timed_step(trainer: Trainer, batch, shared: bool) -> tuple[float, float, list[torch.Tensor]]:
    """(seconds, loss, gradients) of one forward + backward."""
    trainer.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss, _ = loss_and_hits(forward(trainer.model, batch, trainer.device, shared), batch)
    loss.backward()
    elapsed = time.perf_counter() - start
    return elapsed, loss.item(), [p.grad.clone() for p in trainer.model.parameters()
                                  if p.grad is not None]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="config/train_hour.yaml", help="training config")
    parser.add_argument("--stage", type=int, default=-1, help="whose streams (default: last)")
    parser.add_argument("--seconds", type=int, nargs="+", default=[120, 600, 1800])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args, argv = parse(parser, argv)
    results = start_results("train_step", argv)
    cfg = TrainConfig.from_file(args.config, threads=args.threads)
    stage = cfg.stages[args.stage]
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, out)
        rows = []
        for seconds in args.seconds:
            batch = make_batch(trainer.builder, trainer.layout, cfg,
                               list(range(stage.batch or cfg.batch)), seconds, stage.scenes,
                               stage.questions or cfg.questions, stage.forms)
            times: dict[str, list[float]] = {name: [] for name in WAYS}
            losses, grads = {}, {}
            names = list(WAYS)
            for round_ in range(args.rounds):
                for name in names[round_ % 3:] + names[:round_ % 3]:
                    kernel, shared = WAYS[name]
                    select_gated_delta_kernels(trainer.model, trainer.device, kernel)
                    elapsed, losses[name], grads[name] = timed_step(trainer, batch, shared)
                    times[name].append(elapsed)
            row = {"seconds": seconds, "tokens": int(batch.streams[0].input_ids.numel()),
                   "times_s": times}
            for name in WAYS:
                row[f"{name}_s"] = median(times[name])
                row[f"{name}_ratio"] = median(times["reference"]) / median(times[name])
                row[f"{name}_loss_difference"] = abs(losses[name] - losses["reference"])
                row[f"{name}_largest_gradient_difference"] = max(
                    float((a - b).abs().max()) for a, b in zip(grads[name], grads["reference"]))
            rows.append(row)
    results |= {"config": args.config, "stage": args.stage, "threads": args.threads,
                "rounds": args.rounds, "rows": rows}
    table = md_table(["stream", "tokens", "reference", "training's kernel", "as training runs",
                      "largest loss / gradient difference"],
                     [[f"{r['seconds']} s", f"{r['tokens']:,}", f"{r['reference_s']:.2f} s",
                       f"{r['kernel_s']:.2f} s ({r['kernel_ratio']:.2f}x)",
                       f"{r['training_s']:.2f} s ({r['training_ratio']:.2f}x)",
                       f"{max(r[f'{n}_loss_difference'] for n in WAYS):.1e} / "
                       f"{max(r[f'{n}_largest_gradient_difference'] for n in WAYS):.1e}"]
                      for r in rows])
    return finish(args.out, results, "A training step three ways",
                  f"Forward + backward of one step (medians of {args.rounds} rounds, "
                  f"{args.threads} thread(s); in brackets: speed against the reference):"
                  f"\n\n{table}\n")


if __name__ == "__main__":
    main()
