"""A train run's evaluation, made at submit (`--eval-metrics`): its held-out samples (or
its --eval-dataset's first ones) listed once in the store (each one's latent shard and row,
key, caption and image shard), and what its checkpoints are scored by."""

from collections.abc import Sequence
from dataclasses import dataclass
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
from sdq.producer.evaluate.reference import manifest_parquet, stored_manifest
from sdq.producer.evaluate.request import EvaluationRequest


class NothingHeldOut(Exception):
    pass


@dataclass(frozen=True)
class LatentSamples:
    """A dataset's latent shards as a run reads them: the rows and their manifest entries."""

    name: str
    shards: list[LatentShard]
    inputs: list[LatentInput]


def run_evaluation(
    session: Session,
    store: ObjectStore,
    run_id: int,
    request: EvaluationRequest,
    trained: LatentSamples,
    evaluated: LatentSamples | None,
    *,
    options: TrainOptions,
    base: ModelIdentity,
    resolution: int,
    report_to: tuple[str, ...],
) -> Evaluation:
    """The run's Evaluation: on its --eval-dataset's first samples, or else on the held-out
    ones of what it trains on (their manifest written to the store first)."""
    held_out, captions = None, []
    if evaluated is not None:
        rows = _rows(session, store, evaluated, _first_rows(evaluated.inputs, request.samples))
        held_out, captions = stored_manifest(store, evaluated.name, rows), rows["caption"]
    elif options.holdout:
        held_out, captions = _held_out(session, store, run_id, trained, options, request.samples)
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


def _held_out(
    session: Session,
    store: ObjectStore,
    run_id: int,
    trained: LatentSamples,
    options: TrainOptions,
    samples: int,
) -> tuple[HeldOut, list[str]]:
    """The run's first `samples` held-out samples, listed in the store, and their captions."""
    from sdq.models.train.holdout import first_held_out

    picks = first_held_out(trained.inputs, options.holdout, options.seed, samples)
    rows = _rows(session, store, trained, picks)
    if not rows["key"]:
        raise NothingHeldOut(f"--holdout {options.holdout:g} held out none of the run's "
                             f"samples: hold out a larger share")  # fmt: skip
    store.put_bytes(held_out_key(run_id), manifest_parquet(rows), content_type=PARQUET)
    held_out = HeldOut(key=held_out_key(run_id), fraction=options.holdout, seed=options.seed,
                       samples=len(rows["key"]))  # fmt: skip
    return held_out, rows["caption"]


def _first_rows(inputs: Sequence[LatentInput], samples: int) -> list[tuple[int, list[int]]]:
    """The first `samples` rows in the order of the shards, as (a shard's place, its rows)."""
    picked: list[tuple[int, list[int]]] = []
    left = samples
    for index, item in enumerate(inputs):
        if left <= 0:
            break
        picked.append((index, list(range(min(item.samples, left)))))
        left -= len(picked[-1][1])
    return picked


def _rows(
    session: Session,
    store: ObjectStore,
    samples: LatentSamples,
    picks: Sequence[tuple[int, Sequence[int]]],
) -> dict[str, list[Any]]:
    """The picked rows of each latent shard (by its place in the inputs), as manifest
    columns: their captions and keys read from their latent shards, their images' shards
    found through the image shard each latent shard was encoded from."""
    import pyarrow as pa  # here: every `sdq` command imports this module, few evaluate
    import pyarrow.parquet as pq

    rows: dict[str, list[Any]] = {name: [] for name in HELD_OUT_COLUMNS}
    for index, picked in picks:
        item = samples.inputs[index]
        table = pq.read_table(pa.BufferReader(store.get_large(item.key)),
                              columns=["key", "caption"]).take(picked)  # fmt: skip
        image_key, image_format = _image_shard(session, samples.shards[index])
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
