"""What the training process sees of its data: how long each step waited for its batch, what
the Loader did in the training process itself, and, from the workers' reports that ride with
the batches (``pipeline.timing``), each stage's seconds, the store's requests and the samples
skipped; as figures for the logs (``Loader.metrics()``: names under ``data/``), advice when the
steps wait, and the stage of each worker when a step waits too long.

STUB: the interface is fixed (names, arguments); the bodies are being written.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Telemetry:
    """The Loader's ``telemetry=`` setting (``True``: these defaults; ``False``: off, no figure
    is timed or shipped and ``metrics()`` has only the consumer's counts)."""

    window: int = 200
    """Steps over which the advice looks at the share of time spent waiting."""
    advice_wait: float = 0.10
    """The share of a window's time waiting for data above which one line of advice is
    logged (the stage that dominates, what to change)."""
    hang_after_s: float = 120.0
    """A step waiting longer than this logs which worker holds it and the stage each worker
    is in, with how long (again every ``hang_after_s``); 0: never."""
    trace: str | None = None
    """A path: the first ``trace_steps`` steps are written there as a Chrome/Perfetto trace
    (JSON trace events: each worker's stages, the training process's waits and steps)."""
    trace_steps: int = 200
    """Steps the trace holds."""

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"Telemetry window must be at least 1 step, not {self.window}")
        if not 0 < self.advice_wait <= 1:
            raise ValueError(f"Telemetry advice_wait must be in (0, 1], not {self.advice_wait}")
        if self.hang_after_s < 0:
            raise ValueError(f"Telemetry hang_after_s must be >= 0, not {self.hang_after_s}")
        if self.trace_steps < 1:
            raise ValueError(f"Telemetry trace_steps must be at least 1, not {self.trace_steps}")


def telemetry_of(setting: Any) -> Telemetry | None:
    """The ``telemetry=`` setting as a ``Telemetry`` (None: off)."""
    if setting is True:
        return Telemetry()
    if setting is False or setting is None:
        return None
    if isinstance(setting, Telemetry):
        return setting
    raise TypeError(f"telemetry= takes True, False or wdsvlm.Telemetry(...), not {setting!r}")


class StatusBoard:
    """The stage each worker of a rank is in, and since when: a small file every worker maps
    and writes (``enter``), that the training process reads (``read``) when a step waits too
    long. STUB."""

    def enter(self, slot: int, stage: str) -> None:  # pragma: no cover - stub
        pass


class DataMeter:
    """The training process's side: timed around each ``next`` of the Loader's iteration, fed
    with each batch's worker report; ``metrics()`` gives the figures since the last reset.
    STUB."""

    def __init__(self, telemetry: Telemetry | None, num_workers: int):
        self.telemetry = telemetry
        self.num_workers = num_workers

    @contextmanager
    def work(self) -> Iterator[None]:
        """Work done for the Loader in the training process outside its iteration (the
        Trainer's ``model_inputs``): counted as the Loader's, not as the model's."""
        yield

    def metrics(self, reset: bool = True) -> dict[str, float]:
        return {}

    def arrived(self, report: Mapping[str, Any] | None) -> None:  # pragma: no cover - stub
        pass
