"""Writing an encode run: one job per downloaded image shard of the dataset and target
resolution, for one model; a shard's targets go in one message, whose worker decodes each
image once for all of them. A shard already encoded so (the same file, the same model
revision) is served from the store, as images are."""

from collections.abc import Callable
from dataclasses import asdict, dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.datasets import derived_from, squared_by
from sdq.models.datasets.buckets import buckets_for
from sdq.models.datasets.tables import Dataset, Shard
from sdq.models.encode.specs import EncodeSpec
from sdq.models.jobs.kinds import ENCODE
from sdq.models.jobs.outbox import add_jobs, open_run
from sdq.models.registry import record_model
from sdq.models.specs import ModelIdentity
from sdq.models.tables import Run
from sdq.producer.datasets.lookups import NotReadable, downloaded_shards, members_by_shard

# The VAE halves the image three times: sides must divide by 8.
VAE_SCALE = 8


class NothingToEncode(Exception):
    pass


class TooSmall(Exception):
    """A target resolution above what every image of the dataset was stored at."""


@dataclass(frozen=True)
class Way:
    """How images meet their targets: squares that upscale smaller images
    (`--resolution`), squares that leave them out (`--resolutions`), or aspect-ratio
    buckets that leave them out (`--buckets`)."""

    leave_out_smaller: bool = False
    buckets: bool = False


@dataclass(frozen=True)
class EncodeSubmission:
    run_id: int
    dataset: str
    model: str
    revision: str
    resolutions: list[int]
    buckets: bool
    jobs: int
    cached: int
    # Shards planned but not downloaded yet: a later `sdq encode` picks them up.
    waiting: int
    # The dataset's images' size, when it is under the resolution: they are upscaled.
    images_at: int | None = None


def record_encode(
    sessions: sessionmaker[Session],
    name: str,
    model: ModelIdentity,
    *,
    resolutions: list[int],
    way: Way,
    batch_size: int,
) -> EncodeSubmission:
    """The encode run of the dataset's downloaded shards, a job per shard and resolution
    (or bucket area), in one transaction (nothing is written when the dataset has nothing
    to encode). Unless `way` upscales, an image smaller than a target is left out of it."""
    with sessions.begin() as session:
        # 1. The dataset's downloaded shards, or why there is nothing to encode.
        dataset, downloaded, waiting = _readable(session, name)
        _check_way(session, dataset, model, resolutions, way)
        kept = _kept(session, dataset)
        # 2. The run and its jobs; a shard encoded already by this model is done as written.
        record_model(session, model)
        run = _encode_run(session, name, model, resolutions, way, batch_size=batch_size)
        specs = [
            _spec(dataset, shard, model, resolution, kept(shard.id), way)
            for shard in downloaded
            for resolution in resolutions
        ]
        cached = add_jobs(session, run, ENCODE, specs)
    # 3. What was submitted, and whether the images are smaller than the resolution.
    return EncodeSubmission(
        run_id=run.id,
        dataset=name,
        model=model.name,
        revision=model.revision,
        resolutions=resolutions,
        buckets=way.buckets,
        jobs=len(specs),
        cached=cached,
        waiting=waiting,
        images_at=_upscaled_from(dataset, resolutions, way),
    )


def _upscaled_from(dataset: Dataset, resolutions: list[int], way: Way) -> int | None:
    """The side the dataset's images were stored at, where a square target above it
    upscales them (`--resolution`: the others leave smaller images out)."""
    stored_at = _stored_at(dataset)
    upscaled = stored_at is not None and stored_at < max(resolutions) and way == Way()
    return stored_at if upscaled else None


def _check_way(
    session: Session, dataset: Dataset, model: ModelIdentity, resolutions: list[int], way: Way
) -> None:
    """The targets refused where no image could meet them, or where the dataset's latents
    at one were made the other way."""
    if way.buckets:
        _check_buckets(dataset.name, dataset, resolutions)
    elif way.leave_out_smaller:
        _check_targets(dataset.name, _stored_at(dataset), resolutions)
    _check_same_way(session, dataset.name, model, resolutions, way)


def _encode_run(
    session: Session,
    name: str,
    model: ModelIdentity,
    resolutions: list[int],
    way: Way,
    *,
    batch_size: int,
) -> Run:
    return open_run(
        session,
        ENCODE,
        source=name,
        options={**_described(name, model), "resolutions": resolutions, **asdict(way)},
        # A shard is a minute of GPU work: one per message, with all its targets.
        jobs_per_message=len(resolutions),
        task_options={"batch_size": batch_size},
    )


def _stored_at(dataset: Dataset) -> int | None:
    """The side every image of the dataset was stored at, the shorter (keep_ratio_largest:
    the longer, and the shorter at most it; None: as it came)."""
    if dataset.options.get("resize_mode", "center_crop") == "no":
        return None
    return dataset.options["resolution"]


def _check_targets(name: str, stored_at: int | None, resolutions: list[int]) -> None:
    """Leaving out images smaller than a target leaves every one out of a target above
    the resolution the dataset was downloaded at: refused, with what to do."""
    above = [resolution for resolution in resolutions if stored_at and resolution > stored_at]
    if above:
        raise TooSmall(
            f"dataset {name!r} holds {stored_at} px images (downloaded with --resolution "
            f"{stored_at}): every one is too small for {above[0]}; download it again with "
            f"--resolution {max(resolutions)}, or leave {', '.join(map(str, above))} out"
        )


def _check_buckets(name: str, dataset: Dataset, areas: list[int]) -> None:
    """Buckets need each image's own shape, which a square download cut away, and images
    large enough for some bucket of each area: refused otherwise, with what to do."""
    if mode := squared_by(dataset.options):
        raise NothingToEncode(
            f"dataset {name!r} was downloaded with --resize-mode {mode}: its images are "
            f"squares, and buckets need each image's own shape; download it again with "
            f"--resize-mode keep_ratio or keep_ratio_largest (or encode squares with "
            f"--resolution)"
        )
    stored_at = _stored_at(dataset)
    # keep_ratio stored every image's shorter side at the resolution, keep_ratio_largest
    # its longer one: an image fits no bucket whose same side is longer.
    side, which = (min, "shorter") if mode == "keep_ratio" else (max, "longer")
    for area in areas:
        needed = min(side(bucket.width, bucket.height) for bucket in buckets_for(area))
        if stored_at is not None and stored_at < needed:
            raise TooSmall(
                f"dataset {name!r} holds images {stored_at} px on their {which} side "
                f"(downloaded with --resolution {stored_at}): every one is too small for the "
                f"buckets of {area}x{area} px, whose {which} side is {needed} at least; "
                f"download it again with --resolution {area}, or leave {area} out"
            )


def _readable(session: Session, name: str) -> tuple[Dataset, list[Shard], int]:
    """The dataset's downloaded shards and how many wait, or why there is nothing to encode."""
    try:
        return downloaded_shards(session, name)
    except NotReadable as error:
        raise NothingToEncode(str(error)) from None


def _check_same_way(
    session: Session,
    name: str,
    model: ModelIdentity,
    resolutions: list[int],
    way: Way,
) -> None:
    """A dataset's square latents at a resolution are one set (one file a shard, the one
    training reads): encoding them the other way (`--resolution` upscales smaller images,
    `--resolutions` leaves them out) would replace them under a run reading them. Refused,
    saying how the latents there were made. Buckets are a set of their own."""
    if way.buckets:
        return
    encoded = session.scalars(
        select(Run.options).where(Run.kind == ENCODE.name, Run.source == name)
    ).all()
    for options in encoded:
        if options.get("buckets"):
            continue
        targets = set(options.get("resolutions") or [options["resolution"]])
        same_model = options["revision"] == model.revision
        leave_out_smaller = way.leave_out_smaller
        other_way = bool(options.get("leave_out_smaller")) != leave_out_smaller
        if same_model and other_way and (overlap := sorted(targets & set(resolutions))):
            made = WAYS[not leave_out_smaller]
            raise NothingToEncode(
                f"dataset {name!r} has latents at {overlap[0]} px by {model.name} made with "
                f"{made}; {WAYS[leave_out_smaller]} would replace them: encode with {made} "
                f"again, or into a copy of the dataset (`sdq dataset filter`)"
            )


# How a dataset's latents treat images smaller than their resolution, by leave_out_smaller.
WAYS = {
    False: "--resolution (smaller images upscaled)",
    True: "--resolutions (smaller images left out)",
}


def _kept(session: Session, dataset: Dataset) -> Callable[[int], list[str] | None]:
    """A shard's samples the dataset keeps, by shard id: None, all of them, unless it is
    made of another's samples."""
    if not derived_from(dataset.options):
        return lambda shard: None
    members = members_by_shard(session, dataset)
    return lambda shard: members.get(shard, [])


def _described(name: str, model: ModelIdentity) -> dict[str, str]:
    """The run's dataset and the model that encodes it."""
    return {"dataset": name, "model": model.name, "revision": model.revision}


def _spec(
    dataset: Dataset,
    shard: Shard,
    model: ModelIdentity,
    resolution: int,
    keys: list[str] | None,
    way: Way,
) -> EncodeSpec:
    return EncodeSpec(
        dataset=dataset.name,
        shard=shard.number,
        shard_sha256=shard.sha256,
        image_format=dataset.options["format"],
        model_name=model.name,
        model_source=model.source,
        model_revision=model.revision,
        resolution=resolution,
        dtype=model.default_dtype,
        images_of=derived_from(dataset.options),
        keys=keys,
        leave_out_smaller=way.leave_out_smaller or None,
        buckets=way.buckets or None,
        padded=dataset.options.get("resize_mode") == "border" or None,
    )
