"""How train workers run a run's jobs: their collectives, gangs and nodes, the losses read per
window, the shards fetched ahead, and the ranks a machine may start. Read with the other
settings (models/settings.py)."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sdq.models.settings import read_int, setting


def _count_or_none(env: Mapping[str, str], name: str, default: Any) -> int | None:
    """A count of at least 1; unset or 0: none (no bound)."""
    return read_int(env, name, 0, minimum=0) or default


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    # A collective that waits longer than this fails the job, which is sent again and goes
    # on from its last checkpoint: a dead or stuck rank never hangs the others.
    collective_timeout_seconds: int = setting("SDQ_TRAIN_COLLECTIVE_TIMEOUT", 600)
    # A job over several nodes waits this long for its gang to gather before it gives up
    # (for now: an outage, not a spent attempt) and is sent again.
    gang_timeout_seconds: int = setting("SDQ_TRAIN_GANG_TIMEOUT", 300)
    # A node of a gang not seen for this long (each notes itself every second) is lost:
    # its gathering fails as an outage, and the job gathers a new gang.
    node_timeout_seconds: int = setting("SDQ_TRAIN_NODE_TIMEOUT", 15)
    # Where this machine's rank 0 is reached by the other nodes of a gang; None: the
    # address its host name resolves to.
    node_address: str | None = setting("SDQ_TRAIN_NODE_ADDRESS", None)
    # Losses stay on the device and are read this many steps at a time: each read waits
    # for the device to finish its queued work.
    loss_every: int = setting("SDQ_TRAIN_LOSS_EVERY", 25)
    # Steps reach the database this often while a job trains (`sdq train status`, the bars
    # and the page move between checkpoints): each write is one statement of its steps.
    live_steps_seconds: float = setting("SDQ_TRAIN_LIVE_STEPS_SECONDS", 5.0)
    # Each lane's next shards fetched while its current one trains, and the threads that
    # fetch and decode them (each fetch is itself several ranged GETs at once on S3).
    shards_ahead: int = setting("SDQ_TRAIN_SHARDS_AHEAD", 1)
    fetch_threads: int = setting("SDQ_TRAIN_FETCH_THREADS", 4)
    # The most ranks a job may start on this machine (`sdq worker gpu --train-ranks N`
    # sets it for its train worker); None: one a GPU, or without GPUs one a core it may use.
    ranks: int | None = setting("SDQ_TRAIN_RANKS", None, read=_count_or_none)

    def __post_init__(self) -> None:
        if self.gang_timeout_seconds >= self.collective_timeout_seconds:
            raise ValueError(
                f"SDQ_TRAIN_GANG_TIMEOUT ({self.gang_timeout_seconds}) must be below "
                f"SDQ_TRAIN_COLLECTIVE_TIMEOUT ({self.collective_timeout_seconds}): the ranks' "
                "rendezvous waits for the gang that long at most, so a gang would be given up "
                "by its ranks before the leader's own deadline"
            )

    def too_many_ranks(
        self, run: int, ranks_per_node: int, *, cpu_cores: int | None = None
    ) -> str | None:
        """Why this machine cannot take a node of a job of that many ranks a node: more than
        its --train-ranks, or, on a worker of CPU ranks without it, than the `cpu_cores` it
        may use (more ranks would spend the job starting them)."""
        limit = self.ranks if self.ranks is not None else cpu_cores
        if limit is None or ranks_per_node <= limit:
            return None
        return (
            f"train run {run} trains on {ranks_per_node} ranks a node; this worker takes "
            f"{limit} at most (its --train-ranks; without GPUs and without it, one a core it "
            f"may use): `sdq worker gpu --train-ranks {ranks_per_node}` starts one that can "
            f"take it"
        )
