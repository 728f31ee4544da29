"""The generate work: claim a batch of jobs, render what is not rendered yet, store, record.

Plain functions, no Celery: the task in workers.tasks only maps the outcome onto retries.
"""

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from time import perf_counter
from typing import TYPE_CHECKING

from PIL.Image import Image
from sqlalchemy.orm import Session, sessionmaker

from models.lifecycle import (
    Output,
    Worker,
    claim,
    extend_leases,
    fail,
    held_until,
    rendered_outputs,
    succeed,
)
from models.settings import Settings
from models.specs import GenerationSpec, batches, image_key
from models.store import ObjectStore
from models.tables import Job
from workers.images import encode_png, sha256

if TYPE_CHECKING:
    from workers.pipelines import PipelineCache

UPLOAD_THREADS = 8


@dataclass
class BatchOutcome:
    rendered: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    # Failed for a reason that may pass: send these again after a back-off.
    retry: list[int] = field(default_factory=list)
    # Held by another worker's lease: look again when it runs out (it may have died).
    held: list[int] = field(default_factory=list)
    held_until: datetime | None = None
    error: str | None = None


def generate_batch(
    job_ids: list[int],
    *,
    batch_size: int,
    sessions: sessionmaker[Session],
    store: ObjectStore,
    pipelines: "PipelineCache",
    worker: Worker,
    settings: Settings,
) -> BatchOutcome:
    outcome = BatchOutcome()
    # 1. Claim. A duplicate delivery claims nothing and ends here.
    with sessions.begin() as session:
        jobs = claim(
            session,
            job_ids,
            worker=worker,
            lease_seconds=settings.lease_seconds,
            max_attempts=settings.max_attempts,
        )
        claimed = {job.id for job in jobs}
        outcome.held = [job_id for job_id in job_ids if job_id not in claimed]
        outcome.held_until = held_until(session, outcome.held) if outcome.held else None
        if outcome.held_until is None:
            outcome.held = []
    if not jobs:
        return outcome

    # 2. A spec rendered before (by any run) is served from the store, not rendered again.
    with sessions.begin() as session:
        known = rendered_outputs(session, [job.spec_hash for job in jobs])
        reused = [
            Output(job.id, *known[job.spec_hash], render_seconds=None, cached=True)
            for job in jobs
            if job.spec_hash in known
        ]
        succeed(session, reused, worker=worker)
    outcome.cached = [output.job_id for output in reused]
    todo = [job for job in jobs if job.spec_hash not in known]

    # 3. Render and store; any failure is recorded against every job still in hand.
    try:
        with keep_leases(sessions, [job.id for job in todo], worker=worker, settings=settings):
            outputs = render_and_store(
                todo, batch_size=batch_size, store=store, pipelines=pipelines
            )
    except Exception as error:
        outcome.error = f"{type(error).__name__}: {error}"
        with sessions.begin() as session:
            outcome.retry = fail(
                session,
                [job.id for job in todo],
                error=outcome.error,
                permanent=is_permanent(error),
                max_attempts=settings.max_attempts,
                worker=worker,
            )
        return outcome

    # 4. Record.
    with sessions.begin() as session:
        succeed(session, outputs, worker=worker)
    outcome.rendered = [output.job_id for output in outputs]
    return outcome


def is_permanent(error: Exception) -> bool:
    from workers.pipelines import PipelineError

    # diffusers raises ValueError for arguments it cannot run (a size it cannot make);
    # everything else (store down, out of memory, time limit) may pass on another try.
    return isinstance(error, PipelineError | ValueError)


def render_and_store(
    jobs: list[Job], *, batch_size: int, store: ObjectStore, pipelines: "PipelineCache"
) -> list[Output]:
    from workers.pipelines import render

    by_id = {job.id: job for job in jobs}
    calls = batches([(job.id, job.batch_key) for job in jobs], batch_size)
    # Uploads run in threads while the next call renders: the device is never idle on I/O.
    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        stored = []
        for call in calls:
            group = [by_id[job_id] for job_id in call]
            specs = [GenerationSpec.from_dict(job.spec) for job in group]
            started = perf_counter()
            images = render(pipelines.get(specs[0]), specs)
            seconds_each = (perf_counter() - started) / len(group)
            stored += [
                pool.submit(_store_image, store, seconds_each, job, spec, image)
                for job, spec, image in zip(group, specs, images, strict=True)
            ]
        return [upload.result() for upload in stored]


def _store_image(
    store: ObjectStore, seconds: float, job: Job, spec: GenerationSpec, image: Image
) -> Output:
    data = encode_png(image, spec, job.spec_hash)
    uri = store.put_bytes(image_key(job.spec_hash), data, content_type="image/png")
    return Output(job.id, uri, sha256(data), render_seconds=seconds)


@contextmanager
def keep_leases(
    sessions: sessionmaker[Session], job_ids: list[int], *, worker: Worker, settings: Settings
) -> Iterator[None]:
    """Renews the leases while the work runs, so only a dead worker's jobs ever expire."""
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(settings.lease_seconds / 3):
            with sessions.begin() as session:
                extend_leases(session, job_ids, worker=worker, lease_seconds=settings.lease_seconds)

    thread = threading.Thread(target=heartbeat, name="sdq-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
