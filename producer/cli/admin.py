"""Commands that set a deployment up and watch it: the schema, the model registry, the
workers, beat, Flower, health."""

import os
import sys
import threading
from pathlib import Path

import click
from click.core import ParameterSource

from sdq.models.db import make_engine
from sdq.models.deployment import record_store, recorded_store
from sdq.models.jobs.kinds import POOL_QUEUES, Pool
from sdq.models.loras import push_lora, push_made_lora
from sdq.models.registry import ModelNotFound, made_by_a_run, push_made_model, push_model
from sdq.models.store import StoreError
from sdq.models.tables import SickWorker
from sdq.producer import display, lookups
from sdq.producer.cli.common import (
    InputError,
    extra_needed,
    json_option,
    lookup,
    model_name,
    other_store,
    pass_app,
    ready_to_submit,
    ready_to_work,
    require_broker,
)
from sdq.producer.cli.common import table as rows_table
from sdq.producer.launch import RANKED_WORKER
from sdq.workers.app import SdqCelery


@click.group()
def db() -> None:
    """The database schema, and the object store it records."""


@db.command()
@click.option("--move-store", is_flag=True,
              help="Record this SDQ_STORE_URL as the deployment's store, where another is "
              "recorded (no file is copied).")  # fmt: skip
@json_option
@pass_app
def upgrade(app: SdqCelery, move_store: bool, as_json: bool) -> None:
    """Apply every migration not applied yet, make the object store's bucket (or folder)
    if it is not there, and record it as the deployment's: what a new deployment runs
    once, and each release."""
    from sdq.migrations import upgrade as upgrade_schema

    engine = make_engine(app.settings.database_url)  # an embedded one is made here
    upgrade_schema(engine)
    database = engine.url.render_as_string()  # the password masked
    engine.dispose()
    store = app.settings.store_url
    with app.sessions() as session:
        recorded = recorded_store(session)
    if recorded not in (None, app.store.uri("")) and not move_store:
        # A shell without the deployment's SDQ_STORE_URL (or with a mistyped bucket) would
        # otherwise move every worker's outputs to its own store.
        raise click.ClickException(f"the schema is current; {other_store(recorded, app)}")
    try:
        made = app.store.ensure()
    except StoreError as error:
        raise click.ClickException(
            f"the schema is current; the store is not ready: {error}"
        ) from None
    with app.sessions.begin() as session:
        record_store(session, app.store.uri(""))
    if as_json:
        display.print_json({"database": database, "current": True, "store": store,
                            "store_created": made})  # fmt: skip
    else:
        click.echo(f"database at the newest schema: {database}")
        click.echo(f"store {'made' if made else 'ready'}: {store}")


@click.group()
def model() -> None:
    """The model registry."""


@model.command()
@click.argument("source")
@click.argument("name", callback=model_name)
@json_option
@pass_app
def push(app: SdqCelery, source: str, name: str, as_json: bool) -> None:
    """Copy SOURCE into the store, registered as NAME: a pipeline folder or a model a
    training run made (RUN@STEP, NAME@STEP, RUN@best:METRIC) for `--model NAME`, or a
    LoRA's .safetensors file for `--lora NAME`."""
    ready_to_submit(app)
    try:
        with app.sessions.begin() as session:
            pushed = _pushed(app, Path(source), name, session)
    except ModelNotFound as error:
        raise InputError(str(error)) from None
    except StoreError as error:
        raise click.ClickException(str(error)) from None
    revision, where, uploaded, made_by = pushed
    made = {"run": made_by[0], "step": made_by[1]} if made_by else {}
    if as_json:
        display.print_json({"name": name, "revision": revision, "uri": where,
                            "uploaded": uploaded, **made})  # fmt: skip
        return
    done = "pushed to" if uploaded else "already in the store at"
    taken = f" (run {made['run']}, step {made['step']})" if made else ""
    click.echo(f"{name}: revision {revision[:16]}{taken} {done} {where}")


def _pushed(
    app: SdqCelery, source: Path, name: str, session
) -> tuple[str, str, bool, tuple[int, int] | None]:
    """The revision pushed, where it is, whether it was copied now, and the run and step
    that made it (a checkpoint's model)."""
    if source.is_file():
        lora = push_lora(source, name, store=app.store, session=session)
        return lora.sha256, app.store.uri(lora.key), lora.uploaded, None
    if source.is_dir():
        pushed = push_model(source, name, store=app.store, session=session)
    elif (made := made_by_a_run(session, str(source))) is None:
        raise ModelNotFound(
            f"{source}: no such file or folder, and no training run's model "
            "(RUN@STEP, NAME@STEP or RUN@best:METRIC)"
        )
    elif made.lora_key is not None:
        lora = push_made_lora(made, name, store=app.store, session=session)
        return lora.sha256, app.store.uri(lora.key), lora.uploaded, (made.run, made.step)
    else:
        pushed = push_made_model(made, name, store=app.store, session=session)
    identity = pushed.identity
    return identity.revision, app.store.uri(pushed.prefix), pushed.uploaded, identity.made_by


@model.command(name="list")
@json_option
@pass_app
def list_models(app: SdqCelery, as_json: bool) -> None:
    """Every model identity sdq has seen or been given."""
    lookup(app, lookups.known_models, as_json=as_json,
           show=rows_table(["name", "format", "revision", "source", "created_at"]))  # fmt: skip


LOGLEVEL = click.option("--loglevel", default="info", show_default=True,
                        help="Celery's log level: debug, info, warning, error.")  # fmt: skip


@click.group()
def worker() -> None:
    """Start worker processes (plain Celery workers underneath)."""


def _gpu_queues(_ctx, _param, value: str | None) -> tuple[str, ...]:
    if value is None:
        return POOL_QUEUES[Pool.gpu]
    queues = tuple(queue.strip() for queue in value.split(",") if queue.strip())
    unknown = [queue for queue in queues if queue not in POOL_QUEUES[Pool.gpu]]
    if unknown or not queues:
        raise click.BadParameter(
            f"{value!r}: the GPU queues are {', '.join(POOL_QUEUES[Pool.gpu])}"
        )
    return queues


@worker.command()
@click.option("--gpus", help="Comma-separated GPU indices [default: every GPU nvidia-smi lists]")
@click.option(
    "--queues",
    callback=_gpu_queues,
    help=f"Comma-separated queues these GPUs serve, of {', '.join(POOL_QUEUES[Pool.gpu])}: a "
    "GPU keeps only those kinds' models. [default: all of them]",
)
@click.option(
    f"--{RANKED_WORKER}-ranks",
    "ranks",
    type=click.IntRange(min=1),
    help=f"The first N GPUs are one {RANKED_WORKER} worker, whose jobs run data-parallel on "
    f"up to N ranks (`sdq {RANKED_WORKER} --world-size`); the others serve the other queues. "
    f"Without GPUs, a {RANKED_WORKER} worker of its own whose jobs run on CPU ranks.",
)
@LOGLEVEL
@pass_app
def gpu(
    app: SdqCelery,
    gpus: str | None,
    queues: tuple[str, ...],
    ranks: int | None,
    loglevel: str,
) -> None:
    """One process per GPU for the GPU queues; one CPU process if there is no GPU."""
    from sdq.producer.launch import gpu_workers, supervise, torch_gpu_view, visible_gpus

    ready_to_work(app, "a worker")
    indices = [gpu.strip() for gpu in gpus.split(",") if gpu.strip()] if gpus else visible_gpus()
    if ranks and indices and ranks > len(indices):
        raise click.UsageError(f"--{RANKED_WORKER}-ranks {ranks}: there are {len(indices)} GPUs")
    if indices:
        # A CPU build of torch, or one for another CUDA, would have every GPU worker run on
        # the CPU, hours later noticed as slowness.
        seen, build = torch_gpu_view(indices)
        if seen < len(indices):
            listed = "--gpus names" if gpus else "nvidia-smi lists"
            raise click.UsageError(
                f"{listed} GPUs {','.join(indices)} but {build} sees {seen} of them: on a "
                "machine with these GPUs, install the torch build for its CUDA (ops/Dockerfile "
                "pins one); on one without, leave --gpus out"
            )
    commands = gpu_workers(indices, loglevel=loglevel, queues=queues, ranks=ranks or 0)
    sys.exit(supervise(commands))


@worker.command()
@click.argument("name")
@json_option
@pass_app
def clear(app: SdqCelery, name: str, as_json: bool) -> None:
    """Put worker NAME, out of rotation for a failing device (`sdq health`), back: it takes
    jobs from its queues again. Restarting it does the same."""
    require_broker(app, "clear")
    with app.sessions.begin() as session:
        sick = session.get(SickWorker, name)
        if sick is None:
            raise InputError(f"no worker {name!r} is out of rotation; `sdq health` says which are")
        session.delete(sick)
    for queue in sick.queues:
        app.control.add_consumer(queue, destination=[name])
    if as_json:
        display.print_json({"worker": name, "queues": sick.queues})
    else:
        click.echo(f"{name} takes jobs from {', '.join(sick.queues)} again")


@worker.command()
@click.option(
    "--concurrency",
    type=click.IntRange(1),
    default=os.cpu_count() or 1,
    show_default=True,
    help="Worker processes (downloads run threads in each).",
)
@LOGLEVEL
@pass_app
def cpu(app: SdqCelery, concurrency: int, loglevel: str) -> None:
    """The CPU pool: download and maintenance queues. Never loads torch."""
    from sdq.producer.launch import cpu_workers, supervise

    ready_to_work(app, "a worker")
    sys.exit(supervise(cpu_workers(concurrency, loglevel=loglevel)))


@click.command()
@LOGLEVEL
@pass_app
def beat(app: SdqCelery, loglevel: str) -> None:
    """Celery beat with sdq's schedule: every SDQ_MAINTENANCE_INTERVAL_SECONDS it has the
    CPU pool expire dead leases, send again what the broker lost and close finished runs.
    One is enough; a second does no harm."""
    require_broker(app, "beat")
    # The schedule is a few fixed intervals: nothing worth a file of its own to remember.
    app.Beat(scheduler="celery.beat:Scheduler", loglevel=loglevel.upper()).run()


def _credentials(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """USER:PASSWORD pairs, each with both parts: one without would start a Flower that
    refuses everyone."""
    for pair in (value or "").split(","):
        user, colon, password = pair.partition(":")
        if value and not (user and colon and password):
            # Named where it was given: a variable set long ago is not the option typed.
            from_env = ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT
            raise click.UsageError(
                f"{'FLOWER_BASIC_AUTH' if from_env else '--basic-auth'}: {pair!r} is not "
                "USER:PASSWORD (pairs separated by commas)",
                ctx,
            )
    return value


@click.command()
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=5555,
    show_default=True,
    help="Where Flower listens.",
)
@click.option(
    "--basic-auth",
    "credentials",
    envvar="FLOWER_BASIC_AUTH",
    callback=_credentials,
    metavar="USER:PASSWORD[,USER:PASSWORD]",
    help="Who may see it; also read from FLOWER_BASIC_AUTH.",
)
@click.option(
    "--no-auth", is_flag=True, help="Serve it open, on purpose (behind a proxy that asks)."
)
@pass_app
def flower(app: SdqCelery, port: int, credentials: str | None, no_auth: bool) -> None:
    """Flower for this deployment: workers, queues and tasks live, Prometheus metrics at
    /metrics. Every page asks for credentials. Tasks carry job ids only, never prompts or
    URLs."""
    with extra_needed("sdq flower", "monitor"):
        from sdq.producer.monitor import serve_flower

    require_broker(app, "Flower")
    if not credentials and not no_auth:
        raise click.UsageError(
            "Flower shows every worker and task and can shut workers down: give --basic-auth "
            "USER:PASSWORD (or set FLOWER_BASIC_AUTH), or --no-auth to serve it open on purpose"
        )
    serve_flower(app, port=port, credentials=None if no_auth else credentials)


@click.command()
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=9808,
    show_default=True,
    help="Where /metrics is served.",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Where to listen. Loopback unless opened (--host 0.0.0.0 for a Prometheus on "
    "another machine): the metrics name every worker and what each holds.",
)
@pass_app
def metrics(app: SdqCelery, port: int, host: str) -> None:
    """Serve Prometheus metrics Flower does not have at http://HOST:PORT/metrics: queue
    depths, jobs by kind and status, outputs per second, jobs each worker holds, lease
    expiries, retries and dead jobs; read from the broker and the database at each scrape."""
    with extra_needed("sdq metrics", "monitor"):
        from prometheus_client import REGISTRY, start_http_server

        from sdq.producer.metrics import SdqCollector

    require_broker(app, "sdq metrics")
    REGISTRY.register(SdqCollector(app))
    start_http_server(port, addr=host)
    click.echo(f"sdq metrics at http://{host}:{port}/metrics")
    threading.Event().wait()  # serves on its own thread until the process is stopped


@click.command()
@json_option
@pass_app
def health(app: SdqCelery, as_json: bool) -> None:
    """Check the database and its schema, the broker, the object store, the workers behind
    each queue and beat's last tick; exits 1 when any is down."""
    from sdq.producer import health as checks

    found = checks.health(app)
    if as_json:
        display.print_json(checks.as_json(found))
    else:
        display.stdout.print(display.health_table(found))
    if not all(check.ok for check in found):
        sys.exit(1)


COMMANDS = (db, model, worker, beat, flower, metrics, health)
