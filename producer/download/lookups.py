"""The download jobs' own fields, for the generic listings, and the speed its datasets
were fetched at."""

from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from sdq.models.datasets import SampleStatus
from sdq.models.datasets.tables import Dataset, Sample, Shard
from sdq.models.jobs.kinds import DOWNLOAD
from sdq.models.jobs.lifecycle import as_utc
from sdq.models.tables import Job, Run


def spec_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """A job's dataset, shard and the list rows it covers, from its spec."""
    first, last = spec["first_row"], spec["first_row"] + spec["row_count"] - 1
    return {"dataset": spec["dataset"], "shard": spec["shard"], "rows": f"{first}-{last}"}


def fetched_of(session: Session, run_id: int) -> tuple[int, int]:
    """How many samples of the shards a download run wrote were fetched, and of how many."""
    written = and_(
        Job.spec["dataset"].as_string() == Dataset.name,
        Job.spec["shard"].as_integer() == Shard.number,
    )
    shards = (
        select(Shard.id)
        .join(Dataset, Dataset.id == Shard.dataset_id)
        .join(Job, written)
        .where(Job.run_id == run_id)
    )
    fetched, rows = session.execute(
        select(func.count().filter(Sample.status == SampleStatus.success), func.count()).where(
            Sample.shard_id.in_(shards)
        )
    ).one()
    return fetched, rows


def _wall_seconds(session: Session, name: str) -> float | None:
    """From the first download job's start to the last one's end, across the dataset's
    runs: what a person waited, whatever the number of workers."""
    started, finished = session.execute(
        select(func.min(Job.started_at), func.max(Job.finished_at))
        .join(Run, Run.id == Job.run_id)
        .where(Run.kind == DOWNLOAD.name, Run.options["dataset"].as_string() == name)
        .where(Job.cached.is_(False), Job.started_at.is_not(None))
    ).one()
    if started is None or finished is None:
        return None
    return (as_utc(finished) - as_utc(started)).total_seconds()


def download_speed(session: Session, summary: dict[str, Any]) -> dict[str, Any]:
    """What `sdq dataset show` adds of the download's (ProducerHooks): the images a second
    its samples were fetched at."""
    ok = summary["by_status"].get(SampleStatus.success, 0)
    seconds = _wall_seconds(session, summary["name"])
    return {"images_per_second": round(ok / seconds, 2) if seconds else None}
