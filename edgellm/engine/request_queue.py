"""The scheduler's waiting line, one class per scheduling policy (vLLM's names).

fcfs: arrival order; a preempted request goes back to the front.
priority: ordered by (priority, arrival); lower priority values run sooner, equal priorities keep
arrival order (so no request starves behind later ones of its own priority), and a preempted
request goes back to its own place, ahead of everything of its priority that arrived after it.

Both keep the same interface (add, add_preempted, peek, pop, remove, len, iter) so the
scheduler holds one of them, chosen once at construction by `make_waiting_queue`.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from edgellm.engine.sequence import Sequence

POLICIES = ("fcfs", "priority")


class _Waiting:
    """What both lines share over their container `_q`, in queue order."""

    _q: deque[Sequence] | list[Sequence]

    def peek(self) -> Sequence:
        return self._q[0]

    def remove(self, seq: Sequence) -> None:
        self._q.remove(seq)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._q)

    def __contains__(self, seq: object) -> bool:
        return seq in self._q


class FCFSQueue(_Waiting):
    def __init__(self) -> None:
        self._q: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._q.append(seq)

    def add_preempted(self, seq: Sequence) -> None:
        self._q.appendleft(seq)

    def pop(self) -> Sequence:
        return self._q.popleft()


def priority_key(seq: Sequence) -> tuple[int, int]:
    """Lower runs sooner: the request's priority, then its arrival."""
    return (seq.priority, seq.arrival_order)


class PriorityQueue(_Waiting):
    """A list kept sorted by priority_key (requests are few; inserts are a bisect and a shift)."""

    def __init__(self) -> None:
        self._q: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        bisect.insort(self._q, seq, key=priority_key)

    def add_preempted(self, seq: Sequence) -> None:
        self.add(seq)

    def pop(self) -> Sequence:
        return self._q.pop(0)


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
