"""The models training makes: a checkpoint written as a whole pipeline is a model that
generation uses, named RUN@STEP or NAME@STEP (a run's `--into` name), and each knows the
base its run started from."""

import re

from sqlalchemy import select
from sqlalchemy.orm import Session

from sdq.models.evaluate.scores import NoScores, best_step
from sdq.models.jobs.kinds import TRAIN, MadeModel
from sdq.models.registry import ModelNotFound
from sdq.models.tables import Run
from sdq.models.train.specs import lora_file_key
from sdq.models.train.tables import Checkpoint

CHECKPOINT_REF = re.compile(r"(?P<owner>[^/@\s]+)@(?:(?P<step>\d+)|best:(?P<best>\w+))")


def made_model(session: Session, ref: str) -> MadeModel | None:
    """The registry's hook (models/jobs/kinds.py): the checkpoint `ref` names, as a model
    named by its step."""
    checkpoint = checkpoint_named(session, ref)
    if checkpoint is None:
        return None
    owner = ref.partition("@")[0]
    adapters_only = session.get(Run, checkpoint.run_id).options.get("lora_rank") is not None
    return MadeModel(f"{owner}@{checkpoint.step}", checkpoint.model_prefix,
                     checkpoint.model_revision, checkpoint.run_id, checkpoint.step,
                     lora_file_key(checkpoint.model_prefix) if adapters_only else None)  # fmt: skip


def checkpoint_named(session: Session, ref: str) -> Checkpoint | None:
    """`RUN@STEP` or `NAME@STEP` (a run's `--into` name): that step's checkpoint, when it
    is a model in the store; `RUN@best:METRIC`: the model whose METRIC scored best. A step
    of a known run with no such model is an error that lists the steps that have one."""
    match = CHECKPOINT_REF.fullmatch(ref)
    if match is None:
        return None
    owner = match["owner"]
    runs = select(Run.id).where(Run.kind == TRAIN.name)
    if owner.isdigit():
        runs = runs.where(Run.id == int(owner))
    else:
        runs = runs.where(Run.options["into"].as_string() == owner)
    run_id = session.scalar(runs.order_by(Run.id.desc()).limit(1))
    checkpoints = session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step)
    ).all()
    if not checkpoints:
        if run_id is None and not owner.isdigit():
            return None  # a NAME no train run took: another kind of model's, or none
        raise ModelNotFound(_no_checkpoint_yet(session, ref, run_id, match["step"]))
    models = [c for c in checkpoints if c.model_prefix is not None and c.deleted_at is None]
    if match["best"] is not None:
        try:
            step = best_step(session, checkpoints[0].run_id, match["best"],
                             [c.step for c in models])  # fmt: skip
        except NoScores as error:
            raise ModelNotFound(f"{ref}: {error}") from None
    else:
        step = int(match["step"])
    found = next((c for c in models if c.step == step), None)
    if found is None:
        raise ModelNotFound(_no_model_at(session, ref, step, models, run_id))
    return found


def _no_checkpoint_yet(session: Session, ref: str, run_id: int | None, step: str | None) -> str:
    """Why `ref` names no checkpoint: its run has none yet, or is not a train run; for a
    NAME, which earlier runs into it have the step."""
    owner = ref.partition("@")[0]
    if owner.isdigit():
        held = "has no checkpoint yet" if run_id else "is not a train run (`sdq runs` lists them)"
        return f"{ref}: run {owner} {held}"
    older = _in_older_runs(session, owner, int(step), run_id) if step else ""
    return (
        f"{ref}: {owner} names run {run_id}, the newest into it, which has no checkpoint yet{older}"
    )


def _no_model_at(
    session: Session, ref: str, step: int, models: list[Checkpoint], run_id: int
) -> str:
    """Why `ref` names no model: which steps run `run_id` (the one it names) has one at,
    and, for a NAME trained into again, which earlier runs into it have that step."""
    owner = ref.partition("@")[0]
    newest = "" if owner.isdigit() else f" ({owner} names run {run_id}, the newest into it)"
    return (f"{ref}: no model at step {step}{newest} (a checkpoint holds the training state "
            f"only unless it is the run's last, renders validation prompts or --export-every "
            f"asks for it; old ones go with --keep-checkpoints); models at steps: "
            f"{', '.join(str(c.step) for c in models) or 'none yet'}"
            f"{_in_older_runs(session, owner, step, run_id)}")  # fmt: skip


def _in_older_runs(session: Session, owner: str, step: int, newest: int) -> str:
    """`; earlier runs into NAME have it: RUN@STEP` where runs trained into the same name
    before the newest hold a model at that step (NAME@STEP names the newest's)."""
    if owner.isdigit():
        return ""
    older = session.scalars(
        select(Checkpoint.run_id)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Run.options["into"].as_string() == owner, Run.id != newest)
        .where(Checkpoint.step == step, Checkpoint.model_prefix.is_not(None))
        .where(Checkpoint.deleted_at.is_(None))
        .order_by(Checkpoint.run_id.desc())
    ).all()
    if not older:
        return ""
    return f"; earlier runs into {owner} have it: {', '.join(f'{run}@{step}' for run in older)}"


def encoders_lineage(session: Session, revision: str) -> list[str]:
    """The model revision, then the base its train run started from if it is a checkpoint's
    model, and so on back: a checkpoint's model holds its base's VAE, text encoder and
    tokenizer files as they were (the export copies them), so latents any of these models
    made are the ones it would make."""
    lineage = [revision]
    while True:
        base = session.scalar(
            select(Run.options["base_revision"].as_string())
            .join(Checkpoint, Checkpoint.run_id == Run.id)
            .where(Checkpoint.model_revision == lineage[-1])
            .limit(1)
        )
        if base is None or base in lineage:
            return lineage
        lineage.append(base)
