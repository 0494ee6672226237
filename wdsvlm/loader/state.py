"""The loader's state, typed: one schema from which a worker stream's capture, its restore and
the elastic hand-over are all derived.

A ``WorkerState`` is where one global worker's stream stands: its ``ReadCursor`` (what is left
to read of the plan) and the state of each buffering stage, in pipeline order (shuffle
buffer, tokenizer batch, packing window, packs waiting for a batch), each as places
``[pass, place]``, never sample bytes (``pipeline/places.py``). A ``LoaderState`` is a rank's
``state_dict()``: the version, epoch, batches taken, topology, resume config and one
``WorkerState`` per DataLoader worker. ``saved()`` gives the plain form a checkpoint holds
(the same as before this module: older checkpoints of this version load), ``from_saved``
reads it back, refusing a malformed one with what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from ..pipeline.pack import BalanceState, WindowState
from ..pipeline.places import Place
from ..pipeline.shuffle import ShuffleState
from ..pipeline.tokenize import TokenizeState
from .settings import STATE_VERSION


@dataclass
class ReadCursor:
    """What a worker has left to read of the plan: ``segments``, places of passes before
    ``next`` handed to it (``[[pass, [[a, b], ...]], ...]``, by an elastic resume), then its
    own share of pass ``next`` and of every pass after."""

    segments: list = field(default_factory=list)
    next: int = 0

    def after(self, last: Sequence[int] | None, share: tuple[int, int]) -> ReadCursor:
        """What is left once the sample at place ``last`` (``[pass, place]``) was taken in,
        ``share`` being the worker's own share of a pass: the reading order is ascending in
        ``(pass, place)``, so that is everything after it."""
        if last is None:
            return ReadCursor(self.segments, self.next)
        last_pass, after = last[0], last[1] + 1
        if last_pass >= self.next:  # in the worker's own share of a pass: segments all read
            left = [[last_pass, [[after, share[1]]]]] if after < share[1] else []
            return ReadCursor(left, last_pass + 1)
        segments = []
        for pass_, ranges in self.segments:
            if pass_ == last_pass:
                ranges = [[max(a, after), b] for a, b in ranges if b > after]
            if pass_ >= last_pass and ranges:
                segments.append([pass_, ranges])
        return ReadCursor(segments, self.next)

    def saved(self) -> dict:
        return {
            "segments": [[p, [[a, b] for a, b in ranges]] for p, ranges in self.segments],
            "next": self.next,
        }

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any]) -> ReadCursor:
        return cls(
            [[p, [[a, b] for a, b in ranges]] for p, ranges in saved["segments"]], saved["next"]
        )


@dataclass
class WorkerState:
    """One worker stream's state. The fields after ``read`` are the buffering stages' states
    in pipeline order: the stream zips them with its stages, and the field names are the keys
    of the saved form."""

    read: ReadCursor = field(default_factory=ReadCursor)
    shuffle: ShuffleState = field(default_factory=ShuffleState)
    tokenize: TokenizeState = field(default_factory=TokenizeState)
    window: WindowState = field(default_factory=WindowState)
    balance: BalanceState = field(default_factory=BalanceState)

    @classmethod
    def fresh(cls, epoch: int, segments: list | None = None) -> WorkerState:
        """At the start of pass ``epoch``, with empty buffers; or, with ``segments`` (passes
        before ``epoch``), first those places of earlier passes (an elastic hand-over)."""
        return cls(read=ReadCursor(segments or [], epoch))

    @classmethod
    def stage_types(cls) -> list[type]:
        """The stages' state types, in pipeline order."""
        hints = get_type_hints(cls)  # the annotations are strings
        return [hints[f.name] for f in fields(cls)[1:]]

    @classmethod
    def of(cls, read: ReadCursor, stages: Sequence[Any]) -> WorkerState:
        """A state from the cursor and the stages' states, in pipeline order."""
        names = [f.name for f in fields(cls)[1:]]
        return cls(read, **dict(zip(names, stages, strict=True)))

    def stages(self) -> list[Any]:
        """The stages' states, in pipeline order."""
        return [getattr(self, f.name) for f in fields(self)[1:]]

    def held_places(self) -> list[Place]:
        """The places of every sample the stages hold."""
        return [p for stage in self.stages() for p in stage.held_places()]

    def saved(self) -> dict:
        return {f.name: getattr(self, f.name).saved() for f in fields(self)}

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any]) -> WorkerState:
        try:
            read = ReadCursor.from_saved(saved["read"])
            stages = [
                kind.from_saved(saved[f.name])
                for f, kind in zip(fields(cls)[1:], cls.stage_types(), strict=True)
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"a worker state of the loader state is malformed ({type(e).__name__}: {e}); "
                f"it holds {sorted(saved) if isinstance(saved, Mapping) else type(saved)}"
            ) from None
        return cls.of(read, stages)


@dataclass
class LoaderState:
    """A rank's loader state: the epoch, the batches of it taken (``done``), the topology it
    ran on, the ``config`` a resume must agree with, and each DataLoader worker's stream."""

    epoch: int
    done: int
    topology: dict
    config: dict
    workers: list[WorkerState]
    version: int = STATE_VERSION

    def saved(self) -> dict:
        return {
            "version": self.version,
            "epoch": self.epoch,
            "done": self.done,
            "topology": dict(self.topology),
            "config": dict(self.config),
            "workers": [w.saved() for w in self.workers],
        }

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any]) -> LoaderState:
        """A saved state of this version (``settings.upgrade_state`` first)."""
        missing = [k for k in ("epoch", "done", "topology", "config", "workers") if k not in saved]
        if missing:
            raise ValueError(f"the loader state lacks {missing}: it is not a state_dict()")
        return cls(
            saved["epoch"],
            saved["done"],
            dict(saved["topology"]),
            dict(saved["config"]),
            [WorkerState.from_saved(w) for w in saved["workers"]],
            saved.get("version", STATE_VERSION),
        )
