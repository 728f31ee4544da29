"""The CPU cores torch takes in a process that does device work (a GPU worker's, a rank's,
or the command's own without a broker): its share of them, not torch's default of every
core, which a busy machine turns into threads waiting on one another (a tiny pipeline's 4
images: 2.9 s of work against 0.3 s on one thread, two cores at load 4). OMP_NUM_THREADS,
where set, decides instead. workers/cores.py applies it."""

import os


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def torch_threads(processes: int = 1) -> int:
    """torch's threads for each of `processes` working side by side (a node's ranks): the
    cores shared between them and, within each, between the two threads that run torch at
    once (the work, and the next batch's staging or the last one's uploads); for training,
    19 samples/s with every core against 96 with this (the tiny model, two cores, two other
    busy processes)."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, cores() // (2 * processes)))
