"""The encode command: a dataset's image shards to VAE latents and text embeddings."""

import click

from sdq.models.registry import ModelNotFound, resolve_model
from sdq.producer import display
from sdq.producer.cli.common import (
    found,
    json_option,
    pass_app,
    ready_to_submit,
    report_submission,
)
from sdq.producer.datasets.cli import carry_out_dataset_run
from sdq.producer.encode.submit import (
    VAE_SCALE,
    EncodeSubmission,
    NothingToEncode,
    record_encode,
)
from sdq.workers.app import SdqCelery


@click.command()
@click.argument("name")
@click.option(
    "--model",
    required=True,
    help="Whose VAE and text encoder: 'tiny', a diffusers folder, s3://..., a pushed name "
    "or a hub id.",
)
@click.option(
    "--resolution",
    default=256,
    show_default=True,
    type=click.IntRange(min=VAE_SCALE),
    help="Images are center-cropped to this square; a multiple of 8.",
)
@click.option(
    "--batch-size",
    default=32,
    show_default=True,
    type=click.IntRange(min=1),
    help="Images per VAE call.",
)
@click.option("--wait", is_flag=True, help="Show progress until every shard is encoded.")
@json_option
@pass_app
def encode(
    app: SdqCelery,
    name: str,
    model: str,
    resolution: int,
    batch_size: int,
    wait: bool,
    as_json: bool,
) -> None:
    """Encode dataset NAME's image shards with a model's VAE and text encoder, one job per
    shard on the GPU workers: latents and caption embeddings for training.

    Without a broker (SDQ_BROKER_URL unset) the work runs here, in this process."""
    if resolution % VAE_SCALE:
        raise click.UsageError(f"--resolution {resolution} is not a multiple of {VAE_SCALE}")
    ready_to_submit(app)
    submission = _submit(app, name, model, resolution, batch_size)
    if submission.images_at is not None:
        display.console.print(
            f"[yellow]dataset {name!r} holds {submission.images_at} px images: encoding them at "
            f"{resolution} px upscales them, with no more detail than they have. A dataset "
            f"downloaded with --resolution {resolution} has it.[/yellow]"
        )
    carry_out_dataset_run(
        app,
        submission,
        wait=wait,
        as_json=as_json,
        report_sent=lambda tasks: _report_submission(submission, tasks, as_json),
    )


def _submit(
    app: SdqCelery, name: str, model: str, resolution: int, batch_size: int
) -> EncodeSubmission:
    with found():
        try:
            with app.sessions() as session:
                identity = resolve_model(model, store=app.store, session=session)
            return record_encode(
                app.sessions, name, identity, resolution=resolution, batch_size=batch_size
            )
        except (ModelNotFound, NothingToEncode) as error:
            raise click.UsageError(str(error)) from None


def _report_submission(submission: EncodeSubmission, tasks: int, as_json: bool) -> None:
    waiting = f"; {submission.waiting} not downloaded yet" if submission.waiting else ""
    report_submission(
        {
            "run_id": submission.run_id,
            "dataset": submission.dataset,
            "model": submission.model,
            "revision": submission.revision,
            "resolution": submission.resolution,
            "jobs": submission.jobs,
            "cached": submission.cached,
            "waiting": submission.waiting,
            "tasks": tasks,
        },
        f"{submission.jobs} shards to encode, {submission.cached} done before{waiting}; "
        f"`sdq dataset show {submission.dataset}` follows it",
        as_json=as_json,
    )


COMMANDS = (encode,)
