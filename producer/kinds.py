"""What the generic commands (`status`, `show`, `runs`...) show of each kind of work."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from sdq.models.jobs.kinds import DOWNLOAD, ENCODE, GENERATE, TRAIN
from sdq.producer.download import lookups as dataset_lookups
from sdq.producer.encode import lookups as encode_lookups
from sdq.producer.generate import lookups as generate_lookups
from sdq.producer.train import lookups as train_lookups


@dataclass(frozen=True)
class KindViews:
    # What one job makes, in words: "images", "samples"...
    unit: str
    # Job id -> the kind's own fields for each job (a prompt and seed, a URL...).
    job_fields: Callable[[Session, Sequence[int]], dict[int, dict[str, Any]]]


VIEWS = {
    GENERATE.name: KindViews(unit="images", job_fields=generate_lookups.job_fields),
    DOWNLOAD.name: KindViews(unit="shards", job_fields=dataset_lookups.job_fields),
    ENCODE.name: KindViews(unit="shards", job_fields=encode_lookups.job_fields),
    TRAIN.name: KindViews(unit="train-shards", job_fields=train_lookups.job_fields),
}
GENERIC = KindViews(unit="jobs", job_fields=lambda _session, _ids: {})


def views_of(kind: str) -> KindViews:
    return VIEWS.get(kind, GENERIC)
