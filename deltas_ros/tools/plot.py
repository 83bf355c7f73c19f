"""One PNG comparing offline runs: drift over stream time, and what each memory held at the end.

    deltas-ros run BAG --model M --policy deltas --out deltas.jsonl
    deltas-ros run BAG --model M --policy recency --out recency.csv
    deltas-ros plot deltas.jsonl recency.csv --out compare.png

Top panel: each run's drift per chunk, with the bag's known events shaded (objects) or marked
(cuts). Below it, one strip per run: the stream seen (grey) and the chunks still held in the KV
cache when the run ended (coloured; paler where only part of a chunk's tokens is left).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .offline import Results, read_results

MAX_EVENT_LABELS = 12


def plot_results(paths: Sequence[str | Path], out: str | Path = "plot.png") -> Path:
    """Write the comparison of the given results files to `out` (PNG); returns its path."""
    runs = [read_results(p) for p in paths]
    if not runs:
        raise ValueError("no results files to plot")
    labels = _labels(runs)
    figure = Figure(figsize=(9, 3.2 + 0.45 * len(runs)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1 + len(runs), 1, sharex=True,
                           gridspec_kw={"height_ratios": [5] + [1] * len(runs)})
    drift_ax, strips = axes[0], axes[1:]
    events = _events(runs)
    for ax in axes:
        _draw_events(ax, events, labelled=ax is drift_ax)
    for i, (run, label) in enumerate(zip(runs, labels)):
        colour = f"C{i}"
        times = [c["stream_time"] for c in run.chunks]
        drift_ax.plot(times, [c["drift"] for c in run.chunks], ".-", color=colour, label=label,
                      linewidth=1, markersize=3)
        _draw_held(strips[i], run, colour)
        strips[i].set_ylabel(label, rotation=0, ha="right", va="center", fontsize=8)
    drift_ax.set_ylabel("state drift")
    handles, _ = drift_ax.get_legend_handles_labels()
    if events:
        handles.append(Patch(color="0.85", label="known event"))
    drift_ax.legend(handles=handles, fontsize=8, loc="upper left")
    strips[-1].set_xlabel("stream time (s)")
    figure.suptitle(_title(runs), fontsize=10)
    out = Path(out)
    figure.savefig(out, dpi=100)
    return out


def _labels(runs: list[Results]) -> list[str]:
    """Policies name the runs; file names are added where two runs share a policy."""
    labels = [run.meta["policy"] for run in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({run.path.stem})" for label, run in zip(labels, runs)]
    return labels


def _title(runs: list[Results]) -> str:
    models = sorted({Path(run.meta["model"]).name for run in runs})
    budgets = sorted({run.meta["budget_tokens"] for run in runs})
    sources = sorted({Path(run.meta["source"]["path"]).name for run in runs})
    return (f"{', '.join(sources)} | model {', '.join(models)} | budget "
            f"{', '.join(map(str, budgets))} tokens")


def _events(runs: list[Results]) -> list[dict]:
    """The known events of all runs' sources, each once."""
    seen: dict[tuple, dict] = {}
    for run in runs:
        for event in run.meta.get("events") or []:
            seen.setdefault((event["time"], event["end"], event["label"]), event)
    return list(seen.values())


def _draw_events(ax, events: list[dict], labelled: bool = False) -> None:
    """Objects as shaded spans, cuts as dashed lines; labels only where they stay legible."""
    for event in events:
        if event["end"] > event["time"]:
            ax.axvspan(event["time"], event["end"], color="0.85", zorder=0)
        else:
            ax.axvline(event["time"], color="0.6", linestyle="--", linewidth=1, zorder=0)
        if labelled and len(events) <= MAX_EVENT_LABELS:
            ax.text(event["time"], 0.98, f" {event['label']}", transform=ax.get_xaxis_transform(),
                    fontsize=7, color="0.35", va="top")


def _draw_held(ax, run: Results, colour: str) -> None:
    """The stream seen as a grey bar, each chunk still held as a coloured one."""
    fps, frames = run.meta["fps"], run.meta["frames_per_chunk"]
    seconds = frames / fps
    # A chunk's stream time is the mean of its frames' times; it spans `seconds` from its first.
    offset = (frames - 1) / (2 * fps)
    if run.chunks:
        first, last = run.chunks[0]["stream_time"], run.chunks[-1]["stream_time"]
        ax.broken_barh([(first - offset, last - first + seconds)], (0, 1), color="0.9")
    summary = run.summary or {}
    sizes = {c["stream_time"]: c["chunk_tokens"] for c in run.chunks}
    for time, tokens in zip(summary.get("retained_times", []),
                            summary.get("retained_tokens", [])):
        held = min(1.0, tokens / sizes[time]) if sizes.get(time) else 1.0
        ax.broken_barh([(time - offset, seconds)], (0, 1), color=colour,
                       alpha=0.3 + 0.7 * held)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
