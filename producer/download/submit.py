"""Writing a download run: the dataset (made on first use), one shard row per list slice
and one job per shard, in one transaction; the jobs table is the outbox, as for every
kind. A slice some job already made into a shard is served as it is."""

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.datasets import ImageOptions, ListColumns, SampleStatus, is_transient
from sdq.models.datasets.tables import Dataset, Sample, Shard
from sdq.models.download.specs import SliceSpec
from sdq.models.jobs.kinds import DOWNLOAD
from sdq.models.jobs.outbox import add_jobs, open_run
from sdq.models.tables import Job, JobStatus, Run
from sdq.producer.datasets.lookups import dataset_named
from sdq.producer.download.lists import PlannedList, Slice, slices
from sdq.producer.errors import NotFound


class DatasetMismatch(Exception):
    pass


@dataclass(frozen=True)
class DatasetOptions:
    """Fixed when the dataset is made: every shard of a dataset is cut and made alike."""

    image: ImageOptions
    rows_per_shard: int

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.image), "rows_per_shard": self.rows_per_shard}


@dataclass(frozen=True)
class DownloadSubmission:
    run_id: int
    dataset: str
    jobs: int
    cached: int


def record_download(
    sessions: sessionmaker[Session],
    name: str,
    lists: Sequence[PlannedList],
    *,
    columns: ListColumns,
    options: DatasetOptions,
) -> DownloadSubmission:
    with sessions.begin() as session:
        dataset = _dataset(session, name, options)
        run = open_run(
            session,
            DOWNLOAD,
            source=", ".join(planned.location for planned in lists),
            options={"dataset": name, **options.to_dict(), "columns": asdict(columns)},
            jobs_per_message=1,  # a slice is minutes of work: one per message
        )
        specs = [
            _spec(name, number, piece, columns, options)
            for number, piece in _numbered(session, dataset.id, lists, options.rows_per_shard)
        ]
        cached = add_jobs(session, run, DOWNLOAD, specs)
    return DownloadSubmission(run.id, name, len(specs), cached)


def record_retry(
    sessions: sessionmaker[Session], name: str, reasons: Sequence[str] = ()
) -> DownloadSubmission:
    """A run that fetches again, shard by shard, only the samples that failed for a reason
    that may have passed (timeouts, busy servers), or for one of `reasons` when given;
    every other row stays as it is."""
    wanted = (lambda reason: reason in reasons) if reasons else is_transient
    with sessions.begin() as session:
        dataset = dataset_named(session, name)
        _check_reasons(session, dataset, reasons)
        failed: dict[int, list[str]] = {}
        for shard_id, key, reason in session.execute(
            select(Sample.shard_id, Sample.key, Sample.reason)
            .where(Sample.dataset_id == dataset.id, Sample.status == SampleStatus.failed)
            .order_by(Sample.key)
        ):
            if wanted(reason):
                failed.setdefault(shard_id, []).append(key)
        run = open_run(
            session,
            DOWNLOAD,
            source=name,
            options={"dataset": name, "retry_failed": True, "reasons": list(reasons)},
        )
        specs = [
            replace(
                spec,
                retry_keys=tuple(failed[shard.id]),
                previous_sha256=shard.sha256,
                retry_run=run.id,
            )
            for shard, spec in _made(session, dataset)
            if shard.id in failed
        ]
        cached = add_jobs(session, run, DOWNLOAD, specs)
    return DownloadSubmission(run.id, name, len(specs), cached)


def _check_reasons(session: Session, dataset: Dataset, reasons: Sequence[str]) -> None:
    """A reason no sample failed for is a typo, not an empty retry: name the ones there are."""
    counts = dict(
        session.execute(
            select(Sample.reason, func.count())
            .where(Sample.dataset_id == dataset.id, Sample.status == SampleStatus.failed)
            .group_by(Sample.reason)
            .order_by(func.count().desc(), Sample.reason)
        ).all()
    )
    unknown = [reason for reason in reasons if reason not in counts]
    if unknown:
        listing = ", ".join(f"{reason!r} ({count})" for reason, count in counts.items())
        raise NotFound(
            f"no sample of dataset {dataset.name!r} failed for "
            + ", ".join(map(repr, unknown))
            + f"; its failures: {listing or 'none'}"
        )


def _made(session: Session, dataset: Dataset) -> list[tuple[Shard, SliceSpec]]:
    """Each written shard of the dataset with the spec of the job that last wrote it."""
    specs = {}
    for (spec,) in session.execute(
        select(Job.spec)
        .join(Run, Run.id == Job.run_id)
        .where(Run.kind == DOWNLOAD.name, Job.status == JobStatus.succeeded)
        .where(Run.options["dataset"].as_string() == dataset.name)
        .order_by(Job.finished_at)
    ):
        specs[spec["shard"]] = SliceSpec.from_dict(spec)
    shards = session.scalars(
        select(Shard).where(Shard.dataset_id == dataset.id, Shard.sha256.is_not(None))
    )
    return [(shard, specs[shard.number]) for shard in shards if shard.number in specs]


def _dataset(session: Session, name: str, options: DatasetOptions) -> Dataset:
    dataset = session.scalars(select(Dataset).where(Dataset.name == name)).one_or_none()
    if dataset is None:
        dataset = Dataset(name=name, options=options.to_dict())
        session.add(dataset)
        session.flush()
        return dataset
    if dataset.options != options.to_dict():
        differ = sorted(
            key for key, value in options.to_dict().items() if dataset.options.get(key) != value
        )
        raise DatasetMismatch(
            f"dataset {name!r} was made with "
            # The options' names are their flags' (--rows-per-shard is rows_per_shard).
            + ", ".join(f"--{key.replace('_', '-')} {dataset.options.get(key)}" for key in differ)
            + ": give the same options, or another name for a new dataset"
        )
    return dataset


def _numbered(
    session: Session, dataset_id: int, lists: Sequence[PlannedList], rows_per_shard: int
) -> list[tuple[int, Slice]]:
    """Each slice with its shard number: the one it had if this list was planned into the
    dataset before, else the next free one. New slices become shard rows now."""
    rows = session.execute(
        select(Shard.source_id, Shard.first_row, Shard.number).where(Shard.dataset_id == dataset_id)
    )
    known = {(source_id, first_row): number for source_id, first_row, number in rows}
    next_number = max(known.values(), default=-1) + 1
    numbered = []
    for planned in lists:
        for piece in slices(planned, rows_per_shard):
            number = known.get((planned.source_id, piece.first_row))
            if number is None:
                number, next_number = next_number, next_number + 1
                known[(planned.source_id, piece.first_row)] = number
                session.add(
                    Shard(
                        dataset_id=dataset_id,
                        number=number,
                        source_uri=planned.uri,
                        source_id=planned.source_id,
                        first_row=piece.first_row,
                        row_count=piece.row_count,
                    )
                )
            numbered.append((number, piece))
    session.flush()
    return numbered


def _spec(
    name: str, number: int, piece: Slice, columns: ListColumns, options: DatasetOptions
) -> SliceSpec:
    return SliceSpec(
        dataset=name,
        shard=number,
        source_uri=piece.source.uri,
        source_id=piece.source.source_id,
        first_row=piece.first_row,
        row_count=piece.row_count,
        key_digits=len(str(options.rows_per_shard - 1)),
        columns=columns,
        image=options.image,
    )
