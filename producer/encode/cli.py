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
    TooSmall,
    Way,
    record_encode,
)
from sdq.workers.app import SdqCelery

DEFAULT_RESOLUTION = 256


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
    type=click.IntRange(min=VAE_SCALE),
    help="Images are center-cropped to this square; a multiple of 8 (smaller images are "
    "upscaled).  [default: 256]",
)
@click.option(
    "--resolutions",
    metavar="R[,R...]",
    help="Several squares from one pass, e.g. 256,512: each image decoded once for all; an "
    "image smaller than one is left out of it ('too small for 512'), never upscaled.",
)
@click.option(
    "--buckets",
    metavar="AREA[,AREA...]",
    help="Aspect-ratio buckets instead of squares, e.g. 256,512 (areas 256² and 512²): each "
    "image in the bucket of the nearest shape (SDXL's list, sides multiples of 64), resized "
    "to cover it and cropped least, never upscaled. Needs a dataset downloaded with "
    "--resize-mode keep_ratio or keep_ratio_largest (or no).",
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
    resolution: int | None,
    resolutions: str | None,
    buckets: str | None,
    batch_size: int,
    wait: bool,
    as_json: bool,
) -> None:
    """Encode dataset NAME's image shards with a model's VAE and text encoder, one job per
    shard and resolution on the GPU workers: latents and caption embeddings for training.

    Without a broker (SDQ_BROKER_URL unset) the work runs here, in this process."""
    targets = _targets(resolution, resolutions, buckets)
    ready_to_submit(app)
    way = Way(leave_out_smaller=resolutions is not None, buckets=buckets is not None)
    submission = _submit(app, name, model, targets, batch_size, way)
    if submission.images_at is not None:
        display.console.print(
            f"[yellow]dataset {name!r} holds {submission.images_at} px images: encoding them at "
            f"{targets[0]} px upscales them, with no more detail than they have. A dataset "
            f"downloaded with --resolution {targets[0]} has it (or --resolutions leaves "
            f"out what is too small).[/yellow]"
        )
    carry_out_dataset_run(
        app,
        submission,
        wait=wait,
        as_json=as_json,
        report_sent=lambda tasks: _report_submission(submission, tasks, as_json),
    )


def _targets(resolution: int | None, resolutions: str | None, buckets: str | None) -> list[int]:
    """The resolutions (or bucket areas' sides) asked for, each a multiple of 8, smallest
    first."""
    given = {"--resolution": resolution, "--resolutions": resolutions, "--buckets": buckets}
    named = [option for option, value in given.items() if value is not None]
    if len(named) > 1:
        raise click.UsageError(f"give one of {', '.join(given)}, not {' and '.join(named)}")
    if not named or named == ["--resolution"]:
        return _multiples_of_8([resolution or DEFAULT_RESOLUTION], "--resolution")
    [option] = named
    try:
        chosen = sorted({int(part) for part in given[option].split(",")})
    except ValueError:
        raise click.UsageError(f"{option} {given[option]}: not a list such as 256,512") from None
    return _multiples_of_8(chosen, option)


def _multiples_of_8(targets: list[int], option: str) -> list[int]:
    for target in targets:
        if target < VAE_SCALE or target % VAE_SCALE:
            raise click.UsageError(f"{option} {target}: not a positive multiple of {VAE_SCALE}")
    return targets


def _submit(
    app: SdqCelery,
    name: str,
    model: str,
    targets: list[int],
    batch_size: int,
    way: Way,
) -> EncodeSubmission:
    with found():
        try:
            with app.sessions() as session:
                identity = resolve_model(model, store=app.store, session=session)
            return record_encode(
                app.sessions, name, identity, resolutions=targets, way=way, batch_size=batch_size
            )
        except (ModelNotFound, NothingToEncode, TooSmall) as error:
            raise click.UsageError(str(error)) from None


def _report_submission(submission: EncodeSubmission, tasks: int, as_json: bool) -> None:
    waiting = f"; {submission.waiting} not downloaded yet" if submission.waiting else ""
    report_submission(
        {
            "run_id": submission.run_id,
            "dataset": submission.dataset,
            "model": submission.model,
            "revision": submission.revision,
            "resolution": submission.resolutions[0] if len(submission.resolutions) == 1 else None,
            "resolutions": submission.resolutions,
            "buckets": submission.buckets,
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
