"""Help that stands on its own: every command and option says what it does, the prompt file's
columns and the settings are in the help, and every command that reports has --json."""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sdq.producer.cli.main import main
from sdq.producer.prompts import COLUMNS
from tests.conftest import ROOT

# Commands that start a long-running service report nothing to parse.
SERVICES = {"sdq worker gpu", "sdq worker cpu", "sdq beat", "sdq flower", "sdq metrics"}


def commands(
    command: click.Command = main, path: str = "sdq"
) -> Iterator[tuple[str, click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from commands(sub, f"{path} {name}")


def test_every_command_and_option_has_help() -> None:
    missing = [
        f"{path} {' '.join(param.opts) if isinstance(param, click.Option) else ''}".strip()
        for path, command in commands()
        for param in [None, *command.params]
        if (param is None and not command.help)
        or (isinstance(param, click.Option) and not param.help)
    ]
    assert missing == []


def test_every_command_that_reports_speaks_json() -> None:
    leaves = {path: command for path, command in commands() if not isinstance(command, click.Group)}
    without = [
        path
        for path, command in leaves.items()
        if not any("--json" in getattr(param, "opts", ()) for param in command.params)
    ]
    assert sorted(without) == sorted(SERVICES)


@pytest.mark.parametrize("command", ["run", "submit"])
def test_the_prompt_file_columns_are_in_the_help(command: str) -> None:
    shown = CliRunner().invoke(main, [command, "--help"])
    assert shown.exit_code == 0
    for column in COLUMNS:
        assert column in shown.output


def test_the_top_level_help_names_the_settings_and_the_embedded_default() -> None:
    shown = CliRunner().invoke(main, ["--help"])
    assert shown.exit_code == 0
    for name in ("SDQ_DATABASE_URL", "SDQ_BROKER_URL", "SDQ_STORE_URL", "SDQ_HOME"):
        assert name in shown.output
    assert "./sdq-data" in shown.output and "no broker or worker" in shown.output


def test_the_download_help_says_which_addresses_are_refused_and_how_to_open_them() -> None:
    shown = CliRunner().invoke(main, ["download", "--help"])
    text = " ".join(shown.output.split())
    assert "SDQ_DOWNLOAD_ALLOW_NETWORKS" in text
    assert '--retry-failed NAME --reason "blocked address"' in text


def test_typos_are_named_not_taken_for_something_else(tmp_path, monkeypatch) -> None:
    """A command's name typed wrong is not a dataset, and a credential without its colon
    is not a Flower that refuses everyone."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    typo = runner.invoke(main, ["train", "statuss", "5"], env={"SDQ_HOME": str(tmp_path)})
    assert typo.exit_code == 2
    assert "no command 'statuss': did you mean `sdq train status`?" in typo.output
    flower = runner.invoke(
        main, ["flower", "--basic-auth", "nocolon"], env={"SDQ_BROKER_URL": "redis://x:1/0"}
    )
    assert flower.exit_code == 2
    assert "--basic-auth: 'nocolon' is not USER:PASSWORD" in flower.output
    from_env = runner.invoke(main, ["flower"], env={"SDQ_BROKER_URL": "redis://x:1/0",
                                                    "FLOWER_BASIC_AUTH": "nocolon"})  # fmt: skip
    assert from_env.exit_code == 2
    assert "FLOWER_BASIC_AUTH: 'nocolon' is not USER:PASSWORD" in from_env.output


def test_a_required_option_left_out_is_named_before_anything_runs(tmp_path, monkeypatch) -> None:
    """`--steps` is declared without a default: leaving it out is a usage error (it was a
    traceback from deep in the submit), whichever way the command is named."""
    monkeypatch.chdir(tmp_path)
    for words in (["train"], ["train", "start"]):
        left_out = CliRunner().invoke(main, [*words, "pets", "--base", "tiny", "--resolution",
                                             "64"], env={"SDQ_HOME": str(tmp_path)})  # fmt: skip
        assert left_out.exit_code == 2, left_out.output
        assert "Missing option '--steps'" in left_out.output


def test_a_model_name_that_would_read_as_another_is_refused(tmp_path, monkeypatch) -> None:
    """`--into tiny` would register a model that `--model tiny` never reaches (the built-in
    one), and a name with '@' or '/' reads as a checkpoint or a path: refused as typed."""
    monkeypatch.chdir(tmp_path)
    train = ["train", "pets", "--base", "tiny", "--resolution", "64", "--steps", "2", "--into"]
    for words, message in [
        ([*train, "tiny"], "'tiny' is sdq's built-in model: name yours otherwise"),
        ([*train, "pets@2"], "'pets@2': a model name has no '@' or '/'"),
        ([*train, "7"], "'7' would read as run 7 in 7@STEP"),
        (["model", "push", str(tmp_path), "tiny"], "'tiny' is sdq's built-in model"),
    ]:
        refused = CliRunner().invoke(main, words, env={"SDQ_HOME": str(tmp_path)})
        assert refused.exit_code == 2 and message in refused.output, refused.output
    assert list(tmp_path.iterdir()) == []  # no database made, nothing written


def test_a_folder_without_an_embedded_home_says_so_and_makes_none(tmp_path, monkeypatch) -> None:
    """`sdq runs` (or any look) run from another folder than the runs': the home it looked
    in, and no fresh empty database made there; in a home without the run asked for, the
    file it looked in."""
    monkeypatch.chdir(tmp_path)
    for command in (["runs"], ["sql", "SELECT count(*) FROM runs"], ["dataset", "list"]):
        looked = CliRunner().invoke(main, command, env={"SDQ_HOME": None})
        said = " ".join(looked.output.split())
        assert looked.exit_code == 1, command
        assert f"no sdq database at {tmp_path / 'sdq-data' / 'sdq.db'}" in said, command
        assert "run it from the folder of your runs, or set SDQ_HOME" in said
    assert not (tmp_path / "sdq-data").exists()
    # A home there, without the run asked for: which file was looked in.
    home = tmp_path / "elsewhere"
    assert CliRunner().invoke(main, ["db", "upgrade"], env={"SDQ_HOME": str(home)}).exit_code == 0
    missing = CliRunner().invoke(main, ["status", "1"], env={"SDQ_HOME": str(home)})
    said = " ".join(missing.output.split())
    assert missing.exit_code == 2 and f"no run 1 (in {home / 'sdq.db'})" in said, said
    # sdq health names the database as it is set, not as its read-only engine opens it.
    checked = CliRunner().invoke(main, ["health", "--json"], env={"SDQ_HOME": str(home)})
    database = json.loads(checked.stdout)["checks"][0]
    assert database["detail"] == f"sqlite:///{home / 'sdq.db'} (schema current)", database


# What the extras bring (gpu, monitor, trackers): none is imported as the command line
# starts, so the README's first block (the gpu extra alone) and a producer-only install
# (none) work; each is imported by the command or the worker that uses it.
EXTRA_MODULES = ["torch", "diffusers", "transformers", "safetensors", "accelerate", "peft",
                 "faiss", "prometheus_client", "flower", "tensorboard", "wandb",
                 "torchmetrics"]  # fmt: skip
WITHOUT_EXTRAS = """
import sys
for name in {modules!r}:
    sys.modules[name] = None  # an import of it fails, as where it is not installed
from sdq.producer.cli.start import main
sys.argv = ["sdq", *sys.argv[1:]]
main()
"""


def test_the_command_line_starts_without_any_extra() -> None:
    script = WITHOUT_EXTRAS.format(modules=EXTRA_MODULES)
    for group in [
        "",
        *(name for name, cmd in main.commands.items() if isinstance(cmd, click.Group)),
    ]:
        done = subprocess.run([sys.executable, "-c", script, *filter(None, [group]), "--help"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, (group, done.stderr[-2000:])
        assert "Usage: sdq" in done.stdout


def test_a_command_missing_its_extra_says_which_to_install(tmp_path: Path) -> None:
    """Each was a traceback: the monitor extra's commands, and an embedded train run that
    would send its figures to a tracker this process cannot load (it failed each job's
    report, and the run went on without them)."""
    script = WITHOUT_EXTRAS.format(modules=EXTRA_MODULES)
    env = {**os.environ, "SDQ_HOME": str(tmp_path / "sdq-data")}
    env.pop("SDQ_BROKER_URL", None)
    asked = {
        ("metrics",): "sdq metrics needs the monitor extra (prometheus_client is missing): "
        "pip install 'sdq[monitor]'",
        ("flower", "--no-auth"): "sdq flower needs the monitor extra (flower is missing)",
        ("train", "pets", "--base", "tiny", "--resolution", "64", "--steps", "2",
         "--report-to", "tensorboard"): "--report-to tensorboard: tensorboard is not installed "
        "here, where the run trains: pip install 'sdq[trackers]'",
    }  # fmt: skip
    for command, said in asked.items():
        done = subprocess.run([sys.executable, "-c", script, *command], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr
        assert said in " ".join(done.stderr.split()), done.stderr
    assert not (tmp_path / "sdq-data").exists() or not list((tmp_path / "sdq-data").glob("*.db"))
