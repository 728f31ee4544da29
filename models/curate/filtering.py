"""A filtered dataset's members as the filter and the dedup jobs change them: samples
left out with their reasons, and the shard rows' counts kept true."""

from collections.abc import Iterable

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from sdq.models.datasets import SampleStatus
from sdq.models.datasets.tables import Sample, Shard


def leave_out(session: Session, dataset_id: int, reasons: dict[str, str]) -> None:
    """The samples keyed are left out of the dataset, each for its reason (again: the same)."""
    if not reasons:
        return
    samples = Sample.__table__
    session.execute(
        update(samples)
        .where(samples.c.dataset_id == dataset_id, samples.c.key == bindparam("left_out"))
        .values(status=SampleStatus.filtered, reason=bindparam("why")),
        [{"left_out": key, "why": reason} for key, reason in reasons.items()],
    )
    touched = select(Sample.shard_id).where(
        Sample.dataset_id == dataset_id, Sample.key.in_(list(reasons))
    )
    recount(session, dataset_id, session.scalars(touched.distinct()).all())


def recount(session: Session, dataset_id: int, shard_ids: Iterable[int] | None = None) -> None:
    """Each shard row's samples by status, as `sdq dataset show` lists them."""
    of_dataset = Sample.dataset_id == dataset_id
    if shard_ids is not None:
        of_dataset &= Sample.shard_id.in_(list(shard_ids))
    counts: dict[int, dict[str, int]] = {}
    for shard_id, status, samples in session.execute(
        select(Sample.shard_id, Sample.status, func.count())
        .where(of_dataset)
        .group_by(Sample.shard_id, Sample.status)
    ):
        counts.setdefault(shard_id, {})[status] = samples
    if counts:
        session.execute(
            update(Shard), [{"id": shard_id, "counts": by} for shard_id, by in counts.items()]
        )
