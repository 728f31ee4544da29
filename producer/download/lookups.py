"""The download jobs' own fields, for the generic listings, and the speed its datasets
were fetched at."""

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sdq.models.datasets import SampleStatus
from sdq.models.jobs.kinds import DOWNLOAD
from sdq.models.jobs.lifecycle import as_utc
from sdq.models.tables import Job, Run


def spec_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """A job's dataset, shard and the list rows it covers, from its spec."""
    first, last = spec["first_row"], spec["first_row"] + spec["row_count"] - 1
    return {"dataset": spec["dataset"], "shard": spec["shard"], "rows": f"{first}-{last}"}


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
