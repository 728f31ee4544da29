"""What the generic commands (`status`, `show`, `runs`...) show of each kind of work: its
unit, from its row, and its jobs' own fields, from its `lookups` module."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy.orm import Session

from sdq.models.jobs.kinds import KINDS


@dataclass(frozen=True)
class KindViews:
    # What one job makes, in words: "images", "samples"...
    unit: str
    # Job id -> the kind's own fields for each job (a prompt and seed, a URL...).
    job_fields: Callable[[Session, Sequence[int]], dict[int, dict[str, Any]]]


GENERIC = KindViews(unit="jobs", job_fields=lambda _session, _ids: {})


@cache
def views_of(kind: str) -> KindViews:
    if kind not in KINDS:
        return GENERIC
    row = KINDS[kind]
    return KindViews(unit=row.unit, job_fields=row.producer_module("lookups").job_fields)
