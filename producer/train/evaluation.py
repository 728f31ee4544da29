"""A train run's evaluation, made at submit (`--eval-metrics`): its held-out samples listed
once in the store (each one's latent shard and row, key, caption and image shard), and what
its checkpoints are scored by."""

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sdq.models.datasets import derived_from, shard_key
from sdq.models.datasets.tables import Dataset, LatentShard, Shard
from sdq.models.evaluate.specs import (
    HELD_OUT_COLUMNS,
    RENDERED,
    Evaluation,
    HeldOut,
    held_out_key,
)
from sdq.models.generate.specs import FixedRenders
from sdq.models.specs import ModelIdentity
from sdq.models.store import PARQUET, ObjectStore
from sdq.models.train.specs import LatentInput, TrainOptions
from sdq.producer.evaluate.reference import manifest_parquet
from sdq.producer.evaluate.request import EvaluationRequest


class NothingHeldOut(Exception):
    pass


def run_evaluation(
    session: Session,
    store: ObjectStore,
    run_id: int,
    request: EvaluationRequest,
    shards: list[LatentShard],
    inputs: list[LatentInput],
    *,
    options: TrainOptions,
    base: ModelIdentity,
    resolution: int,
    report_to: tuple[str, ...],
) -> Evaluation:
    """The run's Evaluation; its held-out samples' manifest written to the store first."""
    held_out, captions = None, []
    if options.holdout:
        rows = _held_out_rows(session, store, shards, inputs, options, request.samples)
        if not rows["key"]:
            raise NothingHeldOut(
                f"--holdout {options.holdout:g} held out none of the run's samples: hold out "
                f"a larger share"
            )
        store.put_bytes(held_out_key(run_id), manifest_parquet(rows), content_type=PARQUET)
        held_out = HeldOut(key=held_out_key(run_id), fraction=options.holdout,
                           seed=options.seed, samples=len(rows["key"]))  # fmt: skip
        captions = rows["caption"]
    rendering = None
    if RENDERED & set(request.metrics):
        # Without a prompt file: the held-out samples' captions, each seeded by its place.
        prompts = request.prompts or tuple((caption or "", n) for n, caption in enumerate(captions))
        rendering = FixedRenders(prompts=prompts, size=resolution, scheduler=base.scheduler,
                                 dtype=base.default_dtype,
                                 scheduler_config=base.scheduler_config)  # fmt: skip
    return Evaluation(metrics=request.metrics, every=request.every, held_out=held_out,
                      rendering=rendering, clip=request.clip, fid_weights=request.fid_weights,
                      report_to=report_to)  # fmt: skip


def _held_out_rows(
    session: Session,
    store: ObjectStore,
    shards: list[LatentShard],
    inputs: list[LatentInput],
    options: TrainOptions,
    samples: int,
) -> dict[str, list[Any]]:
    """The first `samples` held-out samples (models/train/holdout.py), as manifest columns:
    their captions and keys read from their latent shards, their images' shards found
    through the image shard each latent shard was encoded from."""
    import pyarrow as pa  # here: every `sdq` command imports this module, few evaluate
    import pyarrow.parquet as pq

    from sdq.models.train.holdout import first_held_out

    rows: dict[str, list[Any]] = {name: [] for name in HELD_OUT_COLUMNS}
    for index, picked in first_held_out(inputs, options.holdout, options.seed, samples):
        item = inputs[index]
        table = pq.read_table(pa.BufferReader(store.get_large(item.key)),
                              columns=["key", "caption"]).take(picked)  # fmt: skip
        image_key, image_format = _image_shard(session, shards[index])
        rows["latent_key"] += [item.key] * len(picked)
        rows["row"] += [int(row) for row in picked]
        rows["key"] += table["key"].to_pylist()
        rows["caption"] += table["caption"].to_pylist()
        rows["image_key"] += [image_key] * len(picked)
        rows["image_format"] += [image_format] * len(picked)
    return rows


def _image_shard(session: Session, latents: LatentShard) -> tuple[str, str]:
    """Where the images a latent shard was encoded from are, and their column: the shard
    of the dataset that downloaded them."""
    number, options, name = session.execute(
        select(Shard.number, Dataset.options, Dataset.name)
        .join(Dataset, Dataset.id == Shard.dataset_id)
        .where(Shard.id == latents.shard_id)
    ).one()
    images_of = derived_from(options) or name
    if images_of != name:
        options = session.scalar(select(Dataset.options).where(Dataset.name == images_of))
    return shard_key(images_of, number), options["format"]
