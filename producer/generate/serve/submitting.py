"""A request's run, as a submit makes one: its jobs written in one transaction (twins of
stored images served from the store as they are written), then sent on the generate kind's
lane (models/jobs/kinds.py). Plain, blocking code: the API runs it on its thread pool."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from sdq.models.generate.settings import GenerateSettings
from sdq.models.generate.specs import image_key
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.lifecycle import cancel_jobs
from sdq.models.jobs.outbox import EnqueueFailed, enqueue
from sdq.models.loras import resolve_lora
from sdq.models.registry import ModelNotFound, resolve_model
from sdq.models.specs import ModelIdentity
from sdq.models.store import StoreError
from sdq.models.tables import FINISHED, Job, JobStatus
from sdq.producer.generate.serve.requests import ImageRequest, Refusal, check_limits, planned_jobs
from sdq.producer.generate.submit import Batching, record_run
from sdq.workers.app import SdqCelery


@dataclass(frozen=True)
class Submitted:
    run_id: int
    job_ids: list[int]
    to_render: list[int]  # those not served from the store as they were written
    batch_key: str  # what its jobs share of a pipeline call's settings


class NotSent(Exception):
    """The broker did not take the request's messages: its jobs are cancelled, not left to
    render for nobody."""


def submit(
    app: SdqCelery, request: ImageRequest, *, key_name: str | None, default_model: str
) -> Submitted:
    """Checks the request and writes its run and jobs (`send` sends them): a problem
    writes nothing."""
    settings = app.settings.group(GenerateSettings)
    size = check_limits(request, settings)
    # The service's own default may be a folder on the server; a request's may not.
    model_name = _not_a_path("model", request.model) if request.model else default_model
    model, loras = _resolved(app, model_name, request.lora)
    planned = planned_jobs(request, size=size, model=model, loras=loras)
    options: dict[str, Any] = {"api_key": key_name, "user": request.user, "model": model_name}
    submission = record_run(
        app.sessions,
        planned,
        model=model,
        source="api",
        options=options,
        # One pipeline call a message: a request is taken as soon as a worker is free.
        batching=Batching(batch_size=settings.batch_size, calls_per_task=1),
    )
    with app.sessions() as session:
        jobs = session.execute(
            select(Job.id, Job.cached).where(Job.run_id == submission.run_id).order_by(Job.id)
        ).all()
    return Submitted(
        submission.run_id,
        job_ids=[job_id for job_id, _ in jobs],
        to_render=[job_id for job_id, cached in jobs if not cached],
        batch_key=planned[0].spec.batch_key(),
    )


def _resolved(
    app: SdqCelery, model_name: str, lora_values: list[str]
) -> tuple[ModelIdentity, tuple[dict[str, Any], ...]]:
    """The model and LoRAs a request names, as the specs record them."""
    with app.sessions() as session:
        model = _named(
            "model", model_name, lambda: resolve_model(model_name, store=app.store, session=session)
        )
        loras = tuple(
            _named("lora", v, lambda v=v: resolve_lora(_not_a_path("lora", v), session=session))
            for v in lora_values
        )
    return model, loras


def send(app: SdqCelery, run_id: int) -> None:
    """The request's jobs, sent as a submit's are: `batch_size` a message."""
    with _cancelled_unless_sent(app, [run_id]), app.sender(waited=True) as sender:
        enqueue(app.sessions, sender, run_id)


def send_together(app: SdqCelery, run_ids: list[int], job_ids: list[int]) -> None:
    """The jobs of requests that arrived together, in one message: their specs share a
    batch key (models/generate/specs.py), so one pipeline call renders them all. They were
    written queued: nothing is left to mark."""
    with _cancelled_unless_sent(app, run_ids), app.sender(waited=True) as sender:
        sender(GENERATE, [job_ids], {"batch_size": len(job_ids)})


@contextmanager
def _cancelled_unless_sent(app: SdqCelery, run_ids: list[int]) -> Iterator[None]:
    """A broker that does not take the requests' messages has their jobs cancelled, not
    left to render for nobody, and the caller told (503)."""
    try:
        yield
    except Exception as error:  # kombu raises several kinds for a broker it cannot reach
        with app.sessions.begin() as session:
            for run_id in run_ids:
                cancel_jobs(session, run_id)
        cause = error.__cause__ if isinstance(error, EnqueueFailed) else error
        raise NotSent(str(cause)) from error


def _not_a_path(field: str, value: str) -> str:
    """Files of the server are not named over HTTP: a model or LoRA is a name, a hub id or
    an s3:// URI here."""
    if value.startswith(("/", ".", "~", "file:")) or Path(value).exists():
        raise Refusal(
            field,
            f"{value!r}: a path on the server is not taken over HTTP; name a model or LoRA "
            "(`sdq model push`), a hub id or an s3:// URI",
        )
    return value


def _named(field: str, value: str, resolve):
    try:
        return resolve()
    except (ModelNotFound, StoreError) as error:
        raise Refusal(field, f"{value!r}: {error}", status=404) from None
    except ValueError as error:
        raise Refusal(field, f"{value!r}: {error}") from None


def job_rows(app: SdqCelery, job_ids: list[int]) -> list[Job]:
    with app.sessions() as session:
        jobs = session.scalars(select(Job).where(Job.id.in_(job_ids)).order_by(Job.id)).all()
        session.expunge_all()
    return list(jobs)


def unsettled(app: SdqCelery, job_ids: list[int]) -> set[int]:
    """The jobs not finished yet (a job waiting for its retry is not)."""
    with app.sessions() as session:
        return set(
            session.scalars(
                select(Job.id).where(Job.id.in_(job_ids), Job.status.not_in(FINISHED))
            ).all()
        )


def job_of(app: SdqCelery, job_id: int) -> Job | None:
    jobs = job_rows(app, [job_id])
    return jobs[0] if jobs and jobs[0].kind == GENERATE.name else None


def stored_image(app: SdqCelery, spec_hash: str) -> str | None:
    """The store key of the image a spec hash names, where one was made."""
    with app.sessions() as session:
        found = session.scalars(
            select(Job.spec_hash)
            .where(
                Job.spec_hash == spec_hash,
                Job.status == JobStatus.succeeded,
                Job.output_uri.is_not(None),
            )
            .limit(1)
        ).first()
    return image_key(found) if found else None
