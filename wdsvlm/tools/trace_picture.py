"""``wdsvlm trace``: a picture of a trace the Loader wrote (``Telemetry(trace=...)``, ``wdsvlm
bench --trace``): one lane per worker and one for the training process, each stretch of time
coloured by the stage the lane was in (for a worker the innermost stage: the one its seconds
are charged to), on a time axis in ms. For where Perfetto cannot be opened; matplotlib, Agg.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

from ..pipeline.timing import STAGES
from .arguments import common_options, positive

# The training process's stretches (``DataMeter``): waiting in next(loader), the Loader's own
# work in the training process, the model's step between batches.
TRAINING_STAGES = {"wait": "#d62728", "loader": "#9467bd", "step": "#c7c7c7"}
_WORKER_COLOURS = [
    "#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c",
    "#98df8a", "#8c564b", "#c49c94", "#e377c2", "#17becf",
]  # fmt: skip
_OTHER_COLOURS = ["#bcbd22", "#dbdb8d", "#7f7f7f", "#f7b6d2", "#9edae5"]
WIDTH, LANE = 1400, 36  # pixels: the picture is WIDTH x (150 + LANE x lanes)
_DPI = 100


def read_trace(path: str) -> tuple[list[dict], dict[tuple[int, int], tuple[int, str]]]:
    """A trace's complete events and its lanes: ``(pid, tid)`` -> ``(order, name)``, the
    training process first, then the workers (by the sort index its metadata gives)."""
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{path} is not a Chrome trace: no list of events ('traceEvents')")
    names: dict[tuple[int, int], str] = {}
    order: dict[int, int] = {}
    spans = []
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            names[event["pid"], event["tid"]] = event["args"]["name"]
        elif event.get("ph") == "M" and event.get("name") == "process_sort_index":
            order[event["pid"]] = event["args"]["sort_index"]
        elif event.get("ph") == "X":
            spans.append(event)
    lanes = {(e["pid"], e["tid"]) for e in spans}
    ranked = sorted(lanes, key=lambda lane: (order.get(lane[0], 1 << 30), lane))
    return spans, {
        lane: (i, names.get(lane, f"pid {lane[0]} thread {lane[1]}"))
        for i, lane in enumerate(ranked)
    }


def _colours(names: set[str]) -> dict[str, str]:
    """A fixed colour per stage (the same in every picture), in pipeline order, the training
    process's after them, then any other name."""
    known = dict(zip(STAGES, _WORKER_COLOURS, strict=False)) | TRAINING_STAGES
    others = sorted(names - set(known))
    repeated = _OTHER_COLOURS * (1 + len(others) // len(_OTHER_COLOURS))
    extra = dict(zip(others, repeated, strict=False))
    return {name: colour for name, colour in (known | extra).items() if name in names}


def _nesting(spans: list[dict]) -> tuple[list[int], list[float]]:
    """Each span's depth in its lane (0: outermost) and its own µs (less the spans it holds),
    spans sorted by lane, start, -length."""
    depths, own = [], [float(e["dur"]) for e in spans]
    holding: list[int] = []  # the spans open at this one's start, innermost last
    lane = None
    for i, e in enumerate(spans):
        if (e["pid"], e["tid"]) != lane:
            lane, holding = (e["pid"], e["tid"]), []
        # ended by this one's start, to the nanosecond (ts + dur in float µs is not exact)
        while holding and spans[holding[-1]]["ts"] + spans[holding[-1]]["dur"] <= e["ts"] + 1e-3:
            holding.pop()
        if holding:
            own[holding[-1]] -= e["dur"]
        depths.append(len(holding))
        holding.append(i)
    return depths, own


def _window(spans: list[dict], skip: int, steps: int | None) -> list[dict]:
    """The spans within the training process's steps ``skip`` to ``skip + steps`` (all from
    ``skip`` when ``steps`` is None), cut at the window's ends."""
    training = [e for e in spans if e.get("cat") == "training"]
    step = [e.get("args", {}).get("step", 0) for e in training]
    last = None if steps is None else skip + steps
    inside = [
        e for e, n in zip(training, step, strict=True) if n >= skip and (last is None or n < last)
    ]
    if not training or (skip == 0 and steps is None):
        return spans
    if not inside:
        raise ValueError(
            f"the trace's training process has no step {skip} (it has {max(step) + 1})"
        )
    begin = min(e["ts"] for e in inside) if skip else float("-inf")
    cut = max(e["ts"] + e["dur"] for e in inside) if steps is not None else float("inf")
    kept = []
    for e in spans:
        start, end = max(e["ts"], begin), min(e["ts"] + e["dur"], cut)
        if end > start or (start == e["ts"] and begin <= start < cut):
            kept.append({**e, "ts": start, "dur": max(0.0, end - start)})
    return kept


def trace_picture(path: str, out: str, steps: int | None = None, skip: int = 0) -> dict[str, Any]:
    """Draw the trace at ``path`` as a PNG at ``out``: the training process's steps from
    ``skip`` (0: the first, which holds the workers' start) on, ``steps`` of them if given;
    what was drawn (lanes, spans, milliseconds, each lane's own milliseconds per stage)."""
    from .pictures import pyplot

    plt = pyplot()
    spans, lanes = read_trace(path)
    if not spans:
        raise ValueError(f"{path}: the trace has no spans (complete events) to draw")
    spans = _window(spans, skip, steps)
    spans.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    colours = _colours({e["name"] for e in spans})
    bars: dict[tuple[int, str, int], list[tuple[float, float]]] = defaultdict(list)
    shown: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e, depth, own in zip(spans, *_nesting(spans), strict=True):
        row, name = lanes[e["pid"], e["tid"]]
        bars[row, e["name"], depth].append((e["ts"] / 1000, e["dur"] / 1000))
        shown[name][e["name"]] += own / 1000
    start = min(e["ts"] for e in spans) / 1000
    end = max(e["ts"] + e["dur"] for e in spans) / 1000
    fig, ax = plt.subplots(figsize=(WIDTH / _DPI, (150 + LANE * len(lanes)) / _DPI), dpi=_DPI)
    try:
        # an inner span is painted over the span that holds it: a worker's lane shows, at
        # each moment, the stage it was charging its time to
        for (row, name, depth), ranges in bars.items():
            ax.broken_barh(ranges, (row - 0.4, 0.8), facecolors=colours[name], zorder=2 + depth)
        ax.set_yticks(range(len(lanes)), [name for _, name in sorted(lanes.values())])
        ax.set_ylim(len(lanes) - 0.5, -0.5)  # the training process on top
        ax.set_xlim(start, end)
        ax.set_xlabel("ms from the trace's first event")
        ax.grid(axis="x", alpha=0.3, zorder=0)
        handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in colours]
        ax.legend(handles, list(colours), loc="upper left", bbox_to_anchor=(1.005, 1),
                  fontsize=8, frameon=False)  # fmt: skip
        ax.set_title(f"{path}: {len(spans)} spans over {end - start:.0f} ms", fontsize=10)
        fig.tight_layout()
        fig.savefig(out, dpi=_DPI)
    finally:
        plt.close(fig)
    return {
        "picture": out,
        "lanes": len(lanes),
        "spans": len(spans),
        "ms": end - start,
        "ms_per_lane": {  # in the picture's order
            name: dict(shown[name]) for _, name in sorted(lanes.values()) if name in shown
        },
    }


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``trace`` to the ``wdsvlm`` command's sub-parsers."""
    trace = commands.add_parser(
        "trace",
        help="draw a trace the Loader wrote (wdsvlm bench --trace) as a PNG",
        description="Draw a Chrome/Perfetto trace written by wdsvlm (Telemetry(trace=...), "
        "wdsvlm bench --trace): one lane per worker and one for the training process, each "
        "stretch coloured by its stage, time in ms. The same file opens in ui.perfetto.dev "
        "or chrome://tracing.",
    )
    trace.add_argument("file", metavar="FILE", help="the trace (JSON)")
    trace.add_argument("--out", required=True, metavar="PNG", help="write the picture here")
    trace.add_argument(
        "--steps",
        type=positive,
        metavar="N",
        help="draw N of the training process's steps only (default: the whole trace)",
    )
    trace.add_argument(
        "--skip",
        type=int,
        default=0,
        metavar="N",
        help="leave out its first N steps (the first step's wait holds the workers' start)",
    )
    common_options(trace)
    return trace
