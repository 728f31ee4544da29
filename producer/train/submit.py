"""Writing a train run: its inputs (the dataset's latent shards made with the base model
at the resolution) and its first train-shard job. Each job writes the next one with its
checkpoint; the run's job count says how many there will be."""

from dataclasses import asdict, dataclass, replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.datasets import (
    POOLED_EMBEDDINGS,
    bucket_latent_key,
    empty_prompt_key,
    latent_key,
    squared_by,
)
from sdq.models.datasets.buckets import Bucket
from sdq.models.datasets.tables import Dataset, LatentShard, Shard
from sdq.models.db import copy_rows
from sdq.models.evaluate.scores import NoScores, best_step
from sdq.models.generate.specs import FixedRenders
from sdq.models.jobs.kinds import TRAIN
from sdq.models.jobs.outbox import add_jobs, open_run
from sdq.models.registry import resolve_model, same_encoders
from sdq.models.specs import ModelIdentity
from sdq.models.store import PARQUET, ObjectStore
from sdq.models.tables import Run
from sdq.models.train.architectures import check_fits
from sdq.models.train.inputs import inputs_key, inputs_manifest
from sdq.models.train.models import encoders_lineage
from sdq.models.train.specs import LatentInput, TrainOptions, TrainShardSpec, checkpoint_prefix
from sdq.models.train.tables import Checkpoint, HeldOutRow, TrainInput
from sdq.producer.datasets.lookups import dataset_named, no_usable_samples
from sdq.producer.errors import NotFound
from sdq.producer.evaluate.request import EvaluationRequest
from sdq.producer.train.evaluation import LatentSamples, NothingHeldOut, run_evaluation
from sdq.producer.train.lookups import run_base


class CannotTrain(Exception):
    pass


@dataclass(frozen=True)
class StartFrom:
    """The checkpoint whose weights a run goes on from (`--resume-from RUN[@STEP]`)."""

    run: int
    step: int

    @property
    def prefix(self) -> str:
        return checkpoint_prefix(self.run, self.step)


@dataclass(frozen=True)
class TrainSubmission:
    run_id: int
    dataset: str
    model: str  # what its checkpoints are registered as
    jobs: int
    samples: int  # trained on
    held_out: int


def record_train(
    sessions: sessionmaker[Session],
    name: str,
    base: ModelIdentity,
    *,
    resolution: int,
    options: TrainOptions,
    into: str | None,
    store: ObjectStore,
    validation: FixedRenders | None = None,
    start_from: StartFrom | None = None,
    evaluation: EvaluationRequest | None = None,
    report_to: tuple[str, ...] = (),
) -> TrainSubmission:
    """The train run, its inputs and its first job, in one transaction: the database drives
    the chain from there (each job's checkpoint writes the next job)."""
    with sessions.begin() as session:
        # 1. The latent shards it trains on; an architecture from scratch must take them.
        shards, empty_prompt = _usable_shards(session, store, name, base, resolution, options)
        # 2. The run, with everything that decides its weights.
        recorded = _recorded(name, base, resolution, into, start_from, options)
        run = open_run(session, TRAIN, source=name, options=recorded)
        # 3. Its inputs, once: rows for SQL's lineage, a manifest in the store for the ranks
        #    (before the run is committed: a run never names a manifest that is not there).
        session.add_all(TrainInput(run_id=run.id, latent_shard_id=shard.id) for shard, _ in shards)
        inputs = [_input(name, shard, number) for shard, number in shards]
        held_out = _hold_out(session, run.id, name, [shard for shard, _ in shards], inputs,
                             options)  # fmt: skip
        store.put_bytes(inputs_key(run.id), inputs_manifest(inputs), content_type=PARQUET)
        # 4. Its first job, with what its checkpoints are scored by; the others follow.
        first = _first_job(run.id, base, options, into, validation, empty_prompt, start_from)
        first = replace(first, report_to=report_to)
        if evaluation is not None:
            first = _scored_by(session, store, run, first, evaluation, shards, inputs,
                               resolution=resolution, base=base)  # fmt: skip
        add_jobs(session, run, TRAIN, [first])
        run.job_count = -(-options.steps // options.checkpoint_every)
    samples = sum(shard.samples for shard, _ in shards) - held_out
    return TrainSubmission(run.id, name, first.model_name, run.job_count, samples, held_out)


def _hold_out(
    session: Session,
    run_id: int,
    name: str,
    shards: list[LatentShard],
    inputs: list[LatentInput],
    options: TrainOptions,
) -> int:
    """The rows the run holds out, drawn as its ranks draw them, recorded for its lineage to
    leave out; how many. A fraction that leaves no sample to train on is refused: the data
    lanes would wait for ever on shards with no row to read."""
    if not options.holdout:
        return 0
    from sdq.models.train.holdout import held_out  # numpy: not at every command's start

    rows = [
        {"run_id": run_id, "latent_shard_id": shard.id, "latent_row": int(row)}
        for shard, item in zip(shards, inputs, strict=True)
        for row in held_out(item.key, item.samples, options.holdout, options.seed).nonzero()[0]
    ]
    samples = sum(item.samples for item in inputs)
    if len(rows) == samples:
        raise CannotTrain(f"--holdout {options.holdout} holds out all {samples} samples of "
                          f"{name}: none is left to train on; give a smaller fraction")  # fmt: skip
    copy_rows(session, HeldOutRow.__table__, rows)
    return len(rows)


def _scored_by(
    session: Session,
    store: ObjectStore,
    run: Run,
    first: TrainShardSpec,
    request: EvaluationRequest,
    shards: list[tuple[LatentShard, int]],
    inputs: list[LatentInput],
    **made: Any,
) -> TrainShardSpec:
    """The first job with what the run's checkpoints are scored by (their held-out samples
    listed in the store), recorded with the run too: `sdq evaluate --like RUN` scores other
    models by it."""
    trained = LatentSamples(run.options["dataset"], [shard for shard, _ in shards], inputs)
    evaluated = _evaluated(session, request, trained.name, made["base"], made["resolution"])
    try:
        evaluation = run_evaluation(session, store, run.id, request, trained, evaluated,
                                    options=first.options, report_to=first.report_to,
                                    **made)  # fmt: skip
    except NothingHeldOut as error:
        raise CannotTrain(str(error)) from None
    if too_few := evaluation.too_few_to_compare(
        more_renders="give more prompts (--eval-prompts)",
        more_real="score on more samples (--holdout, --eval-samples, --eval-dataset)",
    ):
        raise CannotTrain(too_few)
    run.options = {**run.options, "evaluation": asdict(evaluation)}
    return replace(first, evaluation=evaluation)


def _evaluated(
    session: Session,
    request: EvaluationRequest,
    trained: str,
    base: ModelIdentity,
    resolution: int,
) -> LatentSamples | None:
    """The --eval-dataset's latents, made with the run's encoders at its resolution."""
    name = request.dataset
    if name is None:
        return None
    if name == trained:
        raise CannotTrain(f"--eval-dataset {name} is the dataset the run trains on, none of it "
                          f"held out: give another, or --holdout FRACTION")  # fmt: skip
    try:
        shards = _latent_shards(session, name, base, resolution)
    except (CannotTrain, NotFound) as error:
        raise CannotTrain(f"--eval-dataset: {error}") from None
    inputs = [_input(name, shard, number) for shard, number in shards]
    return LatentSamples(name, [shard for shard, _ in shards], inputs)


def _usable_shards(
    session: Session,
    store: ObjectStore,
    name: str,
    base: ModelIdentity,
    resolution: int,
    options: TrainOptions,
) -> tuple[list[tuple[LatentShard, int]], str | None]:
    """The latent shards a run trains on, checked against its architecture, and the key of
    the empty prompt's embedding where caption dropout needs it."""
    shards = _latent_shards(session, name, base, resolution, options.buckets)
    if options.unet_config is not None:
        _check_architecture(options.unet_config, shards[0][0])
    encoded_with = shards[0][0].model_revision
    empty_prompt = _empty_prompt(store, name, encoded_with) if options.caption_dropout else None
    return shards, empty_prompt


def _recorded(
    name: str,
    base: ModelIdentity,
    resolution: int,
    into: str | None,
    start_from: StartFrom | None,
    options: TrainOptions,
) -> dict[str, Any]:
    """What the run's row records of it: its inputs, its model's name and its options."""
    return {
        "dataset": name,
        "base": base.name,
        "base_revision": base.revision,
        "resolution": resolution,
        "into": into,
        # The run it goes on from: the lineage view follows this back.
        "start_run": start_from.run if start_from else None,
        "start_step": start_from.step if start_from else None,
        **asdict(options),
    }


def _check_architecture(unet_config: dict, shard: LatentShard) -> None:
    """A U-Net from scratch takes the dataset's latents and text embeddings as they are."""
    tensors = shard.tensors
    check_fits(
        unet_config,
        latent_channels=tensors["latents"]["shape"][0],
        text_width=tensors["text_embeddings"]["shape"][-1],
        pooled=tensors[POOLED_EMBEDDINGS]["shape"][-1] if POOLED_EMBEDDINGS in tensors else None,
    )


def _first_job(
    run_id: int,
    base: ModelIdentity,
    options: TrainOptions,
    into: str | None,
    validation: FixedRenders | None,
    empty_prompt: str | None,
    start_from: StartFrom | None,
) -> TrainShardSpec:
    return TrainShardSpec(
        run=run_id,
        first_step=0,
        last_step=min(options.checkpoint_every, options.steps),
        model_name=into or str(run_id),
        base_name=base.name,
        base_source=base.source,
        base_revision=base.revision,
        prediction_type=base.scheduler_config.get("prediction_type", "epsilon"),
        scheduler_config=base.scheduler_config,
        options=options,
        inputs_key=inputs_key(run_id),
        validation=validation,
        empty_prompt_key=empty_prompt,
        start_from=start_from.prefix if start_from else None,
    )


def _empty_prompt(store: ObjectStore, name: str, encoded_with: str) -> str:
    key = empty_prompt_key(name, encoded_with)
    if not store.exists(key):
        raise CannotTrain(
            f"--caption-dropout trains on the empty prompt's embedding, which the encode run "
            f"of {name!r} (model revision {encoded_with[:12]}) did not store (it was encoded "
            f"by an older sdq): encode it again into a new dataset name"
        )
    return key


def base_and_start(
    session: Session,
    store: ObjectStore,
    base: str | None,
    resume_from: tuple[int, int | str | None] | None,
) -> tuple[ModelIdentity, StartFrom | None]:
    """The base model, and the checkpoint the run starts from (--resume-from: on its run's
    base)."""
    start_from = start_checkpoint(session, *resume_from) if resume_from else None
    if start_from is not None:
        return run_base(session, start_from.run, store=store), start_from
    return resolve_model(base, store=store, session=session), None


def start_checkpoint(session: Session, run_id: int, step: int | str | None) -> StartFrom:
    """The checkpoint `--resume-from RUN[@STEP|@best:METRIC]` names: the step's, the
    run's newest, or the one with the best score, still in the store."""
    query = select(Checkpoint.step).where(
        Checkpoint.run_id == run_id, Checkpoint.deleted_at.is_(None)
    )
    steps = session.scalars(query.order_by(Checkpoint.step)).all()
    run = session.get(Run, run_id)
    if run is None or run.kind != TRAIN.name:
        what = f"there is no run {run_id}" if run is None else f"run {run_id} is not a train run"
        raise CannotTrain(f"--resume-from {run_id}: {what} (`sdq runs` lists them)")
    if run.options.get("lora_rank") is not None:
        raise CannotTrain(f"--resume-from {run_id}: train run {run_id} trained a LoRA; its "
                          f"checkpoints hold adapters, not a U-Net to go on from")  # fmt: skip
    if isinstance(step, str):
        try:
            step = best_step(session, run_id, step.removeprefix("best:"), steps)
        except NoScores as error:
            raise CannotTrain(f"--resume-from {run_id}@{step}: {error}") from None
    if not steps or (step is not None and step not in steps):
        wanted = f"{run_id}@{step}" if step is not None else str(run_id)
        raise CannotTrain(
            f"--resume-from {wanted}: no such checkpoint in the store; train run {run_id} has "
            f"{'checkpoints at steps ' + ', '.join(map(str, steps)) if steps else 'none'}"
        )
    return StartFrom(run_id, steps[-1] if step is None else step)


def _latent_shards(
    session: Session, name: str, base: ModelIdentity, resolution: int, buckets: bool = False
) -> list[tuple[LatentShard, int]]:
    """The latent shards to train on, each with its image shard's number: squares at the
    resolution or the buckets of its area, made with the base, or else with a model whose
    VAE, text encoder and tokenizer are the base's byte for byte (so their latents are the
    same): the one it was trained from, and so on back, or any registered model whose
    encoders' files hash alike."""
    dataset = dataset_named(session, name)
    lineage = encoders_lineage(session, base.revision)
    twins = [revision for revision in same_encoders(session, base) if revision not in lineage]
    for revision in lineage + twins:
        shards = session.execute(
            select(LatentShard, Shard.number)
            .join(Shard, Shard.id == LatentShard.shard_id)
            .where(
                LatentShard.dataset_id == dataset.id,
                LatentShard.model_revision == revision,
                LatentShard.resolution == resolution,
                LatentShard.bucketed.is_(buckets),
                LatentShard.samples > 0,
            )
            .order_by(Shard.number, LatentShard.width, LatentShard.height)
        ).all()
        if shards:
            return [(shard, number) for shard, number in shards]
    raise CannotTrain(_why_no_latents(session, dataset, base, resolution, buckets))


def _why_no_latents(
    session: Session, dataset: Dataset, base: ModelIdentity, resolution: int, buckets: bool
) -> str:
    """Why a dataset has nothing to train on as asked, and what makes it."""
    name = dataset.name
    if unusable := no_usable_samples(session, dataset):
        return unusable
    if buckets and (mode := squared_by(dataset.options)):
        return (f"dataset {name!r} was downloaded with --resize-mode {mode}: its images are "
                f"squares, and buckets need each image's own shape; train on squares (leave "
                f"out --buckets), or download it again with --resize-mode keep_ratio and "
                f"encode that with --buckets")  # fmt: skip
    shapes, option = ("the buckets of ", "--buckets") if buckets else ("", "--resolution")
    return (f"dataset {name!r} has no latents made with {base.name} (revision "
            f"{base.revision[:12]}) at {shapes}{resolution} px: `sdq encode {name} --model "
            f"{base.name} {option} {resolution}` makes them")  # fmt: skip


def _input(name: str, shard: LatentShard, number: int) -> LatentInput:
    where = (name, shard.model_revision, shard.resolution, number)
    if not shard.bucketed:
        return LatentInput(uri=shard.uri, key=latent_key(*where), samples=shard.samples)
    bucket = Bucket(shard.width, shard.height).name
    key = bucket_latent_key(*where, bucket)
    return LatentInput(uri=shard.uri, key=key, samples=shard.samples, bucket=bucket)
