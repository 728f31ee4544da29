"""The train work: one train-shard job takes a run from the checkpoint at its first step
to the one at its last, records every step's loss, and writes the run's next job in the
same transaction as the checkpoint, so the database, not the broker, drives the chain.
Plain code, no Celery; torch loads lazily.

A worker keeps the state it has just checkpointed and goes on from it in memory when the
next job comes to it; any other worker restores the checkpoint from the store.
"""

import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from sdq.models.jobs.delivery import Work
from sdq.models.jobs.lifecycle import Output
from sdq.models.store import ObjectStore
from sdq.models.tables import Job
from sdq.models.training import TrainShardSpec, checkpoint_prefix
from sdq.workers.train.data import LatentStream
from sdq.workers.train.records import checkpoint_at, record_checkpoint
from sdq.workers.weights import ModelFiles, ModelUnavailable

if TYPE_CHECKING:
    from sdq.workers.train.trainer import TrainState


# A job's output, and the runs it gave new jobs to send.
Done = tuple[Output, list[int]]


class NotReady(Exception):
    """The checkpoint this job starts from is not written yet; it will be."""


class LiveStates:
    """The training state this process last checkpointed, by run: the next job of that
    run goes on from it without reading the checkpoint back."""

    def __init__(self) -> None:
        self._states: dict[int, TrainState] = {}

    def take(self, run: int, step: int) -> "TrainState | None":
        state = self._states.pop(run, None)
        return state if state is not None and state.step == step else None

    def keep(self, state: "TrainState") -> None:
        self._states = {state.run: state}  # one run at a time fits on a GPU


class TrainWork(Work):
    permanent_errors = (ModelUnavailable,)

    def __init__(
        self,
        *,
        store: ObjectStore,
        sessions: sessionmaker[Session],
        files: ModelFiles,
        live: LiveStates,
        send_next: Callable[[int], None],
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.files = files
        self.live = live
        self.send_next = send_next

    def run(self, jobs: Sequence[Job]) -> Iterator[Output]:
        for job in jobs:
            spec = TrainShardSpec.from_dict(job.spec)
            output, new_work = self._done_before(job.id, spec) or self._train(job.id, spec)
            yield output
            for run_id in new_work:
                self.send_next(run_id)

    def _done_before(self, job_id: int, spec: TrainShardSpec) -> "Done | None":
        """A job delivered again after its checkpoint was written finds it, and stops (its
        run's next job is sent again, in case the first send was lost)."""
        with self.sessions() as session:
            checkpoint = checkpoint_at(session, spec.run, spec.last_step)
        if checkpoint is None:
            return None
        output = Output(job_id, checkpoint.uri, checkpoint.model_revision, work_seconds=None)
        return output, [spec.run]

    def _train(self, job_id: int, spec: TrainShardSpec) -> "Done":
        from sdq.workers.train.trainer import on_device

        started = perf_counter()
        state = self._state(spec)
        stream = LatentStream(
            spec.inputs,
            seed=spec.options.seed,
            batch_size=spec.options.batch_size,
            read=self.store.get_bytes,
        )
        steps: list[dict[str, Any]] = []
        with closing(on_device(stream.batches(state.step), state.device)) as batches:
            self._steps(spec, state, batches, steps)
        done = self._checkpoint(job_id, spec, state, steps, started)
        self.live.keep(state)
        return done

    def _steps(self, spec: TrainShardSpec, state: "TrainState", batches, steps: list) -> None:
        """Steps until the job's last, each one's loss, learning rate and speed noted."""
        from sdq.workers.train.trainer import train_step

        for latents, embeddings in batches:
            step_started = perf_counter()
            loss = train_step(state, spec, latents, embeddings)
            seconds = perf_counter() - step_started
            steps.append(
                {
                    "run_id": spec.run,
                    "step": state.step,
                    "loss": loss,
                    "lr": state.lr_scheduler.get_last_lr()[0],
                    "samples_per_second": spec.options.batch_size / seconds,
                }
            )
            if state.step == spec.last_step:
                return

    def _state(self, spec: TrainShardSpec) -> "TrainState":
        from sdq.workers.train.trainer import base_unet, load_checkpoint, new_state

        state = self.live.take(spec.run, spec.first_step)
        if state is not None:
            return state
        if spec.first_step == 0:
            return new_state(spec, base_unet(spec, self.files))
        with self.sessions() as session:
            checkpoint = checkpoint_at(session, spec.run, spec.first_step)
        if checkpoint is None:
            raise NotReady(f"run {spec.run} has no checkpoint at step {spec.first_step} yet")
        prefix = checkpoint_prefix(spec.run, spec.first_step)
        with tempfile.TemporaryDirectory(prefix="sdq-checkpoint-") as folder:
            for key in self.store.list_keys(f"{prefix}/state/"):
                self.store.get_file(key, Path(folder) / key.removeprefix(f"{prefix}/state/"))
            return load_checkpoint(spec, Path(folder))

    def _checkpoint(
        self,
        job_id: int,
        spec: TrainShardSpec,
        state: "TrainState",
        steps: list[dict[str, Any]],
        started: float,
    ) -> "Done":
        """Writes the checkpoint and the model it makes, then, in one transaction, its row,
        the steps' losses, the model's registration, the run's next job and the checkpoint's
        validation renders."""
        from sdq.workers.train.trainer import base_folder, export_model, save_checkpoint

        prefix = checkpoint_prefix(spec.run, state.step)
        with tempfile.TemporaryDirectory(prefix="sdq-checkpoint-") as folder:
            save_checkpoint(state, Path(folder) / "state")
            base = base_folder(spec, self.files, self.files.cache_dir)
            revision = export_model(state, base, Path(folder) / "model")
            for path in sorted(Path(folder).rglob("*")):
                if path.is_file():
                    self.store.put_file(f"{prefix}/{path.relative_to(folder).as_posix()}", path)
        uri = self.store.uri(prefix)
        with self.sessions.begin() as session:
            new_work = record_checkpoint(
                session, spec, steps, uri=uri, prefix=prefix, revision=revision
            )
        output = Output(
            job_id,
            uri,
            revision,
            work_seconds=perf_counter() - started,
            units=len(steps) * spec.options.batch_size,  # samples trained on
        )
        return output, new_work
