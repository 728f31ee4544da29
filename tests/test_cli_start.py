"""The `sdq` command loads its modules without Python's collector, and sets them aside."""

import json
import subprocess
import sys

# What a process learns of its collector while it loads the command one way or the other.
LOADS = """
import gc, json, sys
from sdq.producer.cli.start import load
collections = lambda: sum(generation["collections"] for generation in gc.get_stats())
before = collections()
if sys.argv[1] == "start":
    load()
else:
    from sdq.producer.cli.main import main
print(json.dumps({"collections": collections() - before, "frozen": gc.get_freeze_count(),
                  "enabled": gc.isenabled(), "modules": len(sys.modules)}))
"""


def loaded(how: str) -> dict:
    done = subprocess.run([sys.executable, "-c", LOADS, how], capture_output=True, text=True,
                          check=True)  # fmt: skip
    return json.loads(done.stdout)


def test_the_command_loads_without_collections_and_freezes_what_it_loaded() -> None:
    plain, start = loaded("plain"), loaded("start")
    assert start["modules"] == plain["modules"]  # the same command
    # Imported as any module is, the collector walks the objects made so far again and again.
    assert plain["collections"] >= 100
    assert start["collections"] == 0
    # The modules' objects are set aside; what the command makes is collected as ever.
    assert start["frozen"] >= 100_000 and start["enabled"]
