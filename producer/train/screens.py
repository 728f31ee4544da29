"""What `sdq train` shows: a run's progress, speed, time shares, loss curve and checkpoints
(in the terminal, or as JSON, with its page written anew), and a configuration's memory
plan."""

import functools
from typing import Any

from sqlalchemy.orm import Session

from sdq.models.evaluate.scores import score_text
from sdq.models.evaluate.specs import best_of
from sdq.models.store import LINK_SECONDS
from sdq.models.train.page import (
    buckets_text,
    checkpoint_holds,
    draw_page,
    page_key,
    speed_text,
)
from sdq.producer.cli.common import lookup
from sdq.producer.display import rows_table, stdout
from sdq.producer.train.lookups import dead_asked_for, train_run
from sdq.workers.app import SdqCelery


def show_training(status: dict[str, Any], *, render_command: str = "sdq submit") -> None:
    """The run's progress and checkpoints; `render_command` is how this deployment renders
    (`sdq run` with no broker)."""
    stdout.print(
        f"[bold]train run {status['run_id']}[/bold] ({status['status']}): step "
        f"{status['step']} of {status['steps']}{_goes_on_from(status)}, {status['dataset']} "
        f"on {status['base']}"
    )
    if status["samples_per_second"]:
        stdout.print(speed_text(status))
    if status["buckets"]:
        stdout.print(buckets_text(status))
    if status["time_shares"]:
        shares = status["time_shares"]
        stdout.print(
            f"over its wall time: {status['wall_samples_per_second']:.1f} samples/s; "
            f"starting {shares['start']:.0%}, training {shares['training']:.0%}, "
            f"data waits {shares['data_wait']:.0%}, "
            f"checkpoints {shares['checkpoint']:.0%}, between jobs {shares['job_gap']:.0%}, "
            f"final checkpoint {shares['final_checkpoint']:.0%}"
        )
    if status["losses"]:
        stdout.print(f"loss {loss_curve([loss for _, loss in status['losses']])}")
    checkpoints = status["checkpoints"]
    if checkpoints:
        rows = [{**c, "holds": checkpoint_holds(c)} for c in checkpoints]
        stdout.print(rows_table(rows, ["step", "holds", "uri"], title="checkpoints"))
        models = [str(row["step"]) for row in rows if row["holds"] == "model"]
        if models:
            stdout.print(f"render with: {render_command} PROMPTS {_rendered_by(status)} "
                         f"(STEP: {', '.join(models)})")  # fmt: skip
    if status["scores"]:
        stdout.print(rows_table(_score_rows(status["scores"]), ["metric", "latest", "best"],
                                title="checkpoint scores"))  # fmt: skip
    for dead in status.get("dead_asked_for", ()):
        stdout.print(f"[red]dead[/red]: run {dead['run_id']} ({dead['of']}): {dead['error']} "
                     f"(`sdq show {dead['job_id']}`)", soft_wrap=True)  # fmt: skip
    stdout.print(f"page: {status['page']}", soft_wrap=True)


def _rendered_by(status: dict[str, Any]) -> str:
    """The options that render a checkpoint's model: it, or the base with its LoRA."""
    if status["lora_rank"] is None:
        return f"--model {status['model']}@STEP"
    return f"--model {status['base']} --lora {status['model']}@STEP"


def _goes_on_from(status: dict[str, Any]) -> str:
    """Where a run no job trains now goes on from, when steps were taken past its last
    checkpoint (Ctrl-C, a lost worker): those are taken again."""
    last = status["checkpoint_step"]
    if status["status"] == "running" or status["step"] <= last:
        return ""
    return f" (goes on from {f'its checkpoint at step {last}' if last else 'the start'})"


def _score_rows(scores: dict[str, list[list[float | None]]]) -> list[dict[str, str]]:
    """Each metric's latest value and its best, with their steps."""
    rows = []
    for metric, curve in scores.items():
        values = {step: value for step, value in curve}
        best, latest = best_of(metric, values), curve[-1][0]
        at = {step: f"{score_text(values[step])} at step {step}"
              for step in (best, latest) if step is not None}  # fmt: skip
        rows.append({"metric": metric, "latest": at[latest], "best": at.get(best, "none")})
    return rows


def show_plan(plan: dict[str, Any], refusal: str | None) -> None:
    """A training configuration's memory per GPU by part, and whether it fits."""
    gib = 2**30
    rows = [{"part": name, "GiB": f"{size / gib:.2f}"} for name, size in plan["parts"].items()]
    rows.append({"part": "per GPU", "GiB": f"{plan['per_gpu_bytes'] / gib:.2f}"})
    stdout.print(rows_table(rows, ["part", "GiB"], title=f"micro-batch {plan['micro_batch']}"))
    stdout.print(f"{plan['flops_per_sample'] / 1e9:,.0f} GFLOPs per sample (training)")
    if refusal is None:
        usable, whole = plan["usable_bytes"] / gib, plan["gpu_memory"] / gib
        stdout.print(f"[green]fits[/green] within {usable:.1f} GiB usable of each GPU's "
                     f"{whole:.1f} GiB (--gpu-memory)")  # fmt: skip
    else:
        stdout.print(f"[red]does not fit[/red]: {refusal}")


def loss_curve(losses: list[float | None], width: int = 60) -> str:
    """The loss as a line of block characters, averaged into `width` buckets; a bucket
    holding a loss that is not finite (None: a diverged run's) is a "!", however long the
    run (a diverged job ends within a few dozen steps)."""
    size = max(1, -(-len(losses) // width))
    buckets = [_mean(losses[i : i + size]) for i in range(0, len(losses), size)]
    finite = [value for value in buckets if value is not None]
    low, high = (min(finite), max(finite)) if finite else (0.0, 0.0)
    bars = "▁▂▃▄▅▆▇█"
    span = (high - low) or 1.0
    line = "".join(
        "!" if value is None else bars[int((value - low) / span * (len(bars) - 1))]
        for value in buckets
    )
    return f"{score_text(buckets[0])} {line} {score_text(buckets[-1])}"


def _mean(values: list[float | None]) -> float | None:
    return None if None in values else sum(values) / len(values)


def report_status(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """The run's status, with its page (loss curve, validation images) written anew."""

    def status_and_page(session: Session) -> dict[str, Any]:
        status = draw_page(session, app.store, train_run(session, run_id))
        status["dead_asked_for"] = dead_asked_for(session, run_id)
        status["page"] = app.store.link(page_key(run_id), expires_seconds=LINK_SECONDS)
        return status

    render_command = "sdq run" if app.settings.embedded else "sdq submit"
    show = functools.partial(show_training, render_command=render_command)
    lookup(app, status_and_page, as_json=as_json, show=show)
