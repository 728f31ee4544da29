"""Writing a train run: its inputs (the dataset's latent shards made with the base model
at the resolution) and its first train-shard job. Each job writes the next one with its
checkpoint; the run's job count says how many there will be."""

from dataclasses import asdict, dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.datasets import latent_key
from sdq.models.jobs.kinds import TRAIN
from sdq.models.jobs.outbox import add_jobs
from sdq.models.specs import ModelIdentity
from sdq.models.tables import Run
from sdq.models.tables.download import Shard
from sdq.models.tables.encode import LatentShard
from sdq.models.tables.train import TrainInput
from sdq.models.training import LatentInput, TrainOptions, TrainShardSpec, Validation
from sdq.producer.download.lookups import dataset_named


class MissingLatents(Exception):
    pass


@dataclass(frozen=True)
class TrainSubmission:
    run_id: int
    dataset: str
    model: str  # what its checkpoints are registered as
    jobs: int
    samples: int


def record_train(
    sessions: sessionmaker[Session],
    name: str,
    base: ModelIdentity,
    *,
    resolution: int,
    options: TrainOptions,
    into: str | None,
    validation: Validation | None = None,
) -> TrainSubmission:
    with sessions.begin() as session:
        shards = _latent_shards(session, name, base, resolution)
        run = Run(
            kind=TRAIN.name,
            source=name,
            options={
                "dataset": name,
                "base": base.name,
                "base_revision": base.revision,
                "resolution": resolution,
                "into": into,
                **asdict(options),
            },
            job_count=0,
            jobs_per_message=1,
            task_options={},
        )
        session.add(run)
        session.flush()
        session.add_all(TrainInput(run_id=run.id, latent_shard_id=shard.id) for shard, _ in shards)
        first = TrainShardSpec(
            run=run.id,
            first_step=0,
            last_step=min(options.checkpoint_every, options.steps),
            model_name=into or str(run.id),
            base_name=base.name,
            base_source=base.source,
            base_revision=base.revision,
            prediction_type=base.scheduler_config.get("prediction_type", "epsilon"),
            scheduler_config=base.scheduler_config,
            options=options,
            inputs=tuple(_input(name, shard, number) for shard, number in shards),
            validation=validation,
        )
        add_jobs(session, run, TRAIN, [first])
        run.job_count = -(-options.steps // options.checkpoint_every)
    return TrainSubmission(
        run_id=run.id,
        dataset=name,
        model=first.model_name,
        jobs=run.job_count,
        samples=sum(shard.samples for shard, _ in shards),
    )


def _latent_shards(
    session: Session, name: str, base: ModelIdentity, resolution: int
) -> list[tuple[LatentShard, int]]:
    """The latent shards to train on, each with its image shard's number."""
    dataset = dataset_named(session, name)
    shards = session.execute(
        select(LatentShard, Shard.number)
        .join(Shard, Shard.id == LatentShard.shard_id)
        .where(
            LatentShard.dataset_id == dataset.id,
            LatentShard.model_revision == base.revision,
            LatentShard.resolution == resolution,
            LatentShard.samples > 0,
        )
        .order_by(Shard.number)
    ).all()
    if not shards:
        raise MissingLatents(
            f"dataset {name!r} has no latents made with {base.name} (revision "
            f"{base.revision[:12]}) at {resolution} px: `sdq encode {name} --model "
            f"{base.name} --resolution {resolution}` makes them"
        )
    return [(shard, number) for shard, number in shards]


def _input(name: str, shard: LatentShard, number: int) -> LatentInput:
    key = latent_key(name, shard.model_revision, shard.resolution, number)
    return LatentInput(uri=shard.uri, key=key, samples=shard.samples)
