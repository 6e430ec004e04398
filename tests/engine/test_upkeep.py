"""freeze_startup_heap (edgellm/engine/upkeep.py), in a fresh interpreter so that this test
process's own heap is left alone: every object alive at the call leaves the collector's reach
(the tracked set that full collections walk is nearly empty after it), and garbage alive at the
call is collected first rather than frozen."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import gc, json, weakref
import torch  # a heap of the size a server carries
from edgellm.engine.upkeep import freeze_startup_heap

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle, unreachable from here on
dead = weakref.ref(a)
del a, b
before = len(gc.get_objects())
frozen = freeze_startup_heap()
print(json.dumps({"before": before, "frozen": frozen, "count": gc.get_freeze_count(),
                  "after": len(gc.get_objects()), "cycle_collected": dead() is None}))
"""


def test_the_startup_heap_leaves_the_collectors_reach():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["frozen"] == r["count"] and r["frozen"] > 10_000
    assert r["after"] < r["before"] // 100  # what a full collection still walks
    assert r["cycle_collected"]  # collected, not frozen
