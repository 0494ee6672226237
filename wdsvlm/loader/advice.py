"""What to change when training waits for data: one line from the figures of ``metrics()``
(names under ``data/``), naming the share of time waited, the stage the workers spent most
of their time in, and the setting that helps. The Loader logs it when a window of steps
waits more than ``Telemetry.advice_wait``; ``wdsvlm bench`` prints it for its run.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..pipeline.timing import STAGES

# What each stage is, said to a user, and what helps when it dominates ("{more}": the
# num_workers advice, "num_workers 4 -> 8").
_STAGE_ADVICE = {
    "read": ("taking samples out of the shards", "{more}"),
    "read_wait": (
        "waiting for the store",
        "reading waits on the store: raise read_ahead, set cache_dir (a local copy of what "
        "is read again), or {more}",
    ),
    "shuffle": ("in the shuffle buffer", "a smaller shuffle_buffer, or {more}"),
    "map": ("in your map= function", "make map= cheaper, or {more}"),
    "tokenize": ("tokenizing", "{more}"),
    "pack": ("packing", "a smaller pack_window, or {more}"),
    "decode_image": (
        "decoding images",
        "{more}, or decode smaller images (max_image_side, the processor's sizes)",
    ),
    "image_map": ("in your image_map= function", "make image_map= cheaper, or {more}"),
    "decode_video": (
        "decoding video",
        "{more}, or decode fewer frames (fps, max_frames) or smaller ones",
    ),
    "collate": ("making the batches' tensors", "{more}"),
}
assert set(_STAGE_ADVICE) == set(STAGES), "advice for every stage of timing.STAGES"


def stage_shares(figures: Mapping[str, float]) -> dict[str, float]:
    """Each stage's share of the workers' seconds (``data/<stage>_s``), largest first."""
    seconds = {stage: figures.get(f"data/{stage}_s", 0.0) for stage in STAGES}
    total = sum(seconds.values())
    if total <= 0:
        return {}
    return dict(sorted(((k, v / total) for k, v in seconds.items()), key=lambda kv: -kv[1]))


def _more_workers(num_workers: int, ray: bool) -> str:
    if ray:
        return "more Ray workers (RayWorkers)"
    return f"num_workers {num_workers} -> {2 * num_workers}"


def diagnose(
    figures: Mapping[str, float],
    num_workers: int,
    waiting: float | None,
    advice_wait: float = 0.10,
    ray: bool = False,
) -> str | None:
    """One line of advice from ``figures`` (a ``metrics()`` dict, or a window of it), or None.

    ``waiting``: the share of the steps' time spent waiting for batches
    (``data/wait_fraction``). At or under ``advice_wait`` there is nothing to say (None),
    unless the Loader's own work in the training process (``data/loader_s``: pinning, copies,
    ``model_inputs``) alone takes more than that share. ``waiting=None`` (``wdsvlm bench``,
    which has no model step): judged by the workers' stage shares only, the line names the
    stage that dominates and what helps, without a share of time waited.
    ``num_workers``: the Loader's (0: the pipeline runs in the training process); ``ray``:
    the workers are Ray actors.
    """
    shares = stage_shares(figures)
    more = _more_workers(num_workers, ray)
    if waiting is None:
        prefix = ""
    else:
        wall = sum(figures.get(k, 0.0) for k in ("data/wait_s", "data/loader_s", "data/step_s"))
        own = figures.get("data/loader_s", 0.0) / wall if wall > 0 else 0.0
        steps = int(figures.get("data/steps", 0))
        if own > advice_wait and own > waiting:
            return (
                f"the Loader's own work in the training process took {own:.0%} of the last "
                f"{steps} steps (handing batches over, pin_memory copies, model_inputs): "
                "move work into the workers (map=, collate), or pin_memory=False if the "
                "copies are not needed"
            )
        if waiting <= advice_wait:
            return None
        prefix = f"waited {waiting:.0%} of the last {steps} steps; "
    if not num_workers and not ray:
        stage = f" ({dominant(shares)})" if shares else ""
        return (
            f"{prefix}the pipeline runs in the training process (num_workers=0){stage}: "
            "num_workers 0 -> 4 (or the cores to spare)"
        )
    if not shares:
        return f"{prefix}the workers' stages are not known (telemetry off): {more}"
    stage, share = next(iter(shares.items()))
    words, change = _STAGE_ADVICE[stage]
    return f"{prefix}the workers spent {share:.0%} {words}: {change.format(more=more)}"


def dominant(shares: Mapping[str, float]) -> str:
    """``"71% decoding video"``: the first of ``shares`` in words."""
    stage, share = next(iter(shares.items()))
    return f"{share:.0%} {_STAGE_ADVICE[stage][0]}"
