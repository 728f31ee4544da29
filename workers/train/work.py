"""The train work: one train-shard job takes a run from the checkpoint at its first step
to the one at its last, records every step's loss, and writes the run's next job in the
same transaction as the checkpoint, so the database, not the broker, drives the chain.
Plain code, no Celery; torch loads lazily.

A run of world size 1 trains in this process: it keeps the state it has just checkpointed,
takes the next job's steps on a thread while the checkpoint is written, and hands them to
that job when it comes (the run's jobs are routed to the worker that holds it: models/
train/routing.py); any other worker restores the checkpoint from the store. A larger world
size trains on that many rank processes (ranks/), kept from job to job, so that they too
go on in memory; over several nodes, this worker leads the gang the other nodes' workers
join (gang/), which goes on with the same ranks from job to job while it can.
"""

import logging
from collections.abc import Callable, Iterator, Sequence
from time import perf_counter, time
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from sdq.models.jobs.delivery import Work, check_lease, lease_held
from sdq.models.jobs.lifecycle import Output, utcnow
from sdq.models.store import ObjectStore
from sdq.models.tables import Job, Run
from sdq.models.train.page import draw_page
from sdq.models.train.settings import TrainSettings
from sdq.models.train.specs import TrainShardSpec, training_seconds
from sdq.workers.tracking import Scalar, report
from sdq.workers.train.gang.gathering import GangIncomplete
from sdq.workers.train.gang.leader import GangCalls, run_as_leader
from sdq.workers.train.loop.diverged import Diverged
from sdq.workers.train.ranks.live import LiveStates
from sdq.workers.train.ranks.processes import too_many_here
from sdq.workers.train.records import (
    LiveSteps,
    Written,
    checkpoint_at,
    checkpoint_within,
    prune_checkpoints,
    record_checkpoint,
)
from sdq.workers.weights import ModelFiles, ModelUnavailable

logger = logging.getLogger(__name__)


# A job's output, and the runs it gave new jobs to send.
Done = tuple[Output, list[int]]


class NotReady(Exception):
    """The checkpoint this job starts from is not written yet; it will be."""


class NoGangHere(Exception):
    """A job over several nodes needs other workers to join it: not in one process."""


class TooManyRanks(Exception):
    """The job asks for more ranks a node than this worker was started with."""


class TrainWork(Work):
    permanent_errors = (ModelUnavailable, Diverged, NoGangHere, TooManyRanks)
    outage_errors = (*Work.outage_errors, GangIncomplete)

    def __init__(
        self,
        *,
        store: ObjectStore,
        sessions: sessionmaker[Session],
        files: ModelFiles,
        live: LiveStates,
        send_next: Callable[[int], None],
        follow: Callable[[], None],
        settings: TrainSettings,
        worker: str,
        calls: GangCalls | None,
        time_limit_seconds: float | None,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.files = files
        self.live = live
        self.send_next = send_next
        self.follow = follow
        self.settings = settings
        self.worker = worker
        self.calls = calls
        self.time_limit_seconds = time_limit_seconds

    def run(self, jobs: Sequence[Job]) -> Iterator[Output]:
        for job in jobs:
            spec = TrainShardSpec.from_dict(job.spec)
            output, new_work = self._done_before(job.id, spec) or self._train(job, spec)
            yield output
            self.follow()  # before the sends: the run's next job comes back here
            for run_id in new_work:
                self.send_next(run_id)

    def _done_before(self, job_id: int, spec: TrainShardSpec) -> "Done | None":
        """A job delivered again after its checkpoint was written finds it, and stops (its
        run's next job is sent again, in case the first send was lost). An attempt that
        stopped early wrote it before the job's last step."""
        with self.sessions() as session:
            checkpoint = checkpoint_within(session, spec.run, spec.first_step, spec.last_step)
        if checkpoint is None:
            return None
        # Checkpoints from before state hashes were kept are named by their model.
        digest = checkpoint.state_sha256 or checkpoint.model_revision
        output = Output(job_id, checkpoint.uri, digest, work_seconds=None)
        return output, [spec.run]

    def _train(self, job: Job, spec: TrainShardSpec) -> "Done":
        started = perf_counter()
        if refusal := too_many_here(self.settings, spec):
            raise TooManyRanks(refusal)
        if spec.first_step:
            with self.sessions() as session:
                if checkpoint_at(session, spec.run, spec.first_step) is None:
                    raise NotReady(
                        f"run {spec.run} has no checkpoint at step {spec.first_step} yet"
                    )
        seconds = training_seconds(spec.options, self.time_limit_seconds)
        stop_at = time() + seconds if seconds is not None else None
        if spec.options.world_size == 1:
            steps, written = self._train_here(spec, stop_at)
        else:
            steps, written = self._train_on_ranks(job, spec, stop_at)
        done = self._record(job.id, spec, steps, written, started)
        if written.step == spec.options.steps and spec.options.world_size > 1:
            # The run's ranks let their devices go once its last checkpoint is recorded:
            # their exits are not on the run's clock.
            self.live.clear()
        return done

    def _train_here(
        self, spec: TrainShardSpec, stop_at: float | None
    ) -> tuple[list[dict], Written]:
        """Steps on this process's device, then the checkpoint written while the next
        job's steps are taken on a thread."""
        from sdq.workers.train.loop.build import restore_state
        from sdq.workers.train.loop.checkpoints import write_checkpoint
        from sdq.workers.train.loop.state import Ranks
        from sdq.workers.train.loop.training import Training, until_time

        training = self.live.take(spec)
        if training is None:
            state = restore_state(spec, self.store, self.files, Ranks())
            live_steps = LiveSteps(self.sessions, self.settings.live_steps_seconds)
            training = Training(spec, state, self.store, self.settings, on_steps=live_steps)
        out_of_time = until_time(stop_at, training.state)
        try:
            steps = training.steps(spec, lambda: out_of_time() or not lease_held())
            check_lease()  # no checkpoint of a job another worker may hold now
        except BaseException:
            training.close()
            raise
        snapshot = training.checkpoint(spec)
        self.live.keep(training, spec.next_after(training.state.step))
        return steps, write_checkpoint(spec, snapshot, self.store, self.files)

    def _train_on_ranks(
        self, job: Job, spec: TrainShardSpec, stop_at: float | None
    ) -> tuple[list[dict], Written]:
        if spec.options.nodes == 1:
            result = self.live.group(spec, check_lease).train(spec, stop_at, watch=check_lease)
        else:
            result = self._lead(job, spec, stop_at)
        return result["steps"], Written(**result["written"])

    def _lead(self, job: Job, spec: TrainShardSpec, stop_at: float | None) -> dict[str, Any]:
        """Node 0 of the job's gang (gang/leader.py)."""
        if self.calls is None:
            raise NoGangHere(f"run {spec.run} spans {spec.options.nodes} nodes: it needs workers")
        return run_as_leader(self.sessions, job, spec, worker=self.worker,
                                  settings=self.settings, calls=self.calls, ranks=self.live,
                                  stop_at=stop_at)  # fmt: skip

    def _record(
        self,
        job_id: int,
        spec: TrainShardSpec,
        steps: list[dict[str, Any]],
        written: Written,
        started: float,
    ) -> "Done":
        """In one transaction: the checkpoint's row, the steps' losses, the model's
        registration, the run's next job and the checkpoint's validation renders. Then the
        checkpoints past --keep-checkpoints leave the store."""
        with self.sessions.begin() as session:
            new_work = record_checkpoint(session, spec, steps, written)
        figures = _figures(steps) + _time_shares(spec, steps, written, perf_counter() - started)
        report(self.store, spec.run, f"steps-{spec.first_step:08d}", figures, spec.report_to)
        if spec.options.keep_checkpoints is not None:
            self._prune(spec)
        self._draw_page(spec.run)
        output = Output(
            job_id,
            written.uri,
            written.state_sha256,
            work_seconds=perf_counter() - started,
            units=len(steps) * spec.options.batch_size,  # samples trained on
        )
        return output, new_work

    def _draw_page(self, run_id: int) -> None:
        """The run's page with this checkpoint on it, as it lands. Best effort: the job's
        work is done and recorded, and `sdq train status` draws the page again."""
        try:
            with self.sessions() as session:
                draw_page(session, self.store, session.get_one(Run, run_id))
        except Exception:  # anything: a failure here must not fail a job already recorded
            logger.exception("the page of train run %s was not drawn", run_id)

    def _prune(self, spec: TrainShardSpec) -> None:
        """Marks the old checkpoints deleted, then deletes their objects: a row never says a
        checkpoint is there when it is not, and an object left by a failed delete is only
        garbage (the run never goes back to an older checkpoint)."""
        with self.sessions.begin() as session:
            prefixes = prune_checkpoints(session, spec, deleted_at=utcnow())
        for prefix in prefixes:
            for key in list(self.store.list_keys(f"{prefix}/")):
                self.store.delete(key)


# A step's figures and their tags in the trackers.
TRACKED = {"loss": "train/loss", "lr": "train/learning_rate",
           "samples_per_second": "train/samples_per_second", "mfu": "train/mfu"}  # fmt: skip


def _figures(steps: list[dict[str, Any]]) -> list[Scalar]:
    return [(tag, step["step"], step[name]) for step in steps
            for name, tag in TRACKED.items() if step.get(name) is not None]  # fmt: skip


def _time_shares(
    spec: TrainShardSpec, steps: list[dict[str, Any]], written: Written, wall: float
) -> list[Scalar]:
    """What the job's time (from its start, or its first step taken ahead, to its checkpoint
    written) went to, as shares at its last step: stepping, waiting for data, waiting for
    its checkpoint, and the rest (restoring, starting or gathering ranks, recording). `sdq
    train status` gives the run's own, job gaps included."""
    if not steps or wall <= 0:
        return []
    stepping = sum(spec.options.batch_size / step["samples_per_second"] for step in steps)
    waiting = sum(step.get("data_wait_seconds") or 0.0 for step in steps)
    seconds = {"training": stepping - waiting, "data_wait": waiting,
               "checkpoint": written.seconds or 0.0}  # fmt: skip
    # Steps taken ahead, while the job before wrote its checkpoint, began before this job.
    total = max(wall, sum(seconds.values()))
    seconds["other"] = total - sum(seconds.values())
    return [(f"time/{name}", steps[-1]["step"], part / total) for name, part in seconds.items()]
