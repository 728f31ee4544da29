"""Tables: the record of truth for runs, jobs, their history and the models they used.

These are kind-neutral; what only one kind of work has lives in a table of its own keyed
by job, in the kind's folder (models/<kind>/tables.py).
"""

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Enum,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Stable constraint names, so migrations can name what they alter on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JsonDocument = JSON().with_variant(JSONB(), "postgresql")
# SQLite only auto-increments INTEGER PRIMARY KEY; Postgres gets 64-bit ids for the long run.
Id = BigInteger().with_variant(Integer(), "sqlite")
# A hex digest people look up by its first characters (`sdq show 3fa9c1`) compares byte by
# byte ("C"): then a prefix is a range of its index, where a language's collation made
# Postgres read every entry of it.
PrefixSearchedDigest = String(64).with_variant(String(64, collation="C"), "postgresql")


class JobStatus(enum.StrEnum):
    pending = "pending"  # written, not yet handed to the broker
    queued = "queued"  # handed to the broker
    running = "running"  # claimed by a worker that holds a lease
    succeeded = "succeeded"
    failed = "failed"  # failed, will be tried again
    dead = "dead"  # failed for good: permanent error or attempts exhausted
    cancelled = "cancelled"


FINISHED = (JobStatus.succeeded, JobStatus.dead, JobStatus.cancelled)
CLAIMABLE = (JobStatus.pending, JobStatus.queued, JobStatus.failed)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _status_type() -> Enum:
    # A VARCHAR with a CHECK keeps adding a status a plain migration on every backend.
    return Enum(
        JobStatus,
        name="job_status",
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda statuses: [status.value for status in statuses],
    )


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    source: Mapped[str | None] = mapped_column(Text)
    options: Mapped[dict[str, Any]] = mapped_column(JsonDocument)
    job_count: Mapped[int] = mapped_column(Integer)
    # How the run's jobs travel: this many job ids per task message, each message with
    # these keyword arguments. Kept on the run so any later re-send makes the same messages.
    jobs_per_message: Mapped[int] = mapped_column(Integer, server_default="1")
    task_options: Mapped[dict[str, Any]] = mapped_column(JsonDocument, server_default="{}")
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    spec: Mapped[dict[str, Any]] = mapped_column(JsonDocument)
    # The spec decides the output, and its hash names it: equal hashes, equal outputs.
    spec_hash: Mapped[str] = mapped_column(PrefixSearchedDigest)
    status: Mapped[JobStatus] = mapped_column(_status_type(), default=JobStatus.pending)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker_host: Mapped[str | None] = mapped_column(Text)
    device: Mapped[str | None] = mapped_column(Text)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    enqueued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # A failed job's retry is due in a queue by then (beat's relay sends it again past it).
    retry_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Time spent getting ready for the work (loading a model), this job's share of it:
    # kept apart from the work itself so that "where did the time go" adds up in SQL.
    setup_seconds: Mapped[float | None]
    # Time spent doing the work itself, without queueing, setup or bookkeeping.
    work_seconds: Mapped[float | None]
    # What the job made, in its kind's unit: images for generation, samples for the others.
    units: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    output_uri: Mapped[str | None] = mapped_column(Text)
    output_sha256: Mapped[str | None] = mapped_column(String(64))
    cached: Mapped[bool] = mapped_column(default=False)

    __table_args__ = (
        # Kind rides along (Postgres): counting jobs by kind and status, as every metrics
        # scrape does, reads this index alone instead of the whole table.
        Index("ix_jobs_run_id_status", "run_id", "status", postgresql_include=["kind"]),
        Index("ix_jobs_spec_hash_status", "spec_hash", "status"),
        # A run's jobs in id order: its messages are sent a page at a time, each page read
        # from where the last ended, so a run of millions reads each of its jobs once. What
        # says a job is sendable rides along (Postgres): a re-send of a run that is mostly
        # done reads this index alone, not every job's row.
        Index(
            "ix_jobs_run_id_id",
            "run_id",
            "id",
            postgresql_include=["status", "lease_expires_at"],
        ),
        # The hourly rollups and the metrics read recent finished jobs. Only finished jobs
        # are in it (Postgres): a submit's jobs go in as they finish, not all at once.
        Index("ix_jobs_finished_at", "finished_at", postgresql_where="finished_at IS NOT NULL"),
        # Unfinished jobs are few among millions; the relay and lease sweeps scan only them.
        Index(
            "ix_jobs_unfinished",
            "status",
            "lease_expires_at",
            postgresql_where="status NOT IN ('succeeded', 'dead', 'cancelled')",
        ),
    )


class JobEvent(Base):
    """Append-only history: one row per status change, never updated."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    status: Mapped[JobStatus] = mapped_column(_status_type())
    at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    worker_host: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index("ix_job_events_job_id_at", "job_id", "at"),
        # Setbacks (sent back, failed, given up) are few among millions of events: the
        # rollups' failures by hour and the metrics' counters read only them.
        Index(
            "ix_job_events_setbacks",
            "at",
            postgresql_where="status IN ('pending', 'failed', 'dead')",
        ),
    )


class ModelRecord(Base):
    """A model identity as resolved once: name, where it came from and what exactly it was."""

    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    source: Mapped[str] = mapped_column(Text)
    revision: Mapped[str] = mapped_column(String(64))
    # Where a pushed copy lives in the object store, for `sdq model push`.
    store_prefix: Mapped[str | None] = mapped_column(Text)
    # Its VAE, text encoder and tokenizer files' hash, where known (registry.py).
    encoders_hash: Mapped[str | None] = mapped_column(String(64))
    # What the record is: a diffusers pipeline folder (`--model`), or a LoRA's weights in
    # one safetensors file (`--lora`; its revision is the file's sha256).
    format: Mapped[str] = mapped_column(String(16), server_default="pipeline")
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )

    __table_args__ = (UniqueConstraint("name", "revision", name="uq_models_name_revision"),)


class HourlyRollup(Base):
    """Per hour, kind, model and worker: jobs finished, what they made, where the time went
    and how often they failed. Beat keeps it current; dashboards read it, not the jobs."""

    __tablename__ = "hourly_rollups"

    hour: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    # '' where a kind has no one model, or a job no worker: key columns cannot be NULL.
    model: Mapped[str] = mapped_column(Text, primary_key=True)
    worker: Mapped[str] = mapped_column(Text, primary_key=True)
    jobs: Mapped[int] = mapped_column(Integer)
    cached: Mapped[int] = mapped_column(Integer)
    units: Mapped[int] = mapped_column(Integer)
    setup_seconds: Mapped[float]
    work_seconds: Mapped[float]
    failures: Mapped[int] = mapped_column(Integer)


class SickWorker(Base):
    """A GPU worker taken out of rotation: its device failed task after task on jobs other
    workers then did. It takes no jobs until restarted or cleared (`sdq worker clear`)."""

    __tablename__ = "sick_workers"

    worker: Mapped[str] = mapped_column(Text, primary_key=True)  # Celery's node name
    queues: Mapped[list[str]] = mapped_column(JsonDocument)  # what it consumed, to give back
    reason: Mapped[str] = mapped_column(Text)
    since: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Deployment(Base):
    """What every process of a deployment must agree on, as `sdq db upgrade` last set it:
    the object store its records point into (a worker that wrote elsewhere would record
    images nobody else can read, and they would be served from cache ever after). One
    row."""

    __tablename__ = "deployment"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    store_uri: Mapped[str] = mapped_column(Text)  # the store's own URI of its root
    set_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class MaintenanceTick(Base):
    """When each of beat's periodic tasks last ran and what it did; `sdq health` reads it."""

    __tablename__ = "maintenance_ticks"

    task: Mapped[str] = mapped_column(Text, primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    result: Mapped[dict[str, Any]] = mapped_column(JsonDocument)
