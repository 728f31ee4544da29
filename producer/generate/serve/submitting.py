"""A request's run, as a submit makes one: its jobs written in one transaction (twins of
stored images served from the store as they are written), then sent on the generate kind's
lane (models/jobs/kinds.py). Plain, blocking code: the API runs it on its thread pool."""

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from sdq.models.generate.settings import GenerateSettings
from sdq.models.generate.specs import image_key
from sdq.models.jobs.claims import cancel_jobs
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.outbox import EnqueueFailed, enqueue
from sdq.models.loras import parse_lora, resolve_lora
from sdq.models.registry import ModelNotFound, resolve_model
from sdq.models.specs import ModelIdentity
from sdq.models.store import StoreError
from sdq.models.tables import FINISHED, Job, JobStatus, Run
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


@dataclass(frozen=True)
class Servable:
    """A request checked against the deployment: its size, and the model and LoRAs it
    names as the specs record them."""

    request: ImageRequest
    size: tuple[int, int] | None
    model_name: str
    model: ModelIdentity
    loras: tuple[dict[str, Any], ...]


def servable(app: SdqCelery, request: ImageRequest, *, default_model: str) -> Servable:
    """The request, once its numbers are within the deployment's limits and its model and
    LoRAs are known: a Refusal names the field otherwise. Checked before any room in flight
    is taken, so that a request no limit lets through is told so (422), not to wait (429)."""
    size = check_limits(request, app.settings.group(GenerateSettings))
    # The service's own default may be a folder on the server; a request's may not.
    store_url = app.settings.store_url
    model_name = _served("model", request.model, store_url) if request.model else default_model
    model, loras = _resolved(app, model_name, request.lora)
    return Servable(request, size, model_name, model, loras)


def submit(app: SdqCelery, checked: Servable, *, key_name: str | None) -> Submitted:
    """Writes the request's run and jobs (`send` sends them): a problem writes nothing."""
    settings = app.settings.group(GenerateSettings)
    request, model = checked.request, checked.model
    planned = planned_jobs(request, size=checked.size, model=model, loras=checked.loras)
    options: dict[str, Any] = {"api_key": key_name, "user": request.user,
                               "model": checked.model_name}  # fmt: skip
    submission = record_run(
        app.sessions,
        planned,
        model=model,
        source="api",
        options=options,
        # One pipeline call a message: a request is taken as soon as a worker is free.
        batching=Batching(batch_size=settings.batch_size, calls_per_task=1),
        waited=True,
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
            _named("lora", v, lambda v=v: resolve_lora(_served_lora(v, app), session=session))
            for v in lora_values
        )
    return model, loras


def send(app: SdqCelery, run_id: int) -> None:
    """The request's jobs, sent as a submit's are: `batch_size` a message."""
    with _cancelled_unless_sent(app, [run_id]), app.sender() as sender:
        enqueue(app.sessions, sender, run_id)


def send_together(app: SdqCelery, run_ids: list[int], job_ids: list[int]) -> None:
    """The jobs of requests that arrived together, in one message: their specs share a
    batch key (models/generate/specs.py), so one pipeline call renders them all. They were
    written queued: nothing is left to mark."""
    with _cancelled_unless_sent(app, run_ids), app.sender() as sender:
        sender(GENERATE, [job_ids], {"batch_size": len(job_ids), "waited": True})


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


# What a request may name over HTTP: a name sdq knows (tiny, a pushed name, RUN@STEP,
# RUN@best:METRIC), a hub id (models only), or an s3:// URI in the deployment's own bucket;
# never a file or folder of the server, nor another bucket read with the server's keys.
NAME = re.compile(r"[\w.@:-]+")
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def _served(field: str, value: str, store_url: str) -> str:
    if value.startswith("s3://"):
        bucket = store_url.removeprefix("s3://").partition("/")[0]
        if not store_url.startswith("s3://") or not value.startswith(f"s3://{bucket}/"):
            raise Refusal(field, f"{value!r}: only s3:// URIs in this deployment's bucket")
        return value
    named = NAME.fullmatch(value) or (field == "model" and HUB_ID.fullmatch(value))
    if not named or ".." in value:
        hub = "a hub id, " if field == "model" else ""
        raise Refusal(field, f"{value!r}: over HTTP a {field} is a name (`sdq model push`), "
                             f"{hub}or an s3:// URI in this deployment's bucket")  # fmt: skip
    if Path(value).exists():  # a name that is also a path here would be read from disk
        raise Refusal(field, f"{value!r}: names no {field} this service serves", status=404)
    return value


def _served_lora(value: str, app: SdqCelery) -> str:
    """A `--lora` value (REF[:SCALE]) whose REF may be named over HTTP."""
    _served("lora", parse_lora(value)[0], app.settings.store_url)
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


def job_of(app: SdqCelery, job_id: int, key_name: str | None) -> Job | None:
    """The generation job, where the caller's key asked for it (any, without keys)."""
    query = select(Job).where(Job.id == job_id, Job.kind == GENERATE.name)
    if key_name is not None:
        query = query.join(Run).where(Run.options["api_key"].as_string() == key_name)
    with app.sessions() as session:
        job = session.scalars(query).one_or_none()
        session.expunge_all()
    return job


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
