"""Where a train run stands, from the database: its step, speed and time left, its loss
and learning rate curves, its time shares, checkpoints, scores and validation images. What
`sdq train status` shows and the run's page is drawn from (models/train/page.py), by the
command and by the worker that records each checkpoint."""

import statistics
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from sdq.models.datasets.buckets import Bucket
from sdq.models.evaluate.scores import run_scores
from sdq.models.generate.tables import Generation
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.lifecycle import as_utc
from sdq.models.tables import FINISHED, Job, JobEvent, JobStatus, Run
from sdq.models.train.tables import Checkpoint, TrainStep

# Steps whose speed makes the ETA: the recent ones, not the first (compilation, loading).
RECENT_STEPS = 50


# What a step row gives the status: step, loss, samples/s, MFU and learning rate, by index.
STEP_FIGURES = (TrainStep.step, TrainStep.loss, TrainStep.samples_per_second, TrainStep.mfu,
                TrainStep.lr)  # fmt: skip


def train_status(session: Session, run: Run) -> dict[str, Any]:
    """Where a train run stands: its step, speed and time left, its loss curve and its
    checkpoints (`sdq train status`)."""
    # 1. The run, its steps as they were taken, and its checkpoints.
    run_id = run.id
    losses = session.execute(
        select(*STEP_FIGURES).where(TrainStep.run_id == run_id).order_by(TrainStep.step)
    ).all()
    checkpoints = session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step)
    ).all()
    # 2. How far it is (steps reach the database as they are taken, ahead of the last
    #    checkpoint), and how fast its recent steps went.
    steps = run.options["steps"]
    checkpointed = checkpoints[-1].step if checkpoints else 0
    step = max(checkpointed, losses[-1][0] if losses else 0)
    status = _status(session, run_id, done=checkpointed >= steps)
    left = (steps - step) * run.options["batch_size"] if status == "running" else 0
    # 3. All of it, with the shares of its wall time lost to data waits, gaps and checkpoints.
    return {
        "run_id": run_id,
        "status": status,
        "dataset": run.options["dataset"],
        "base": run.options["base"],
        "model": run.options["into"] or str(run_id),
        # A LoRA run's models are LoRA files, rendered over its base (None: pipelines).
        "lora_rank": run.options.get("lora_rank"),
        "step": step,
        "checkpoint_step": checkpointed,
        "steps": steps,
        "world_size": run.options.get("world_size", 1),
        "buckets": _bucket_mix(session, run_id) if run.options.get("buckets") else None,
        **_recent_speed(losses[-RECENT_STEPS:], left),
        **time_shares(session, run_id, run.options["batch_size"], checkpoints, steps),
        "losses": [[row[0], row[1]] for row in losses],
        "learning_rates": [[row[0], row[4]] for row in losses],
        "checkpoints": [_checkpoint_row(checkpoint) for checkpoint in checkpoints],
        "scores": run_scores(session, run_id),
        "resumed_from": _resumed_from(run.options),
    }


def _bucket_mix(session: Session, run_id: int) -> dict[str, int]:
    """A run on aspect-ratio buckets: the steps it has taken in each, widest last."""
    rows = session.execute(
        select(TrainStep.bucket, func.count())
        .where(TrainStep.run_id == run_id)
        .group_by(TrainStep.bucket)
    ).all()
    shapes = sorted(rows, key=lambda row: Bucket.named(row[0]).aspect)
    return {bucket: steps for bucket, steps in shapes}


def _resumed_from(options: dict[str, Any]) -> dict[str, int] | None:
    """The checkpoint a run went on from (`--resume-from`), or None."""
    if options.get("start_run") is None:
        return None
    return {"run": options["start_run"], "step": options["start_step"]}


def _recent_speed(recent: Sequence[Row], left: int) -> dict[str, Any]:
    """The recent steps' samples/s and model FLOPs utilisation (on a GPU whose peak is
    known), and the time the `left` samples take at that speed (only while a job trains: a
    stopped or queued run has no time left to tell)."""
    speed = statistics.median(row[2] for row in recent) if recent else None
    mfus = [row[3] for row in recent if row[3] is not None]
    return {
        "samples_per_second": round(speed, 2) if speed else None,
        "mfu": round(statistics.median(mfus), 4) if mfus else None,
        "eta_seconds": round(left / speed) if speed and left else None,
    }


def _checkpoint_row(checkpoint: Checkpoint) -> dict[str, Any]:
    return {
        "step": checkpoint.step,
        "uri": checkpoint.uri,
        "state_sha256": checkpoint.state_sha256,
        "model_revision": checkpoint.model_revision,
        "deleted": checkpoint.deleted_at is not None,
    }


def time_shares(
    session: Session,
    run_id: int,
    batch_size: int,
    checkpoints: Sequence[Checkpoint],
    steps: int,
) -> dict[str, Any]:
    """The run's samples/s over its wall time, from its first job's start to its last
    checkpoint (job gaps and checkpoints included), and the shares of that time (_shares)."""
    unknown = {"wall_samples_per_second": None, "time_shares": None}
    started = _first_run(session, run_id)
    if started is None or not checkpoints:
        return unknown
    stepping, waiting, taken, last_ended = session.execute(
        select(
            func.sum(batch_size / TrainStep.samples_per_second),
            func.sum(TrainStep.data_wait_seconds),
            func.count(),
            func.max(TrainStep.at),
        ).where(TrainStep.run_id == run_id, TrainStep.step <= checkpoints[-1].step)
    ).one()
    # A checkpoint is recorded after its step ended, whatever the database's clock rounds
    # its time to (SQLite: the second).
    ended = taken and max(as_utc(checkpoints[-1].created_at), as_utc(last_ended))
    wall = (ended - as_utc(started)).total_seconds() if taken else 0
    if wall <= 0:
        return unknown
    starting = _first_step_start(session, run_id, batch_size) - as_utc(started)
    shares = _shares(
        wall, starting.total_seconds(), stepping, waiting or 0.0, checkpoints,
        newest=(ended - as_utc(last_ended)).total_seconds(), steps=steps,
    )  # fmt: skip
    return {
        "wall_samples_per_second": round(taken * batch_size / wall, 2),
        "time_shares": {name: round(seconds / wall, 4) for name, seconds in shares.items()},
    }


def _first_run(session: Session, run_id: int) -> datetime | None:
    """When the run's first job started running."""
    return session.scalar(
        select(func.min(JobEvent.at))
        .join(Job, Job.id == JobEvent.job_id)
        .where(Job.run_id == run_id, JobEvent.status == JobStatus.running)
    )


def _shares(
    wall: float,
    starting: float,
    stepping: float,
    waiting: float,
    checkpoints: Sequence[Checkpoint],
    *,
    newest: float,
    steps: int,
) -> dict[str, float]:
    """Seconds of the wall time spent starting (the first job's rank processes, process
    group, model and first data, up to its first step), training, waiting for data, waiting
    for checkpoints (each one's copy to host memory; until the run has its last step, all of
    the `newest` one's write, which ends the wall time), writing the run's final checkpoint
    (once a run, whatever its length: nothing is left to overlap it), and between jobs
    (handing over from one to the next, queueing, retries and restarts)."""
    writing = sum(checkpoint.write_seconds or 0.0 for checkpoint in checkpoints[:-1])
    final = newest if checkpoints[-1].step >= steps else 0.0
    starting = max(0.0, starting)
    return {
        "start": starting,
        "training": stepping - waiting,
        "data_wait": waiting,
        "checkpoint": writing + newest - final,
        "final_checkpoint": final,
        "job_gap": max(0.0, wall - starting - stepping - writing - newest),
    }


def _first_step_start(session: Session, run_id: int, batch_size: int) -> datetime:
    """When the run's first step began: when it ended, less its time."""
    ended, speed = session.execute(
        select(TrainStep.at, TrainStep.samples_per_second)
        .where(TrainStep.run_id == run_id)
        .order_by(TrainStep.step)
        .limit(1)
    ).one()
    return as_utc(ended) - timedelta(seconds=batch_size / speed)


def _status(session: Session, run_id: int, *, done: bool) -> str:
    counts = dict(
        session.execute(
            select(Job.status, func.count()).where(Job.run_id == run_id).group_by(Job.status)
        ).all()
    )
    counts = {status: counts.get(status, 0) for status in JobStatus}
    if done:
        return "succeeded"
    if counts[JobStatus.dead] or counts[JobStatus.cancelled]:
        return "failed" if counts[JobStatus.dead] else "cancelled"
    unfinished = sum(count for status, count in counts.items() if status not in FINISHED)
    return "running" if counts[JobStatus.running] else "queued" if unfinished else "stopped"


def validation_images(session: Session, run_id: int) -> list[dict[str, Any]]:
    """Every validation image of the train run: the checkpoint's step, prompt, seed,
    status and spec hash (which names the image in the store)."""
    rows = session.execute(
        select(Run.options["step"].as_integer(), Generation.prompt, Generation.seed, Job.status,
               Job.spec_hash)
        .join(Job, Job.run_id == Run.id)
        .join(Generation, Generation.job_id == Job.id)
        .where(Run.kind == GENERATE.name)
        .where(Run.options["validation_of"].as_integer() == run_id)
        .order_by(Run.id, Generation.source_line)
    )  # fmt: skip
    return [
        {"step": step, "prompt": prompt, "seed": seed, "status": status, "spec_hash": spec_hash}
        for step, prompt, seed, status, spec_hash in rows
    ]
