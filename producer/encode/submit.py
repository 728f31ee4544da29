"""Writing an encode run: one job per downloaded image shard of the dataset, for one
model at one resolution. A shard already encoded so (the same file, the same model
revision) is served from the store, as images are."""

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from sdq.models.datasets import derived_from
from sdq.models.datasets.tables import Dataset, Shard
from sdq.models.encode.specs import EncodeSpec
from sdq.models.jobs.kinds import ENCODE
from sdq.models.jobs.outbox import add_jobs, open_run
from sdq.models.registry import record_model
from sdq.models.specs import ModelIdentity
from sdq.producer.datasets.lookups import NotReadable, downloaded_shards, members_by_shard

# The VAE halves the image three times: sides must divide by 8.
VAE_SCALE = 8


class NothingToEncode(Exception):
    pass


@dataclass(frozen=True)
class EncodeSubmission:
    run_id: int
    dataset: str
    model: str
    revision: str
    resolution: int
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
    resolution: int,
    batch_size: int,
) -> EncodeSubmission:
    """The encode run of the dataset's downloaded shards, one job each, in one transaction
    (nothing is written when the dataset has nothing to encode)."""
    with sessions.begin() as session:
        # 1. The dataset's downloaded shards, or why there is nothing to encode.
        dataset, downloaded, waiting = _readable(session, name)
        kept = _kept(session, dataset)
        # 2. The run and its jobs; a shard encoded already by this model is done as written.
        record_model(session, model)
        run = open_run(
            session,
            ENCODE,
            source=name,
            options={**_described(name, model), "resolution": resolution},
            jobs_per_message=1,  # a shard is a minute of GPU work: one per message
            task_options={"batch_size": batch_size},
        )
        specs = [_spec(dataset, shard, model, resolution, kept(shard.id)) for shard in downloaded]
        cached = add_jobs(session, run, ENCODE, specs)
    # 3. What was submitted, and whether the images are smaller than the resolution.
    return EncodeSubmission(
        run_id=run.id,
        dataset=name,
        model=model.name,
        revision=model.revision,
        resolution=resolution,
        jobs=len(specs),
        cached=cached,
        waiting=waiting,
        images_at=images_at if (images_at := dataset.options["resolution"]) < resolution else None,
    )


def _readable(session: Session, name: str) -> tuple[Dataset, list[Shard], int]:
    """The dataset's downloaded shards and how many wait, or why there is nothing to encode."""
    try:
        return downloaded_shards(session, name)
    except NotReadable as error:
        raise NothingToEncode(str(error)) from None


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
    dataset: Dataset, shard: Shard, model: ModelIdentity, resolution: int, keys: list[str] | None
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
    )
