"""A process's libraries load without Python's collector and are set aside for good: the
`sdq` command's, the rank fork server's (torch and the trainer, for every rank it forks) and
a GPU worker's preloads."""

import json
import subprocess
import sys

import pytest

# What a process learns of its collector while it loads an entry point's modules through
# the entry point's loader ("loader") or imported as any module is ("plain"), once the
# loader's own module is there.
LOADS = """
import gc, json, sys
setup, loader, plain = sys.argv[2:]
exec(setup)
collections = lambda: sum(generation["collections"] for generation in gc.get_stats())
before = collections()
exec(loader if sys.argv[1] == "loader" else plain)
print(json.dumps({"collections": collections() - before, "frozen": gc.get_freeze_count(),
                  "walked": len(gc.get_objects()), "enabled": gc.isenabled(),
                  "modules": len(sys.modules)}))
"""

# Each entry point: its loader's module, the loader, the same modules imported plainly.
ENTRY_POINTS = {
    "the sdq command": (
        "from sdq.producer.cli.start import load",
        "load()",
        "from sdq.producer.cli.main import main",
    ),
    "the rank fork server": (
        "from sdq.workers.train.ranks.server import load",
        "load()",
        "from sdq.workers.train.ranks.serve import main",
    ),
    "a GPU worker": (
        "from sdq.workers.main import preload; from sdq.models.jobs.kinds import KINDS; "
        "import importlib",
        "preload(KINDS.values())",
        "[importlib.import_module(module) for kind in KINDS.values() for module in kind.preload]",
    ),
}


def loaded(how: str, entry_point: str) -> dict:
    done = subprocess.run([sys.executable, "-c", LOADS, how, *ENTRY_POINTS[entry_point]],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_an_entry_point_loads_without_collections_and_freezes_what_it_loaded(
    entry_point: str,
) -> None:
    plain, loader = loaded("plain", entry_point), loaded("loader", entry_point)
    assert loader["modules"] == plain["modules"] >= 700  # the same modules, and many
    # Imported as any module is, the collector walks the objects made so far again and again.
    assert plain["collections"] >= 100
    assert loader["collections"] == 0
    # The modules' objects are set aside: a full collection walks a few of them, not all;
    # what the process makes from then on is collected as ever.
    assert loader["frozen"] >= 100_000 and loader["enabled"]
    assert loader["walked"] * 20 <= plain["walked"]
