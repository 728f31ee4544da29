"""Writing a filtered dataset: the parent's kept samples that pass the rules become the
members of a new dataset, with no image copied; those left out are rows too, each with the
first rule it failed. The score rules run in the database (one INSERT ... SELECT, however
many samples); near-duplicates are found by jobs on the curate queue, since they need the
CLIP image embeddings in the store."""

from dataclasses import asdict, dataclass
from math import ceil
from typing import Any

from sqlalchemy import (
    ColumnElement,
    DateTime,
    Numeric,
    Text,
    case,
    cast,
    func,
    insert,
    literal,
    select,
)
from sqlalchemy.orm import Session, aliased, sessionmaker

from sdq.models.curate.filtering import recount
from sdq.models.curate.specs import DedupSpec
from sdq.models.curate.tables import SAMPLE_QUALITY as QUALITY
from sdq.models.datasets import SampleStatus, derived_from
from sdq.models.datasets.tables import Dataset, Sample, Shard
from sdq.models.jobs.kinds import CURATE
from sdq.models.jobs.lifecycle import utcnow
from sdq.models.jobs.outbox import add_jobs, open_run
from sdq.producer.datasets.lookups import (
    dataset_named,
    no_usable_samples,
    removed_by_rule,
    still_making,
)

# Up to this many members, near-duplicates are found in one job (a few GB of similarities
# a block at a time); beyond it, k-means first, then a job per cluster of about as many.
ONE_JOB_SAMPLES = 50_000
SAMPLES_PER_CLUSTER = 10_000


class CannotFilter(Exception):
    pass


@dataclass(frozen=True, kw_only=True)
class Rules:
    """What a sample must pass to be kept, as the options give it (None: not asked)."""

    min_clip_score: float | None = None
    min_aesthetic: float | None = None
    max_nsfw: float | None = None
    min_size: int | None = None
    dedup: float | None = None  # the cosine from which two samples are near-duplicates
    dedup_clusters: int | None = None  # None: chosen by the number of members

    def to_dict(self) -> dict[str, Any]:
        return {name: value for name, value in asdict(self).items() if value is not None}

    def cuts(self) -> dict[str, float]:
        """Each score's bound, where a rule reads it: what the dataset's page marks."""
        bounds = {"clip_score": self.min_clip_score, "aesthetic": self.min_aesthetic,
                  "nsfw": self.max_nsfw}  # fmt: skip
        return {score: bound for score, bound in bounds.items() if bound is not None}

    def scores_needed(self) -> dict[str, str]:
        """The scores the rules read, by the option that asks for them."""
        needed = {
            "--min-clip-score": "clip_score" if self.min_clip_score is not None else None,
            "--min-aesthetic": "aesthetic" if self.min_aesthetic is not None else None,
            "--max-nsfw": "nsfw" if self.max_nsfw is not None else None,
            "--dedup": "clip_score" if self.dedup is not None else None,
        }
        return {option: score for option, score in needed.items() if score}


@dataclass(frozen=True)
class FilterSubmission:
    dataset: str
    parent: str
    samples: int  # the parent's kept samples, each kept or left out here
    kept: int  # before near-duplicates are left out
    removed: dict[str, int]
    run_id: int | None  # the dedup run, when asked for
    jobs: int
    cached: int = 0


def record_filter(
    sessions: sessionmaker[Session], parent_name: str, name: str, rules: Rules
) -> FilterSubmission:
    """The filtered dataset, its members and left-out samples, and its dedup run, in one
    transaction: nothing is written when any check fails."""
    with sessions.begin() as session:
        # 1. The parent, readable and scored as the rules need; the name free.
        parent = _filterable(session, parent_name, name)
        revision = _scored_by(session, parent, rules)
        # 2. The new dataset: a shard row per parent file, a sample row per kept sample.
        dataset = Dataset(name=name, options=_options(parent, rules))
        session.add(dataset)
        session.flush()
        _mirror_shards(session, parent, dataset)
        _judge_samples(session, parent, dataset, rules)
        recount(session, dataset.id)
        samples, kept = _members(session, dataset)
        if not kept:
            raise CannotFilter(
                f"the rules ({_said(rules)}) keep none of the {samples} samples "
                f"of {parent_name!r}: nothing was written"
            )
        # 3. Near-duplicates, by jobs: the dataset is readable once their run is done.
        run_id, jobs = (
            (None, 0)
            if rules.dedup is None
            else _dedup_run(session, dataset, parent, revision, rules, kept)
        )
        return FilterSubmission(
            dataset=name,
            parent=parent_name,
            samples=samples,
            kept=kept,
            removed=removed_by_rule(session, dataset.id),
            run_id=run_id,
            jobs=jobs,
        )


def _filterable(session: Session, parent_name: str, name: str) -> Dataset:
    parent = dataset_named(session, parent_name)
    if session.scalar(select(Dataset.id).where(Dataset.name == name)) is not None:
        raise CannotFilter(f"--into {name}: a dataset of that name exists already")
    if (making := still_making(session, parent)) is not None:
        raise CannotFilter(
            f"dataset {parent_name!r} is still being made by run {making}: "
            "its members are not final yet"
        )
    if unusable := no_usable_samples(session, parent):
        raise CannotFilter(unusable)
    return parent


def _scored_by(session: Session, parent: Dataset, rules: Rules) -> str | None:
    """The CLIP model revision the parent's kept samples were scored by; refused when a
    rule reads a score that some kept sample lacks."""
    needed = rules.scores_needed()
    if not needed:
        return None
    kept = (Sample.dataset_id == parent.id) & (Sample.status == SampleStatus.success)
    scored = select(QUALITY).join(Sample, Sample.id == QUALITY.c.sample_id).where(kept).subquery()
    total, curated, *have = session.execute(
        select(
            func.count(),
            func.count(scored.c.clip_score),
            *(func.count(scored.c[score]) for score in needed.values()),
        )
    ).one()
    if not curated:
        raise CannotFilter(
            f"dataset {parent.name!r} was never curated: `sdq curate "
            f"{parent.name} --model CLIP` scores it first"
        )
    for (option, score), count in zip(needed.items(), have, strict=True):
        if count < total:
            raise CannotFilter(_unscored(parent.name, option, score, total - count, total))
    return session.scalar(
        select(scored.c.model_revision).where(scored.c.model_revision.is_not(None)).limit(1)
    )


def _unscored(name: str, option: str, score: str, missing: int, total: int) -> str:
    if score in ("aesthetic", "nsfw"):
        head = "--aesthetic-head" if score == "aesthetic" else "--nsfw-head"
        return (
            f"{option}: {missing} of the {total} kept samples of {name!r} have no {score} "
            f"score: `sdq curate {name} --model CLIP {head} FILE` gives them one"
        )
    return (
        f"{option}: {missing} of the {total} kept samples of {name!r} are not scored yet "
        f"(a curate run still going, or failed shards): `sdq dataset show {name}`"
    )


def _options(parent: Dataset, rules: Rules) -> dict[str, Any]:
    """The parent's image options, and where its images are and by what rules."""
    inherited = {
        key: value
        for key, value in parent.options.items()
        if key not in ("parent", "images_of", "filter", "cuts", "made_by_run")
    }
    images_of = derived_from(parent.options) or parent.name
    return {**inherited, "parent": parent.name, "images_of": images_of,
            "filter": rules.to_dict(), "cuts": rules.cuts()}  # fmt: skip


def _mirror_shards(session: Session, parent: Dataset, dataset: Dataset) -> None:
    """A shard row for each of the parent's downloaded files: the same file (uri, hash),
    nothing copied (no bytes, no seconds)."""
    copied = ("number", "source_uri", "source_id", "first_row", "row_count", "uri", "sha256")
    now = literal(utcnow(), DateTime(timezone=True))
    session.execute(
        insert(Shard).from_select(
            ["dataset_id", *copied, "bytes", "seconds", "finished_at"],
            select(
                literal(dataset.id),
                *(getattr(Shard, name) for name in copied),
                literal(0),
                literal(0.0),
                now,
            ).where(Shard.dataset_id == parent.id, Shard.sha256.is_not(None)),
        )
    )


def _judge_samples(session: Session, parent: Dataset, dataset: Dataset, rules: Rules) -> None:
    """Every kept sample of the parent, as a member or left out with its first failed
    rule, computed by the database."""
    reason = _first_failed_rule(session, rules)
    status = case((reason.is_(None), SampleStatus.success), else_=SampleStatus.filtered)
    parent_shard, shard = aliased(Shard), aliased(Shard)
    copied = (
        "key",
        "url",
        "caption",
        "sha256",
        "width",
        "height",
        "original_width",
        "original_height",
    )
    rows = (
        select(
            literal(dataset.id),
            shard.id,
            *(getattr(Sample, name) for name in copied),
            status,
            reason,
            func.coalesce(Sample.origin_id, Sample.id),
        )
        .join(parent_shard, parent_shard.id == Sample.shard_id)
        .join(shard, (shard.dataset_id == dataset.id) & (shard.number == parent_shard.number))
        .outerjoin(QUALITY, QUALITY.c.sample_id == Sample.id)
        .where(Sample.dataset_id == parent.id, Sample.status == SampleStatus.success)
    )
    columns = ["dataset_id", "shard_id", *copied, "status", "reason", "origin_id"]
    session.execute(insert(Sample).from_select(columns, rows))


def _first_failed_rule(session: Session, rules: Rules) -> ColumnElement:
    """The reason a sample is left out, in words ("aesthetic 3.92 < 5"), or NULL."""
    number = _two_decimals(session)
    checks = []
    for score, bound, failed, sign in (
        ("clip_score", rules.min_clip_score, lambda s, b: s < b, "<"),
        ("aesthetic", rules.min_aesthetic, lambda s, b: s < b, "<"),
        ("nsfw", rules.max_nsfw, lambda s, b: s > b, ">"),
    ):
        if bound is not None:
            value = QUALITY.c[score]
            said = f"{score} " + number(value) + f" {sign} {bound:g}"
            checks.append((failed(value, bound), said))
    if rules.min_size is not None:
        width, height = Sample.original_width, Sample.original_height
        size = cast(width, Text) + "x" + cast(height, Text)
        checks.append(
            (
                (width < rules.min_size) | (height < rules.min_size),
                "size " + size + f" < {rules.min_size}",
            )
        )
    return case(*checks, else_=None) if checks else literal(None, Text)


def _two_decimals(session: Session):
    if session.get_bind().dialect.name == "postgresql":
        return lambda value: cast(func.round(cast(value, Numeric), 2), Text)
    return lambda value: func.printf("%.2f", value)


def _members(session: Session, dataset: Dataset) -> tuple[int, int]:
    """The samples judged, and how many of them were kept."""
    return session.execute(
        select(func.count(), func.count().filter(Sample.status == SampleStatus.success)).where(
            Sample.dataset_id == dataset.id
        )
    ).one()


def _dedup_run(
    session: Session,
    dataset: Dataset,
    parent: Dataset,
    revision: str | None,
    rules: Rules,
    kept: int,
) -> tuple[int, int]:
    """The run that leaves out near-duplicates: one job, or the clustering job that adds a
    job per cluster. The dataset is read only once it is done."""
    clusters = rules.dedup_clusters
    if clusters is None:
        clusters = 0 if kept <= ONE_JOB_SAMPLES else ceil(kept / SAMPLES_PER_CLUSTER)
    spec = DedupSpec(
        dataset=dataset.name,
        dataset_id=dataset.id,
        images_of=dataset.options["images_of"],
        model_revision=revision,
        threshold=rules.dedup,
        rank_by="aesthetic" if _has_aesthetic(session, dataset) else "clip_score",
        clusters=min(clusters, kept),
    )
    run = open_run(
        session,
        CURATE,
        source=dataset.name,
        options={
            "dataset": dataset.name,
            "parent": parent.name,
            "dedup": rules.dedup,
            "clusters": spec.clusters,
            "model": revision,
            "revision": revision,
        },
        task_options={"dedup": True},
    )
    cached = add_jobs(session, run, CURATE, [spec])
    dataset.options = {**dataset.options, "made_by_run": run.id}
    return run.id, 1 - cached


def _has_aesthetic(session: Session, dataset: Dataset) -> bool:
    scored = (
        select(QUALITY.c.aesthetic)
        .join(Sample, Sample.id == QUALITY.c.sample_id)
        .where(Sample.dataset_id == dataset.id, QUALITY.c.aesthetic.is_not(None))
        .limit(1)
    )
    return session.execute(scored).first() is not None


def _said(rules: Rules) -> str:
    return ", ".join(f"{name} {value}" for name, value in rules.to_dict().items())
