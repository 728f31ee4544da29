"""The evaluate work: one model scored by an evaluation's metrics, its scores stored as
JSON (by the spec's hash: the same model and spec are scored once) and recorded as rows of
checkpoint_scores. Plain code, no Celery; torch loads with the metrics."""

import hashlib
import io
import json
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.db import finite_or_null, upsert
from sdq.models.evaluate.specs import (
    AGAINST_REAL,
    CLIP_SCORED,
    RENDERED,
    EvaluateSpec,
    reference_key,
)
from sdq.models.evaluate.tables import CheckpointScore
from sdq.models.generate.specs import image_key
from sdq.models.jobs.delivery import Work
from sdq.models.jobs.lifecycle import Output
from sdq.models.registry import ModelNotFound, made_by_a_run
from sdq.models.store import MissingObject, ObjectStore
from sdq.models.tables import Job, JobStatus
from sdq.workers.evaluate.held_out import read_held_out, real_images
from sdq.workers.tracking import report
from sdq.workers.weights import ModelUnavailable

if TYPE_CHECKING:
    from sdq.workers.evaluate.metrics import LoadedModels

JSON = "application/json"
NUMPY = "application/x-npy"
# Renders of a checkpoint the trackers show (each prompt a tag), as diffusers' scripts log
# a few validation images: a run scored on hundreds of prompts would fill TensorBoard.
TRACKED_RENDERS = 8
# Scores by metric: (value, None where it is not finite; how many samples or images it is
# over).
Scores = dict[str, tuple[float | None, int]]


class RendersPending(Exception):
    """Some of the evaluation's renders are not made yet: generate workers make them."""


class RendersFailed(Exception):
    """A render the evaluation needs will never be made (its job is dead or cancelled)."""


class CheckpointGone(Exception):
    """The checkpoint was deleted (--keep-checkpoints) before its evaluation ran."""


class EvaluateWork(Work):
    permanent_errors = (ModelUnavailable, RendersFailed, CheckpointGone)
    waiting_errors = (RendersPending,)

    def __init__(
        self, *, store: ObjectStore, sessions: sessionmaker[Session], models: "LoadedModels"
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.models = models

    def run(self, jobs: Sequence[Job]) -> Iterator[Output]:
        for job in jobs:
            started = perf_counter()
            spec = EvaluateSpec.from_dict(job.spec)
            self._check_checkpoint(spec)
            renders = self._renders(spec) if RENDERED & set(spec.evaluation.metrics) else []
            scores = self._scores(spec, renders)
            data = json.dumps(_document(spec, scores), sort_keys=True).encode()
            uri = self.store.put_bytes(spec.output_key, data, content_type=JSON)
            with self.sessions.begin() as session:
                record_scores(session, job.id, spec, scores)
            if spec.run is not None:
                _report(self.store, spec, scores, renders)
            digest = hashlib.sha256(data).hexdigest()
            yield Output(job.id, uri, digest, work_seconds=perf_counter() - started)

    def _check_checkpoint(self, spec: EvaluateSpec) -> None:
        """A run's checkpoint may be gone (its run keeps only its newest) before its
        evaluation comes: the job ends saying so."""
        if spec.run is None:
            return
        try:
            with self.sessions() as session:
                made_by_a_run(session, spec.model_name)
        except ModelNotFound as error:
            raise CheckpointGone(
                f"{error}: it was not evaluated; keep more checkpoints, or evaluate less often "
                f"(--eval-every-checkpoints)"
            ) from None

    def _scores(self, spec: EvaluateSpec, renders: list[bytes]) -> Scores:
        from sdq.workers.evaluate import metrics

        evaluation, scores = spec.evaluation, {}
        if "heldout_loss" in evaluation.metrics:
            unet, scheduler = self.models.unet(spec.model_source, spec.model_revision)
            samples = read_held_out(self.store, evaluation.held_out)
            loss = metrics.heldout_loss(unet, scheduler, samples, evaluation.held_out.timesteps)
            scores["heldout_loss"] = (loss, len(samples.keys))
        if renders:
            scores.update(self._image_scores(spec, metrics, renders))
        return finite(scores)

    def _image_scores(self, spec: EvaluateSpec, metrics, renders: list[bytes]) -> Scores:
        """The renders' CLIP score against their prompts, and their distances from the real
        held-out images' features (computed once, kept in the store)."""
        asked, scores = set(spec.evaluation.metrics), {}
        if CLIP_SCORED & asked:
            scores.update(self._clip_scores(spec, metrics, renders))
        if "fid" in asked:
            inception = self.models.inception(spec.evaluation.fid_weights)
            features = partial(metrics.inception_features, inception)
            real = self._reference(spec, "inception", spec.evaluation.fid_weights.sha256, features)
            scores["fid"] = (metrics.frechet_distance(features(renders), real), len(renders))
        return {metric: scores[metric] for metric in spec.evaluation.metrics if metric in scores}

    def _clip_scores(self, spec: EvaluateSpec, metrics, renders: list[bytes]) -> Scores:
        evaluation = spec.evaluation
        scorer = self.models.scorer(evaluation.clip)
        prompts = [prompt for prompt, _ in evaluation.rendering.prompts]
        embeddings, clip_scores = metrics.clip_scores(scorer, renders, prompts)
        scores = {"clip_score": (float(clip_scores.mean()), len(renders))}
        if AGAINST_REAL & set(evaluation.metrics):
            embedded = partial(metrics.image_embeddings, scorer)
            real = self._reference(spec, "clip", evaluation.clip.revision, embedded)
            scores["fd_clip"] = (metrics.frechet_distance(embeddings, real), len(renders))
            scores["kid"] = (metrics.kernel_distance(embeddings, real), len(renders))
        return scores

    def _renders(self, spec: EvaluateSpec) -> list[bytes]:
        """The renders' PNGs; a wait while any is still to be made, the end when one never
        will be (every job of its spec dead or cancelled, or none written)."""
        renders, missing = [], []
        for spec_hash in spec.renders:
            try:
                renders.append(self.store.get_bytes(image_key(spec_hash)))
            except MissingObject:
                missing.append(spec_hash)
        if not missing:
            return renders
        with self.sessions() as session:
            jobs = session.execute(
                select(Job.spec_hash, Job.status).where(Job.spec_hash.in_(missing))
            ).all()
        coming = {h for h, status in jobs if status not in (JobStatus.dead, JobStatus.cancelled)}
        if never := [h for h in missing if h not in coming]:
            raise RendersFailed(
                f"{len(never)} of the evaluation's {len(spec.renders)} renders will not be "
                f"made: their jobs are dead or cancelled, or none was written"
            )
        raise RendersPending(f"{len(missing)} renders of {spec.model_name} not made yet")

    def _reference(
        self,
        spec: EvaluateSpec,
        extractor: str,
        revision: str,
        features: Callable[[list[bytes]], np.ndarray],
    ) -> np.ndarray:
        """The real held-out images' features, computed once per held-out samples and
        feature extractor and kept in the store."""
        held_out = spec.evaluation.held_out
        key = reference_key(held_out, extractor, revision)
        try:
            return np.load(io.BytesIO(self.store.get_bytes(key)))
        except MissingObject:
            pass
        real = features(real_images(self.store, held_out))
        buffer = io.BytesIO()
        np.save(buffer, real)
        self.store.put_bytes(key, buffer.getvalue(), content_type=NUMPY)
        return real


def _report(store: ObjectStore, spec: EvaluateSpec, scores: Scores, renders: list[bytes]) -> None:
    """A checkpoint's scores and its first renders (the run's validation images, one tag a
    prompt), to the run's trackers."""
    figures = [(f"evaluate/{metric}", spec.step, value)
               for metric, (value, _) in scores.items() if value is not None]  # fmt: skip
    pictures = [(f"renders/{number}", spec.step, png)
                for number, png in enumerate(renders[:TRACKED_RENDERS])]  # fmt: skip
    report(store, spec.run, f"scores-{spec.step:08d}", figures, spec.evaluation.report_to,
           pictures)  # fmt: skip


def _document(spec: EvaluateSpec, scores: Scores) -> dict[str, Any]:
    return {
        "model": spec.model_name,
        "model_revision": spec.model_revision,
        "run": spec.run,
        "step": spec.step,
        "spec_hash": spec.hash(),
        "scores": {metric: {"value": value, "samples": n} for metric, (value, n) in scores.items()},
        "scorers": scorers_of(spec),
    }


def scorers_of(spec: EvaluateSpec) -> dict[str, str]:
    """The revisions of what scored the model, by role."""
    clip, inception = spec.evaluation.clip, spec.evaluation.fid_weights
    return {
        **({"clip": clip.revision} if clip is not None else {}),
        **({"inception": inception.sha256} if inception is not None else {}),
    }


def finite(scores: Scores) -> Scores:
    """A diverged model's NaN (or infinite) scores as None: SQLite holds no NaN, JSON
    writes none, and no best step is chosen by one."""
    return {metric: (finite_or_null(value), n) for metric, (value, n) in scores.items()}


def record_scores(session: Session, job_id: int, spec: EvaluateSpec, scores: Scores) -> None:
    """The scores as rows (those not finite as NULL); an attempt that scores again writes
    the same."""
    rows = [
        {
            "job_id": job_id,
            "run_id": spec.run,
            "step": spec.step,
            "model_name": spec.model_name,
            "model_revision": spec.model_revision,
            "spec_hash": spec.hash(),
            "metric": metric,
            "value": value,
            "samples": samples,
            "scorers": scorers_of(spec),
        }
        for metric, (value, samples) in finite(scores).items()
    ]
    insert = upsert(session, CheckpointScore).values(rows)
    session.execute(
        insert.on_conflict_do_update(
            index_elements=["job_id", "metric"],
            set_={"value": insert.excluded.value, "samples": insert.excluded.samples},
        )
    )
