"""The train work: one train-shard job takes a run from the checkpoint at its first step
to the one at its last, records every step's loss, and writes the run's next job in the
same transaction as the checkpoint, so the database, not the broker, drives the chain.
Plain code, no Celery; torch loads lazily.

A run of world size 1 trains in this process: it keeps the state it has just checkpointed,
takes the next job's steps on a thread while the checkpoint is written, and hands them to
that job when it comes (the run's jobs are routed to the worker that holds it: models/
train/routing.py); any other worker restores the checkpoint from the store. A larger world
size trains on that many rank processes (ranks.py), kept from job to job, so that they too
go on in memory; over several nodes, this worker leads the gang the other nodes' workers
join (gang.py), which goes on with the same ranks from job to job while it can.
"""

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from time import perf_counter, time
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from sdq.models.jobs.delivery import Work, check_lease, lease_held
from sdq.models.jobs.lifecycle import Output, utcnow
from sdq.models.settings import TrainSettings
from sdq.models.store import ObjectStore
from sdq.models.tables import Job
from sdq.models.train.routing import run_key
from sdq.models.train.specs import TrainShardSpec, training_seconds
from sdq.workers.train import gang
from sdq.workers.train.ranks import Node, RankGroup, Spares, share_cores
from sdq.workers.train.records import (
    LiveSteps,
    Written,
    checkpoint_at,
    checkpoint_within,
    prune_checkpoints,
    record_checkpoint,
)
from sdq.workers.weights import ModelFiles, ModelUnavailable

if TYPE_CHECKING:
    from sdq.workers.train.job import Training

logger = logging.getLogger(__name__)


# A job's output, and the runs it gave new jobs to send.
Done = tuple[Output, list[int]]


class NotReady(Exception):
    """The checkpoint this job starts from is not written yet; it will be."""


class NoGangHere(Exception):
    """A job over several nodes needs other workers to join it: not in one process."""


class TooManyRanks(Exception):
    """The job asks for more ranks a node than this worker was started with."""


class LiveStates:
    """What this process keeps of the run it last trained, for that run's next job: the
    training it checkpointed (a run of one rank, trained here), which takes the next job's
    steps on a thread until that job comes; or the rank processes holding it (a run of
    several). One at a time: a GPU that rank 0 of a group needs is never also holding a
    state trained here. Beside them, spare rank processes for the next run (which hold no
    device until they join one)."""

    def __init__(self) -> None:
        self._training: Training | None = None
        self._ahead: Ahead | None = None
        self._group: RankGroup | None = None
        self._spares: Spares | None = None

    def take(self, spec: TrainShardSpec) -> "Training | None":
        """The training to go on with in this process, if the job goes on from it."""
        self._stop_group()
        self._stop_ahead()
        if self._training is not None and self._training.goes_on_to(spec):
            training, self._training = self._training, None
            return training
        self._drop_training()
        return None

    def keep(self, training: "Training", following: TrainShardSpec | None) -> None:
        """Keeps the training, taking the steps of the job that follows meanwhile."""
        self._training = training
        if following is not None:
            self._ahead = Ahead(training, following)

    def group(self, spec: TrainShardSpec) -> RankGroup:
        """The rank processes of the job's run, the spares joining it unless they serve it
        already."""
        if self._group is None or not self._group.serves(spec):
            self._new_group(spec, Node())
        return self._group

    def _new_group(self, spec: TrainShardSpec, node: Node) -> None:
        """What this process holds let go (the ranks need the devices), the spares join
        the run as that node of it."""
        self.clear()
        spares, self._spares = self._spares, None
        self._group = RankGroup(spec, spares, node)

    def kept_gang_node(self, spec: TrainShardSpec) -> Node | None:
        """This node's place in the run's gang, if its ranks are kept here and can go on
        with this job."""
        if self._group is None or not self._group.serves(spec):
            return None
        return self._group.node

    def run_gang_node(
        self,
        spec: TrainShardSpec,
        node: Node,
        watch: Callable[[], None],
        stop_at: float | None,
        goes_on: bool,
    ) -> dict[str, Any] | None:
        """This node's ranks of a job over several nodes: those kept from the run's last job
        where the gang `goes_on` (every node agrees: gang.py), else the spares waiting here
        (their imports done). They are kept after the job. A failure stops them, and starts
        spares in their place: their imports overlap the job's next gathering, and take no
        core from a training (a rank slowed by them would hold every rank of the gang at
        its next collective)."""
        if not goes_on:
            self._new_group(spec, node)
        try:
            return self._group.train(spec, stop_at, watch)
        except BaseException:
            self._group = None  # train() has stopped it
            self.spare(spec.options.ranks_per_node)
            raise

    def run_ended(self, local_ranks: int) -> None:
        """The run's ranks let their devices go, and spares take their place for the next
        run."""
        self.clear()
        self.spare(local_ranks)

    def warm_keys(self) -> set[str]:
        """Where the jobs of the run held here find this worker (models/train/routing.py)."""
        if self._training is not None:
            return {run_key(self._training.state.run)}
        return {self._group.warm_key} if self._group is not None else set()

    def spare(self, local_ranks: int) -> None:
        """Rank processes started for the next run (ranks.Spares), unless there are."""
        if self._spares is None or not self._spares.fit(local_ranks):
            if self._spares is not None:
                self._spares.stop()
            self._spares = Spares(local_ranks)

    def clear(self) -> None:
        self._stop_group()
        self._stop_ahead()
        self._drop_training()

    def close(self) -> None:
        """All of it let go, the spares too (the process ends)."""
        self.clear()
        if self._spares is not None:
            self._spares.stop()
            self._spares = None

    def _stop_ahead(self) -> None:
        if self._ahead is not None and not self._ahead.stop():
            self._drop_training()  # it failed mid-step: the state is not any step's
        self._ahead = None

    def _drop_training(self) -> None:
        """Lets the kept training go, its device memory with it."""
        if self._training is None:
            return
        from sdq.workers.gpu import release_device_memory

        self._training.close()
        self._training = None
        release_device_memory()

    def _stop_group(self) -> None:
        if self._group is not None:
            self._group.stop()
            self._group = None


class Ahead:
    """The steps of a run's next job, taken on a thread from the state its last job has
    just checkpointed, until the job comes to take them (or another job comes)."""

    def __init__(self, training: "Training", following: TrainShardSpec) -> None:
        self._stopping = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(
            target=self._take_steps, args=(training, following), name="sdq-train-ahead"
        )
        # It never holds the process open: stop() ends it, and an exit stops it (task.py).
        self._thread.daemon = True
        self._thread.start()

    def _take_steps(self, training: "Training", following: TrainShardSpec) -> None:
        try:
            training.train_ahead(following, self._stopping.is_set)
        except BaseException as error:
            logger.warning("steps ahead of run %s's next job failed: %r", following.run, error)
            self._failure = error

    def stop(self) -> bool:
        """Stops it at its window's end; whether the state is still a step's."""
        self._stopping.set()
        self._thread.join()
        return self._failure is None


class TrainWork(Work):
    permanent_errors = (ModelUnavailable, NoGangHere, TooManyRanks)
    outage_errors = (*Work.outage_errors, gang.GangIncomplete)

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
        calls: gang.GangCalls | None,
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
        if refusal := self.settings.too_many_ranks(spec.run, spec.options.ranks_per_node):
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
            # Once the run's last checkpoint is recorded: their exits and the spares'
            # imports are not on the run's clock.
            self.live.run_ended(self.settings.ranks or spec.options.ranks_per_node)
        return done

    def _train_here(
        self, spec: TrainShardSpec, stop_at: float | None
    ) -> tuple[list[dict], Written]:
        """Steps on this process's device, then the checkpoint written while the next
        job's steps are taken on a thread."""
        from sdq.workers.train.job import Training, restore_state, until_time, write_checkpoint
        from sdq.workers.train.state import Ranks

        share_cores()
        training = self.live.take(spec)
        if training is None:
            state = restore_state(spec, self.store, self.files, Ranks())
            live_steps = LiveSteps(self.sessions)
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
            result = self.live.group(spec).train(spec, stop_at, watch=check_lease)
        else:
            result = self._lead(job, spec, stop_at)
        return result["steps"], Written(**result["written"])

    def _lead(self, job: Job, spec: TrainShardSpec, stop_at: float | None) -> dict[str, Any]:
        """Node 0 of the job's gang (gang.py)."""
        if self.calls is None:
            raise NoGangHere(f"run {spec.run} spans {spec.options.nodes} nodes: it needs workers")
        return gang.run_as_leader(self.sessions, job, spec, worker=self.worker,
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
        if spec.options.keep_checkpoints is not None:
            self._prune(spec)
        output = Output(
            job_id,
            written.uri,
            written.state_sha256,
            work_seconds=perf_counter() - started,
            units=len(steps) * spec.options.batch_size,  # samples trained on
        )
        return output, new_work

    def _prune(self, spec: TrainShardSpec) -> None:
        """Marks the old checkpoints deleted, then deletes their objects: a row never says a
        checkpoint is there when it is not, and an object left by a failed delete is only
        garbage (the run never goes back to an older checkpoint)."""
        with self.sessions.begin() as session:
            prefixes = prune_checkpoints(session, spec, deleted_at=utcnow())
        for prefix in prefixes:
            for key in list(self.store.list_keys(f"{prefix}/")):
                self.store.delete(key)
