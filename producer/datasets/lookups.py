"""Questions about datasets, answered from the database: what each holds (its samples, and
the latents encoded from them), what failed and why, where its shards are."""

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sdq.models.datasets import BLOCKED_ADDRESS, SampleStatus, latent_prefix
from sdq.models.datasets.buckets import Bucket
from sdq.models.datasets.tables import Dataset, LatentShard, Sample, Shard
from sdq.models.jobs.kinds import KINDS
from sdq.models.tables import Run
from sdq.producer.errors import NotFound


def dataset_named(session: Session, name: str) -> Dataset:
    dataset = session.scalars(select(Dataset).where(Dataset.name == name)).one_or_none()
    if dataset is None:
        raise NotFound(f"no dataset named {name!r}; `sdq dataset list` shows them")
    return dataset


def _blocked_by(session: Session, dataset_id: int) -> list[str]:
    """The networks opened (SDQ_DOWNLOAD_ALLOW_NETWORKS) on the workers that refused the
    dataset's blocked hosts: the setting that refused them, as those workers had it."""
    refused_in = select(Sample.shard_id).where(
        Sample.dataset_id == dataset_id, Sample.reason == BLOCKED_ADDRESS
    )
    opened = session.scalars(select(Shard.allowed_networks).where(Shard.id.in_(refused_in)))
    return sorted({network for networks in opened for network in networks or ()})


class NotReadable(Exception):
    """A dataset with nothing to read yet: nothing downloaded or kept, or still being made."""


def downloaded_shards(session: Session, name: str) -> tuple[Dataset, list[Shard], int]:
    """The dataset's downloaded shards, and how many are planned but not downloaded yet;
    refused when there is nothing to read (what encode and curate start from)."""
    dataset = dataset_named(session, name)
    if (making := still_making(session, dataset)) is not None:
        raise NotReadable(f"dataset {name!r} is still being made by run {making}: "
                          f"`sdq dataset show {name}` follows it")  # fmt: skip
    shards = session.scalars(
        select(Shard).where(Shard.dataset_id == dataset.id).order_by(Shard.number)
    ).all()
    downloaded = [shard for shard in shards if shard.sha256 is not None]
    if not downloaded:
        raise NotReadable(f"dataset {name!r} has no downloaded shard yet: "
                          f"`sdq dataset show {name}` follows the download")  # fmt: skip
    if unusable := no_usable_samples(session, dataset):
        raise NotReadable(unusable)
    return dataset, downloaded, len(shards) - len(downloaded)


def still_making(session: Session, dataset: Dataset) -> int | None:
    """The run that makes a dataset of another's samples, while it has not finished."""
    run_id = dataset.options.get("made_by_run")
    if run_id is None or session.get_one(Run, run_id).finished_at is not None:
        return None
    return run_id


def members_by_shard(session: Session, dataset: Dataset) -> dict[int, list[str]]:
    """A dataset made of another's samples: the keys it keeps, by its shard rows' ids."""
    members: dict[int, list[str]] = {}
    for shard_id, key in session.execute(
        select(Sample.shard_id, Sample.key)
        .where(Sample.dataset_id == dataset.id, Sample.status == SampleStatus.success)
        .order_by(Sample.shard_id, Sample.key)
    ):
        members.setdefault(shard_id, []).append(key)
    return members


def kept_keys(session: Session, name: str, shard_number: int) -> set[str]:
    """The keys of one shard's kept samples (for a dataset made of another's samples: its
    members among the file's)."""
    return set(
        session.scalars(
            select(Sample.key)
            .join(Shard, Shard.id == Sample.shard_id)
            .join(Dataset, Dataset.id == Sample.dataset_id)
            .where(
                Dataset.name == name,
                Shard.number == shard_number,
                Sample.status == SampleStatus.success,
            )
        )
    )


def no_usable_samples(session: Session, dataset: Dataset) -> str | None:
    """Why the dataset cannot be encoded or trained on, when none of its downloaded
    samples was kept (every one failed or was a duplicate); None when some were."""
    by_status = dict(
        session.execute(
            select(Sample.status, func.count()).where(Sample.dataset_id == dataset.id)
            .group_by(Sample.status)
        ).all()
    )  # fmt: skip
    if by_status.get(SampleStatus.success):
        return None
    samples = sum(by_status.values())
    return (
        f"dataset {dataset.name!r} has no usable samples: all {samples} downloaded so far "
        f"failed or were duplicates. `sdq dataset show {dataset.name}` says why; a list of "
        "reachable images makes a dataset to train on"
    )


def list_datasets(session: Session) -> list[dict[str, Any]]:
    samples = (
        select(
            Sample.dataset_id,
            func.count().label("samples"),
            func.count().filter(Sample.status == SampleStatus.success).label("ok"),
        )
        .group_by(Sample.dataset_id)
        .subquery()
    )
    shards = (
        select(Shard.dataset_id, func.count().label("shards")).group_by(Shard.dataset_id).subquery()
    )
    rows = session.execute(
        select(
            Dataset.name,
            Dataset.created_at,
            func.coalesce(shards.c.shards, 0),
            func.coalesce(samples.c.samples, 0),
            func.coalesce(samples.c.ok, 0),
        )
        .outerjoin(shards, shards.c.dataset_id == Dataset.id)
        .outerjoin(samples, samples.c.dataset_id == Dataset.id)
        .order_by(Dataset.id)
    )
    return [
        {"name": name, "created_at": created.isoformat(), "shards": n, "samples": s, "ok": ok}
        for name, created, n, s, ok in rows
    ]


def dataset_summary(session: Session, name: str) -> dict[str, Any]:
    """What a dataset holds (`sdq dataset show`): its samples by status, the reasons the
    failed ones failed, its shards and bytes, its latents, and what each kind adds (the
    download's speed, curate's scores: ProducerHooks.dataset_summary)."""
    dataset = dataset_named(session, name)
    by_status, reasons = _fates(session, dataset.id)
    shards = session.scalars(
        select(Shard).where(Shard.dataset_id == dataset.id).order_by(Shard.number)
    ).all()
    summary = {
        "name": dataset.name,
        "options": dataset.options,
        "samples": sum(by_status.values()),
        "by_status": by_status,
        "reasons": reasons,
        "bytes": sum(shard.bytes or 0 for shard in shards),
        "latents": latent_summary(session, dataset.id, dataset.name),
        # A dataset made of another's samples: of which, by what rules, and what each left out.
        "made_of": dataset.options.get("parent"),
        "filter": dataset.options.get("filter"),
        "removed": removed_by_rule(session, dataset.id) if "parent" in dataset.options else None,
        "blocked_by": _blocked_by(session, dataset.id) if BLOCKED_ADDRESS in reasons else None,
        "shards": [
            {
                "number": shard.number,
                "uri": shard.uri,
                "rows": shard.row_count,
                "ok": (shard.counts or {}).get(SampleStatus.success, 0),
                "done": shard.finished_at is not None,
            }
            for shard in shards
        ],
    }
    for kind in KINDS.values():
        if (adds := kind.producer_hooks().dataset_summary) is not None:
            summary |= adds(session, summary)
    return summary


def _fates(session: Session, dataset_id: int) -> tuple[dict[str, int], dict[str, int]]:
    """A dataset's samples by status, and its failed samples by reason, most common first."""
    of_dataset = Sample.dataset_id == dataset_id
    by_status = dict(
        session.execute(
            select(Sample.status, func.count()).where(of_dataset).group_by(Sample.status)
        ).all()
    )
    reasons = dict(
        session.execute(
            select(Sample.reason, func.count())
            .where(of_dataset, Sample.status == SampleStatus.failed)
            .group_by(Sample.reason)
            .order_by(func.count().desc(), Sample.reason)
        ).all()
    )
    return by_status, reasons


def removed_by_rule(session: Session, dataset_id: int) -> dict[str, int]:
    """The samples a filter left out, by the rule that did (a reason's first word)."""
    reason = Sample.reason
    if session.get_bind().dialect.name == "postgresql":
        rule = func.split_part(reason, " ", 1)
    else:
        rule = func.substr(reason, 1, func.instr(reason + " ", " ") - 1)
    return dict(
        session.execute(
            select(rule, func.count())
            .where(Sample.dataset_id == dataset_id, Sample.status == SampleStatus.filtered)
            .group_by(rule)
            .order_by(func.count().desc())
        ).all()
    )


def latent_summary(session: Session, dataset_id: int, name: str) -> list[dict[str, Any]]:
    """The dataset's latent shards, one entry per model revision and resolution (squares,
    or the buckets of an area), with the images each left out and why; bucketed, the
    samples in each bucket."""
    target = (LatentShard.model_name, LatentShard.model_revision, LatentShard.resolution)
    listed = (LatentShard.model_name, LatentShard.resolution, LatentShard.model_revision)
    shape = (LatentShard.bucketed, LatentShard.width, LatentShard.height)
    rows = session.execute(
        select(
            *target,
            *shape,
            func.count(),
            func.sum(LatentShard.samples),
            func.sum(LatentShard.too_small),
            func.sum(LatentShard.seconds),
        )
        .where(LatentShard.dataset_id == dataset_id)
        .group_by(*target, *shape)
        .order_by(*listed, *shape)
    )
    entries: dict[tuple, dict[str, Any]] = {}
    for model, revision, resolution, bucketed, width, height, *counted in rows:
        entry = entries.setdefault(
            (model, revision, resolution, bucketed),
            _latent_entry(name, model, revision, resolution, bucketed),
        )
        _count_latents(entry, Bucket(width, height).name, *counted)
    return [_rated(entry) for entry in entries.values()]


def _latent_entry(
    name: str, model: str, revision: str, resolution: int, bucketed: bool
) -> dict[str, Any]:
    return {
        "model": model,
        "revision": revision,
        "resolution": resolution,
        **({"buckets": {}} if bucketed else {}),
        "shards": 0,
        "samples": 0,
        # Images left out of this resolution, smaller than it (`--resolutions`, `--buckets`).
        "left_out": {},
        "seconds": 0.0,
        "samples_per_second": None,
        "prefix": latent_prefix(name, revision, resolution, bucketed=bucketed),
    }


def _count_latents(
    entry: dict[str, Any], shape: str, shards: int, samples: int, too_small: int, seconds: float
) -> None:
    if "buckets" in entry:
        entry["buckets"][shape] = samples
    entry["shards"] += shards
    entry["samples"] += samples
    entry["seconds"] += seconds or 0
    if too_small:
        reason = f"too small for {entry['resolution']}"
        entry["left_out"][reason] = entry["left_out"].get(reason, 0) + too_small


def _rated(entry: dict[str, Any]) -> dict[str, Any]:
    seconds = entry.pop("seconds")
    if seconds:
        entry["samples_per_second"] = round(entry["samples"] / seconds, 2)
    return entry
