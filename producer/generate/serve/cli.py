"""`sdq serve`: the HTTP API (api.py) on uvicorn, and its API keys."""

import click

from sdq.producer import display
from sdq.producer.cli.common import (
    ensure_schema,
    ensure_store,
    extra_needed,
    found,
    json_option,
    pass_app,
    ready_to_work,
    table,
)
from sdq.producer.generate.serve.keys import create_key, list_keys, revoke_key
from sdq.workers.app import SdqCelery


@click.group(invoke_without_command=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on.")
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="The port to listen on.",
)
@click.option(
    "--model",
    default="tiny",
    show_default=True,
    help="The model of requests that name none (as --model names one).",
)
@click.option(
    "--no-auth",
    is_flag=True,
    help="Take requests without an API key: on purpose, on a trusted network.",
)
@click.pass_context
def serve(ctx: click.Context, host: str, port: int, model: str, no_auth: bool) -> None:
    """Serve images on request over HTTP (OpenAI's images API, and jobs with their
    events), through the same queues, database and store: docs at /docs. Its requests go
    to GPU workers (`sdq worker`), so it needs a broker (SDQ_BROKER_URL), as `sdq submit`
    does; the keys can be made before."""
    if ctx.invoked_subcommand is not None:
        return
    app = ctx.find_object(SdqCelery)
    ready_to_work(app, "sdq serve (its requests go to the GPU workers)")
    ensure_schema(app)
    ensure_store(app)
    with extra_needed("sdq serve", "serve"):
        import uvicorn

        from sdq.producer.generate.serve.api import create_api
    try:
        api = create_api(app, default_model=model, auth=not no_auth)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    if no_auth:
        display.console.print("[yellow]serving without API keys (--no-auth)[/yellow]")
    uvicorn.run(api, host=host, port=port, log_level="info")


@serve.group()
def keys() -> None:
    """The API keys requests need (`Authorization: Bearer KEY`)."""


@keys.command()
@click.argument("name")
@json_option
@pass_app
def create(app: SdqCelery, name: str, as_json: bool) -> None:
    """Make a key named NAME (recorded on the runs it asks for); it is shown once."""
    ensure_schema(app, make=True)
    try:
        with app.sessions.begin() as session:
            key = create_key(session, name)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    if as_json:
        display.print_json({"name": name, "key": key})
    else:
        display.console.print(f"key {name!r} (shown once, keep it): ", end="")
        click.echo(key)


@keys.command(name="list")
@json_option
@pass_app
def list_(app: SdqCelery, as_json: bool) -> None:
    """The keys, revoked ones with when."""
    ensure_schema(app, make=True)
    with app.sessions() as session:
        rows = list_keys(session)
    if as_json:
        display.print_json(rows)
    else:
        table(["name", "created_at", "revoked_at"])(rows)


@keys.command()
@click.argument("name")
@json_option
@pass_app
def revoke(app: SdqCelery, name: str, as_json: bool) -> None:
    """Stop taking the key named NAME, at once."""
    with app.sessions.begin() as session, found():
        revoke_key(session, name)
    if as_json:
        display.print_json({"name": name, "revoked": True})
    else:
        click.echo(f"key {name!r} revoked")
