"""Where an engine step's time goes: `PhaseTimer` wraps the engine's phases (schedule, batch
building, forward, logits, sampling) and any other method in perf_counter timers, for the decode
profiles of the benchmarks."""

from __future__ import annotations

import inspect
import time
from typing import Any


class _Timed:
    """A callable object whose calls go through `timed`, every other attribute through to it."""

    def __init__(self, inner: object, timed) -> None:
        self._inner, self._timed = inner, timed

    def __call__(self, *a, **k):
        return self._timed(*a, **k)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class PhaseTimer:
    """Wraps the engine's phases with perf_counter timers (monkeypatching bound methods)."""

    def __init__(self, engine: Any) -> None:
        self.totals: dict[str, list[float]] = {}
        runner, model = engine.runner, engine.runner.model
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(runner, "build_batch", "build_batch")
        self.wrap(model, "forward", "forward")
        self.wrap(model, "compute_logits", "logits")
        self.wrap(runner, "sampler", "sample")

    def wrap(self, owner: object, name: str, key: str) -> None:
        """Time every call of owner.name under `key` (seconds per call in self.totals[key]); a
        callable object (the sampler) keeps its attributes through a proxy."""
        fn = getattr(owner, name)
        bucket = self.totals.setdefault(key, [])

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                bucket.append(time.perf_counter() - t0)

        setattr(
            owner,
            name,
            timed if inspect.ismethod(fn) or inspect.isfunction(fn) else _Timed(fn, timed),
        )

    def reset(self) -> None:
        for v in self.totals.values():
            v.clear()
