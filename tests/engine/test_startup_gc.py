"""`freeze_startup_objects`: what exists at startup leaves the collector's passes; what serving allocates
afterwards, reference cycles included, is still collected. Run in a child interpreter, so that this test
process's own objects are not frozen."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc
from qwick.engine.startup_gc import freeze_startup_objects

startup = [[i] for i in range(10_000)]  # tracked containers that exist at startup
frozen = freeze_startup_objects("test")
assert frozen == gc.get_freeze_count() >= 10_000, frozen
tracked = {id(o) for o in gc.get_objects()}
assert not any(id(o) in tracked for o in startup[:100])  # the startup objects left every generation


class Node:
    pass


a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made while serving
del a, b
assert gc.collect() >= 2  # is still found and freed
print("ok", frozen)
"""


def test_startup_objects_are_frozen_and_later_cycles_still_collected():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")
