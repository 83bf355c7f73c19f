"""A training step's forward and backward with transformers' chunked gated delta kernel and
with training's (training/gated_delta.py), side by side on the same batches.

Why: the hour model's long stages spend most of their time in steps over 2-30 minute streams,
and the reference kernel's backward grows quadratically with the stream (one full-size zero
tensor per chunk read). This measures what training's kernel saves at each stream length, and
checks that both give the same loss and gradients.

How: the trainer of `--config` (its init weights), one batch per `--seconds` of the config's
`--stage` (its streams, questions and forms); per round each kernel once, in alternating order,
forward + backward timed by the wall clock; medians over `--rounds`, the ratio reference /
training, and the largest gradient difference.
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

KERNELS = {"reference": None, "training": chunk_gated_delta_rule}


def timed_step(trainer: Trainer, batch) -> tuple[float, float, list[torch.Tensor]]:
    """(seconds, loss, gradients) of one forward + backward."""
    trainer.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss, _ = loss_and_hits(forward(trainer.model, batch, trainer.device), batch)
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
            times: dict[str, list[float]] = {name: [] for name in KERNELS}
            losses, grads = {}, {}
            for round_ in range(args.rounds):
                order = list(KERNELS) if round_ % 2 == 0 else list(reversed(KERNELS))
                for name in order:
                    select_gated_delta_kernels(trainer.model, trainer.device, KERNELS[name])
                    elapsed, losses[name], grads[name] = timed_step(trainer, batch)
                    times[name].append(elapsed)
            gap = max(float((a - b).abs().max()) for a, b in
                      zip(grads["reference"], grads["training"]))
            rows.append({"seconds": seconds, "tokens": int(batch.streams[0].input_ids.numel()),
                         "reference_s": median(times["reference"]),
                         "training_s": median(times["training"]),
                         "ratio": median(times["reference"]) / median(times["training"]),
                         "loss_difference": abs(losses["reference"] - losses["training"]),
                         "largest_gradient_difference": gap, "times_s": times})
    results |= {"config": args.config, "stage": args.stage, "threads": args.threads,
                "rounds": args.rounds, "rows": rows}
    table = md_table(["stream", "tokens", "reference kernel", "training's kernel", "ratio",
                      "loss difference", "largest gradient difference"],
                     [[f"{r['seconds']} s", f"{r['tokens']:,}", f"{r['reference_s']:.2f} s",
                       f"{r['training_s']:.2f} s", f"{r['ratio']:.2f}x",
                       f"{r['loss_difference']:.1e}", f"{r['largest_gradient_difference']:.1e}"]
                      for r in rows])
    return finish(args.out, results, "A training step: the reference kernel against training's",
                  f"Forward + backward of one step (medians of {args.rounds} rounds, "
                  f"{args.threads} thread(s)):\n\n{table}\n")


if __name__ == "__main__":
    main()
