"""The figures of ``Loader.metrics()``: their names (all under ``data/``) and how each is made
from the running totals of ``telemetry.DataMeter``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..pipeline.timing import STAGES

# a worker report's request figures (``skips["requests"][source]``) and their names here
REQUESTS = {
    "requests": "data/requests",
    "bytes": "data/bytes_read",
    "seconds": "data/store_s",
    "throttled": "data/throttled",
    "retries": "data/retries",
    "cache_hits": "data/cache_hits",
}
STAGE_KEYS = {stage: f"data/{stage}_s" for stage in STAGES}
# the training process's totals: under their figures' names, and counts figures come from
CONSUMER = ("data/wait_s", "data/loader_s", "data/step_s", "data/steps")
COUNTS = ("samples", "tokens", "supervised", "positions", "ready", "ready_asks")


def figures(
    since: Mapping[str, float],
    waits: list[float] | None,
    max_wait: float,
    workers: bool,
    ray: bool,
) -> dict[str, float]:
    """The figures of an interval from ``since``, the totals' increase over it (the names of
    ``CONSUMER``, ``COUNTS`` and the workers' figures), ``waits`` (its steps' waits, for the
    percentiles; None: none given) and ``max_wait``; with the workers' figures if
    ``workers`` (telemetry on); without ``batches_ready`` if ``ray``. All under ``data/``:

    - ``steps``; ``wait_s`` (seconds the steps waited for their batches, in all),
      ``wait_mean_s``, ``wait_p50_s``, ``wait_p95_s``, ``wait_max_s``; ``loader_s`` (the
      Loader's own work in the training process, in all), ``step_s`` (the time between
      handing a batch over and asking for the next: the model's steps, in all);
      ``wait_fraction``: ``wait_s / (wait_s + loader_s + step_s)``;
    - ``samples_per_s``, ``tokens_per_s`` (real tokens), ``supervised_tokens_per_s`` (labels
      not ignored), over that same time; ``padding``: the share of the batches' positions
      that are padding;
    - ``batches_ready``: the batches the workers had made and the DataLoader held for the
      training process when a step asked, on average (how far ahead the workers are; 0
      without workers; not measured on Ray);
    - with telemetry on, from the workers' reports: ``<stage>_s`` for each stage of
      ``pipeline.timing.STAGES`` (seconds, all workers added), ``requests``, ``bytes_read``,
      ``store_s`` (the store's requests' seconds), ``throttled``, ``retries``,
      ``cache_hits``; ``skipped`` and ``skipped/<reason>`` (samples).
    """
    wait, own, step, steps = (since[k] for k in CONSUMER)
    wall = wait + own + step

    def rate(count: float) -> float:
        return count / wall if wall > 0 else 0.0

    out = {
        "data/steps": steps,
        "data/wait_fraction": rate(wait),
        "data/wait_s": wait,
        "data/wait_mean_s": wait / steps if steps else 0.0,
    }
    if waits is not None:
        out["data/wait_p50_s"] = quantile(waits, 0.50)
        out["data/wait_p95_s"] = quantile(waits, 0.95)
        out["data/wait_max_s"] = max_wait
    out["data/loader_s"] = own
    out["data/step_s"] = step
    out["data/samples_per_s"] = rate(since["samples"])
    out["data/tokens_per_s"] = rate(since["tokens"])
    out["data/supervised_tokens_per_s"] = rate(since["supervised"])
    positions = since["positions"]
    out["data/padding"] = 1 - since["tokens"] / positions if positions else 0.0
    if not ray:
        asks = since["ready_asks"]
        out["data/batches_ready"] = since["ready"] / asks if asks else 0.0
    if workers:
        for key in (*STAGE_KEYS.values(), *REQUESTS.values()):
            out[key] = since.get(key, 0.0)
        reasons = {k: v for k, v in since.items() if k.startswith("data/skipped/")}
        out["data/skipped"] = float(sum(reasons.values()))
        out.update(sorted(reasons.items()))
    return out


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (0 if empty)."""
    if not values:
        return 0.0
    return float(np.quantile(values, q, method="inverted_cdf"))
