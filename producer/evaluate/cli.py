"""`sdq evaluate`: any model scored, any time, on the same spec as a train run's
checkpoints (its held-out samples, prompts and CLIP model), so that a fine-tune and its
base, or two runs, are compared on the same draws."""

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from sqlalchemy import select
from sqlalchemy.orm import Session

from sdq.models.evaluate.runs import ScoredModel, open_evaluation
from sdq.models.evaluate.scores import score_text
from sdq.models.evaluate.specs import (
    AGAINST_REAL,
    RENDERED,
    EvaluateSpec,
    Evaluation,
    FidWeights,
    HeldOut,
)
from sdq.models.evaluate.tables import CheckpointScore
from sdq.models.generate.specs import FixedRenders
from sdq.models.registry import ModelNotFound, resolve_model
from sdq.models.specs import ModelIdentity
from sdq.models.tables import Job, Run
from sdq.producer.cli.common import (
    exit_if_dead,
    found,
    json_option,
    pass_app,
    ready_to_submit,
    send_run,
    watch_run,
)
from sdq.producer.cli.here import work_here
from sdq.producer.display import rows_table, stdout
from sdq.producer.evaluate.reference import reference_samples
from sdq.producer.evaluate.request import DEFAULT_SAMPLES, EvaluationRequest, evaluation_request
from sdq.workers.app import SdqCelery


@click.command()
@click.argument("model")
@click.option(
    "--metrics", required=True, metavar="METRIC[,METRIC...]",
    help="What to score: heldout_loss, clip_score, fd_clip, kid, fid (held-out samples come "
    "from --like's run).",
)  # fmt: skip
@click.option(
    "--like", metavar="RUN", type=int,
    help="Score on train run RUN's evaluation spec: its held-out samples, prompts, render "
    "settings and CLIP model. [default: MODEL's own run when it is a checkpoint]",
)  # fmt: skip
@click.option(
    "--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="One prompt a line (or a prompt file with a header, as sdq run reads it), rendered "
    "at fixed seeds for clip_score. [default: --like's]",
)  # fmt: skip
@click.option("--clip", metavar="MODEL", help="The CLIP model renders are scored by.")
@click.option(
    "--fid-weights", metavar="FILE|s3://",
    help="Inception-v3's weights for fid, as torchmetrics and torch-fidelity load them. "
    "[default: --like's]",
)  # fmt: skip
@click.option(
    "--reference", metavar="DATASET",
    help="Compare the renders (fd_clip, kid) with this dataset's images, its first --samples "
    "kept ones, instead of --like's held-out samples; without --prompts, their captions are "
    "what is rendered.",
)  # fmt: skip
@click.option(
    "--samples", type=click.IntRange(min=2), default=DEFAULT_SAMPLES, show_default=True,
    help="With --reference: how many of its images.",
)  # fmt: skip
@click.option("--wait", is_flag=True, help="Wait for the scores and show them.")
@json_option
@pass_app
def evaluate(
    app: SdqCelery,
    model: str,
    metrics: str,
    like: int | None,
    prompts: Path | None,
    clip: str | None,
    fid_weights: str | None,
    reference: str | None,
    samples: int,
    wait: bool,
    as_json: bool,
) -> None:
    """Score MODEL (any --model source, a checkpoint RUN@STEP or RUN@best:METRIC) on the
    evaluate queue. Without a broker the work runs here, in this process."""
    ready_to_submit(app)
    with found(), app.sessions.begin() as session:
        identity, scored, like = _scored(app, session, model, like)
        base = _run_evaluation(session, like) if like is not None else None
        request = evaluation_request(
            metrics, prompts=prompts, clip=clip or _clip_ref(base), holdout=None,
            fid_weights=fid_weights or _fid_weights_ref(base, metrics),
        )  # fmt: skip
        real = reference_samples(session, app.store, reference, samples) if reference else None
        evaluation = _evaluation(request, base, identity, real)
        runs = open_evaluation(session, scored, evaluation)
        # Each run's jobs, for its bar: the renders' run has one a render.
        jobs = {run_id: session.get_one(Run, run_id).job_count for run_id in runs}
    for run_id in runs:
        if app.settings.embedded:
            work_here(app, run_id, jobs=jobs[run_id])
        else:
            send_run(app, run_id)
    if app.settings.embedded or wait:
        if not app.settings.embedded:
            watch_run(app, runs[-1], jobs=1, show=not as_json)
        _report_scores(app, runs[-1], as_json)
        exit_if_dead(app, runs[-1])
    else:
        _report_sent(runs[-1], scored, as_json)


def _scored(
    app: SdqCelery, session: Session, model: str, like: int | None
) -> tuple[ModelIdentity, ScoredModel, int | None]:
    """The model, and where its scores belong: a checkpoint's run and step (its run is
    the default --like)."""
    try:
        identity: ModelIdentity = resolve_model(model, store=app.store, session=session)
    except ModelNotFound as error:
        raise click.UsageError(str(error)) from None
    run, step = identity.made_by or (None, None)
    scored = ScoredModel(identity.name, identity.source, identity.revision,
                         identity.scheduler_config, run=run, step=step)  # fmt: skip
    return identity, scored, like if like is not None else run


def _run_evaluation(session: Session, run_id: int) -> Evaluation:
    """What a run's checkpoints are scored by, as its submit recorded it."""
    run = session.get(Run, run_id)
    if run is None or "evaluation" not in run.options:
        raise click.UsageError(
            f"--like {run_id}: run {run_id} is not a train run whose checkpoints are "
            f"evaluated (trained with --eval-metrics)"
        )
    return Evaluation.from_dict(run.options["evaluation"])


def _clip_ref(base: Evaluation | None) -> str | None:
    return base.clip.source if base is not None and base.clip is not None else None


def _fid_weights_ref(base: Evaluation | None, metrics: str) -> FidWeights | None:
    """The run's Inception weights (the very file it was scored with), where fid is asked."""
    asked = {metric.strip() for metric in metrics.split(",")}
    return base.fid_weights if base is not None and "fid" in asked else None


def _evaluation(
    request: EvaluationRequest,
    base: Evaluation | None,
    model: ModelIdentity,
    reference: tuple[HeldOut, list[str]] | None,
) -> Evaluation:
    """The request on the run's spec: its held-out samples and its renders' settings (or
    the model's own, with no run to be like); a `reference` dataset's images and captions
    in place of the held-out samples."""
    held_out, captions = base.held_out if base else None, []
    if reference is not None:
        if "heldout_loss" in request.metrics:
            raise click.UsageError("heldout_loss is measured on a train run's held-out latents "
                                   "(--like RUN), not on --reference's images")  # fmt: skip
        held_out, captions = reference
    if held_out is None and ({"heldout_loss"} | AGAINST_REAL) & set(request.metrics):
        raise click.UsageError(
            "heldout_loss, fd_clip, kid and fid need held-out samples: name a train run "
            "trained with --holdout (--like RUN), or a dataset for fd_clip, kid and fid "
            "(--reference NAME)"
        )
    rendering = base.rendering if base is not None else None
    if RENDERED & set(request.metrics):
        rendering = _renders(request, model, rendering, captions)
    evaluation = Evaluation(metrics=request.metrics, held_out=held_out, rendering=rendering,
                            clip=request.clip, fid_weights=request.fid_weights)  # fmt: skip
    if too_few := evaluation.too_few_to_compare(
        more_renders="give more prompts (--prompts)",
        more_real="compare with more real images (--reference DATASET --samples N)",
    ):
        raise click.UsageError(too_few)
    return evaluation


def _renders(
    request: EvaluationRequest,
    model: ModelIdentity,
    like: FixedRenders | None,
    captions: list[str],
) -> FixedRenders:
    """The renders to score: the request's prompts, or else the reference's own captions
    (each seeded by its place, as a run's held-out ones), with the run's render settings
    or else the model's own."""
    prompts = request.prompts or tuple((caption, n) for n, caption in enumerate(captions))
    if not prompts:
        if like is None:
            raise click.UsageError("renders need prompts: give --prompts FILE")
        return like
    like = like or FixedRenders(
        prompts=(), size=model.default_size, scheduler=model.scheduler,
        dtype=model.default_dtype, scheduler_config=model.scheduler_config,
    )  # fmt: skip
    return replace(like, prompts=prompts)


def _report_sent(run_id: int, scored: ScoredModel, as_json: bool) -> None:
    fields = {"run_id": run_id, "model": scored.name, "model_revision": scored.revision}
    if as_json:
        click.echo(json.dumps(fields))
    else:
        stdout.print(f"evaluation of {scored.name} queued as run {run_id}: `sdq evaluate "
                     f"{scored.name} ... --wait` or `sdq status {run_id}` follows it")  # fmt: skip


def _report_scores(app: SdqCelery, run_id: int, as_json: bool) -> None:
    with app.sessions() as session:
        job = session.scalars(select(Job).where(Job.run_id == run_id)).one()
        error, status = job.error, job.status
        spec = EvaluateSpec.from_dict(job.spec)
        rows = session.execute(
            select(CheckpointScore.metric, CheckpointScore.value, CheckpointScore.samples)
            .where(CheckpointScore.spec_hash == spec.hash())
            .order_by(CheckpointScore.id)
        ).all()
    scores = {metric: {"value": value, "samples": samples} for metric, value, samples in rows}
    result: dict[str, Any] = {
        "run_id": run_id,
        "status": status,
        "model": spec.model_name,
        "spec_hash": spec.hash(),
        "scores": scores,
        "error": error,
    }
    if as_json:
        click.echo(json.dumps(result))
        return
    table = [
        {"metric": m, "value": score_text(s["value"]), "over": s["samples"]}
        for m, s in scores.items()
    ]
    stdout.print(
        rows_table(table, ["metric", "value", "over"], title=f"{spec.model_name} ({status})")
    )
    if error:
        stdout.print(f"[red]{error}[/red]")


COMMANDS = (evaluate,)
