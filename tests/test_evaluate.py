"""Evaluation: its metrics as torchmetrics computes them; a run's checkpoints scored on one
machine (deterministic, served from the record when asked again, the best chosen by a
score, bad input refused by name, a checkpoint gone before its evaluation); and on the
services, training that never waits for its evaluations."""

import hashlib
import io
import json
import os
import re
import signal
import sqlite3
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import psycopg
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchmetrics.image.fid import FrechetInceptionDistance
from torchmetrics.image.kid import KernelInceptionDistance
from transformers import CLIPModel, CLIPProcessor

from sdq.migrations import upgrade
from sdq.models.curate.clip import ClipIdentity, ScorerRef, resolve_clip
from sdq.models.db import make_engine, session_factory
from sdq.models.evaluate.scores import NoScores, best_step, run_scores, score_text
from sdq.models.evaluate.specs import METRICS, EvaluateSpec, Evaluation, FidWeights, HeldOut
from sdq.models.generate.specs import FixedRenders, image_key
from sdq.models.jobs.kinds import EVALUATE
from sdq.models.jobs.lifecycle import OUTAGE
from sdq.models.specs import canonical_sha256
from sdq.models.store import LocalStore
from sdq.models.tables import Job, JobStatus
from sdq.models.train.page import curve_svg
from sdq.models.train.specs import TrainOptions, TrainShardSpec
from sdq.producer.cli.common import DEAD_JOBS
from sdq.workers.curate.scoring import LoadedScorers
from sdq.workers.evaluate.metrics import (
    clip_scores,
    frechet_distance,
    image_embeddings,
    kernel_distance,
)
from sdq.workers.evaluate.work import (
    EvaluateWork,
    RendersFailed,
    RendersPending,
    record_scores,
)
from sdq.workers.weights import ModelFiles
from tests.conftest import (
    BUCKET,
    ROOT,
    BeatProcess,
    WorkerProcess,
    job_history,
    run_sdq,
    sdq_json,
    store_behind_a_proxy,
    wait_for_run,
)
from tests.hostile_server import HostileServer
from tests.netns_download import DOWNLOAD_ENV
from tests.services import clean_env, wait_for
from tests.test_curate import tiny_clip
from tests.test_encode import write_list
from tests.test_fid import random_fid_weights
from tests.test_jobs import new_run
from tests.test_monitoring import scraped
from tests.test_train import encoded_dataset

pytestmark = pytest.mark.timeout(600)
TRAIN = ["--base", "tiny", "--resolution", "64", "--batch-size", "4", "--steps", "20",
         "--checkpoint-every", "10", "--holdout", "0.25", "--eval-samples", "4"]  # fmt: skip
ALL = ",".join(METRICS)


def test_an_evaluation_travels_in_a_spec_whole_and_its_hash_ignores_where_it_reports() -> None:
    evaluation = Evaluation(
        metrics=("heldout_loss", "kid"), every=2,
        held_out=HeldOut(key="train/1/held_out.parquet", fraction=0.1, seed=3, samples=8),
        rendering=FixedRenders(prompts=(("a cat", 1),), size=64, scheduler="ddim",
                               dtype="auto", scheduler_config={"beta_end": 0.012}),
        clip=ClipIdentity(name="clip", source="/clip", revision="c0", embedding_width=16),
        fid_weights=FidWeights(source="/inception.pth", sha256="ab"),
        report_to=("tensorboard",),
    )  # fmt: skip
    spec = EvaluateSpec(model_name="1@20", model_source="store:x", model_revision="r",
                        evaluation=evaluation, renders=("h1",), run=1, step=20)  # fmt: skip
    assert EvaluateSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    train = TrainShardSpec(run=1, first_step=0, last_step=10, model_name="1", base_name="tiny",
                           base_source="tiny", base_revision="r", prediction_type="epsilon",
                           scheduler_config={}, options=TrainOptions(steps=20),
                           evaluation=evaluation, report_to=("tensorboard",))  # fmt: skip
    assert TrainShardSpec.from_dict(json.loads(json.dumps(train.to_dict()))) == train
    # Scored once, however often a run asks and wherever the scores are reported.
    quiet = replace(spec, evaluation=replace(evaluation, every=1, report_to=()), run=2, step=5)
    assert quiet.hash() == spec.hash()
    assert replace(spec, model_revision="other").hash() != spec.hash()
    other_weights = replace(evaluation, fid_weights=FidWeights(source="/i.pth", sha256="cd"))
    assert replace(spec, evaluation=other_weights).hash() != spec.hash()


class Features(torch.nn.Module):
    """The features as they are: torchmetrics' distances over features given directly."""

    num_features = 16

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features


def test_an_evaluation_waits_for_renders_to_come_and_ends_when_one_never_will(
    migrated_postgres: str, tmp_path: Path
) -> None:
    """One render made, another queued: a wait (no attempt spent). The other dead: the
    evaluation ends, saying so, though a render of it exists."""
    sessions = session_factory(make_engine(migrated_postgres))
    store = LocalStore(tmp_path / "store")
    made, coming = {"prompt": f"made {tmp_path}"}, {"prompt": f"coming {tmp_path}"}
    new_run(sessions, made, status=JobStatus.succeeded)
    png = _png(np.zeros((8, 8, 3), np.uint8))
    store.put_bytes(image_key(canonical_sha256(made)), png, content_type="image/png")
    [coming_job] = new_run(sessions, coming, status=JobStatus.queued)
    evaluation = Evaluation(metrics=("clip_score",))
    spec = EvaluateSpec(model_name="m", model_source="s", model_revision="r",
                        evaluation=evaluation,
                        renders=(canonical_sha256(made), canonical_sha256(coming)))  # fmt: skip
    work = EvaluateWork(store=store, sessions=sessions, models=None)
    with pytest.raises(RendersPending):
        work._renders(spec)
    with sessions.begin() as session:
        session.get_one(Job, coming_job).status = JobStatus.dead
    with pytest.raises(RendersFailed, match="1 of the evaluation's 2 renders will not be made"):
        work._renders(spec)


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_a_diverged_checkpoint_s_scores_are_kept_as_not_finite_and_never_best(
    database: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A diverged checkpoint's held-out loss is NaN (and its distances infinite). They are
    recorded as no number beside its other scores (SQLite, which holds no NaN, refused the
    row and lost them all), shown as not finite on the screens and the run's page, and
    never chosen as a best step: the best finite one is; a metric with no finite score at
    all is refused by name."""
    url = (request.getfixturevalue("migrated_postgres") if database == "postgres"
           else f"sqlite:///{tmp_path / 'sdq.db'}")  # fmt: skip
    if database == "sqlite":
        upgrade(make_engine(url))
    sessions = session_factory(make_engine(url))
    jobs = new_run(sessions, {"step": 10}, {"step": 20}, kind=EVALUATE)
    with sessions() as session:
        run = session.get_one(Job, jobs[0]).run_id
    nan, inf = float("nan"), float("inf")
    scored = {10: {"heldout_loss": (0.31, 4), "clip_score": (20.5, 4), "kid": (nan, 4)},
              20: {"heldout_loss": (nan, 4), "clip_score": (21.0, 4), "kid": (inf, 4)}}  # fmt: skip
    for job, (step, scores) in zip(jobs, scored.items(), strict=True):
        spec = EvaluateSpec(model_name=f"{run}@{step}", model_source="s", model_revision="r",
                            evaluation=Evaluation(metrics=("heldout_loss", "clip_score", "kid")),
                            run=run, step=step)  # fmt: skip
        with sessions.begin() as session:
            record_scores(session, job, spec, scores)
    with sessions() as session:
        curves = run_scores(session, run)
        assert curves == {"heldout_loss": [(10, 0.31), (20, None)],
                          "clip_score": [(10, 20.5), (20, 21.0)],
                          "kid": [(10, None), (20, None)]}  # fmt: skip
        assert best_step(session, run, "heldout_loss", among={10, 20}) == 10
        assert best_step(session, run, "clip_score", among={10, 20}) == 20
        with pytest.raises(NoScores, match="kid is not finite at every checkpoint still there"):
            best_step(session, run, "kid", among={10, 20})
        said = "no fid score at any step (the metrics it was scored on: clip_score, heldout_loss,"
        with pytest.raises(NoScores, match=re.escape(said)):
            best_step(session, run, "fid", among={10, 20})
    assert (score_text(None), score_text(0.31)) == ("not finite", "0.3100")
    # The run's page plots the finite values and names the steps that are not.
    plotted = curve_svg(curves["heldout_loss"])
    assert "<polyline" in plotted and "not finite at steps 20" in plotted
    assert curve_svg(curves["kid"]) == "<p>not finite at steps 10, 20</p>"


def test_the_distances_and_the_clip_score_are_torchmetrics_own(tmp_path: Path) -> None:
    draw = np.random.default_rng(0)
    real, fake = draw.normal(size=(40, 16)), draw.normal(0.3, 1.2, size=(40, 16))
    fid = FrechetInceptionDistance(feature=Features())
    kid = KernelInceptionDistance(feature=Features(), subsets=1, subset_size=40)
    for metric in (fid, kid):
        metric.update(torch.from_numpy(real), real=True)
        metric.update(torch.from_numpy(fake), real=False)
    assert frechet_distance(fake, real) == pytest.approx(float(fid.compute()), rel=1e-6)
    assert kernel_distance(fake, real) == pytest.approx(float(kid.compute()[0]), rel=1e-6)

    pixels = [draw.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(6)]
    texts = [f"picture number {n}" for n in range(6)]
    clip = agreeing(tiny_clip(tmp_path / "clip"), pixels, texts)
    found = resolve_clip(str(clip))
    scorer = LoadedScorers(_files(tmp_path), None).get(ScorerRef(found.source, found.revision))
    pngs = [_png(p) for p in pixels]
    embeddings, scores = clip_scores(scorer, pngs, texts)
    cosines, wanted_embeddings = plain_cosines(clip, pixels, texts)
    wanted = [max(0.0, 100 * cosine) for cosine in cosines]
    assert scores.tolist() == pytest.approx(wanted, rel=1e-3, abs=1e-3)
    assert any(score > 0 for score in wanted)
    # What the distances are computed on: the same embeddings, before any clamp (curate's
    # resize of noise images differs from the processor's in the last bits: 2e-4 here).
    np.testing.assert_allclose(embeddings, wanted_embeddings, atol=1e-3)
    np.testing.assert_allclose(image_embeddings(scorer, pngs), embeddings, atol=1e-6)


def plain_cosines(
    clip: Path, pixels: list[np.ndarray], texts: list[str]
) -> tuple[list[float], np.ndarray]:
    """Each image's and text's CLIP cosine, by transformers alone, and each image's
    normalised embedding. (torchmetrics' CLIPScore is 100 x the cosine, 0 at worst; its
    1.9 class fails on transformers 5, whose get_image_features returns an output object.)"""
    model = CLIPModel.from_pretrained(clip).eval()
    processor = CLIPProcessor.from_pretrained(clip)
    cosines, embeddings = [], []
    with torch.no_grad():
        for image, text in zip(pixels, texts, strict=True):
            inputs = processor(text=[text], images=[image], return_tensors="pt", padding=True)
            out = model(**inputs)
            image_embeds = out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
            text_embeds = out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True)
            cosines.append(float((image_embeds * text_embeds).sum()))
            embeddings.append(image_embeds[0].numpy())
    return cosines, np.stack(embeddings)


def agreeing(clip: Path, pixels: list[np.ndarray], texts: list[str]) -> Path:
    """The random CLIP with its text projection turned round where its images and texts
    mostly disagree: positive scores to compare, not a clamp's 0s."""
    if np.mean(plain_cosines(clip, pixels, texts)[0]) < 0:
        model = CLIPModel.from_pretrained(clip)
        with torch.no_grad():
            model.text_projection.weight.neg_()
        model.save_pretrained(clip)
    return clip


def _files(tmp_path: Path) -> ModelFiles:
    return ModelFiles(None, tmp_path / "model-cache")


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _sdq(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_sdq(env, *args, "--json", cwd=cwd)


def test_a_run_s_checkpoints_scored_on_one_machine(tmp_path: Path) -> None:
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline",
           "WANDB_DIR": str(wandb_dir)}  # fmt: skip
    clip = str(tiny_clip(tmp_path / "clip"))
    inception = str(random_fid_weights(tmp_path / "inception.pth"))
    encoded_dataset(env, "toy", 16, tmp_path)
    database = tmp_path / "sdq-data/sdq.db"

    # Bad input: refused by name, exit 2, no run written.
    empty, binary, one = tmp_path / "empty.txt", tmp_path / "binary.txt", tmp_path / "one.txt"
    empty.write_text("\n\n")
    binary.write_bytes(b"a prompt\n\xff\xfe\n")
    one.write_text("a lone prompt\n")
    refusals = [
        (["--holdout", "0", "--eval-metrics", "heldout_loss"], "give --holdout FRACTION above 0"),
        # Nothing left to train on: the data lanes would wait for ever.
        (["--holdout", "0.9999999", "--eval-metrics", "heldout_loss"],
         "--holdout 0.9999999 holds out all 16 samples of toy: none is left to train on"),
        (["--eval-metrics", "fid_clip"], "metrics are heldout_loss, clip_score, fd_clip, kid, fid"),
        (["--eval-metrics", "clip_score"],
         "clip_score needs a CLIP model to score renders with: give --eval-clip MODEL"),
        (["--eval-metrics", "fid"], "give --fid-weights FILE|s3://"),
        (["--eval-metrics", "heldout_loss", "--fid-weights", inception], "only with fid among"),
        (["--eval-metrics", "fid", "--fid-weights", clip + "/config.json"],
         "is not a PyTorch weights file"),
        (["--eval-metrics", "clip_score", "--eval-clip", str(tmp_path)], "is not a CLIP model"),
        (["--eval-metrics", "clip_score", "--eval-clip", clip, "--eval-prompts", str(empty)],
         "no prompts (one prompt a line)"),
        (["--eval-metrics", "clip_score", "--eval-clip", clip, "--eval-prompts", str(binary)],
         "binary.txt:2: not UTF-8 text"),
        # One render: no covariance, no pair of renders to average over.
        (["--eval-metrics", "kid", "--eval-clip", clip, "--eval-prompts", str(one)],
         "kid need at least 2 renders and 2 real images to compare, and this evaluation "
         "has 1 and"),
    ]  # fmt: skip
    for options, message in refusals:
        refused = _sdq(env, tmp_path, "train", "toy", *TRAIN, *options)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT count(*) FROM runs WHERE kind = 'train'").fetchone() == (0,)

    trained = sdq_json(env, "train", "toy", *TRAIN, "--eval-metrics", "kid,heldout_loss,"
                       "clip_score,fd_clip,fid", "--eval-clip", clip, "--fid-weights", inception,
                       "--report-to", "tensorboard", "--report-to", "wandb",
                       cwd=tmp_path)  # fmt: skip
    run = trained["run_id"]
    scores = trained["scores"]
    assert sorted(scores) == sorted(METRICS)
    assert all([step for step, _ in curve] == [10, 20] for curve in scores.values())
    assert all(value >= 0 for curve in scores.values() for _, value in curve)
    with sqlite3.connect(database) as db:
        counted = db.execute("SELECT metric, samples, count(*) FROM checkpoint_scores WHERE "
                             "run_id = ? GROUP BY metric, samples", (run,)).fetchall()  # fmt: skip
    assert sorted(counted) == sorted((metric, 4, 2) for metric in METRICS)
    with sqlite3.connect(database) as db:
        [scorers] = db.execute("SELECT DISTINCT scorers FROM checkpoint_scores WHERE run_id = ?",
                               (run,)).fetchone()  # fmt: skip
    weights_sha256 = hashlib.sha256(Path(inception).read_bytes()).hexdigest()
    assert json.loads(scorers) == {"clip": resolve_clip(clip).revision, "inception": weights_sha256}
    no_gallery = _sdq(env, tmp_path, "gallery", str(run))
    assert no_gallery.returncode == 2 and f"run {run} is a train run" in no_gallery.stderr
    # The run's page plots every score against the step.
    page = (tmp_path / f"sdq-data/store/runs/{run}/training.html").read_text()
    assert all(f"<h2>{metric}</h2>" in page for metric in METRICS)

    # TensorBoard reads the run's folder in the store: every step's figures, every score.
    events = EventAccumulator(str(tmp_path / f"sdq-data/store/runs/{run}/tensorboard")).Reload()
    for tag, curve in [
        ("train/loss", trained["losses"]),
        *((f"evaluate/{metric}", curve) for metric, curve in scores.items()),
    ]:
        shown = events.Scalars(tag)
        assert [event.step for event in shown] == [step for step, _ in curve]
        assert [event.value for event in shown] == pytest.approx([v for _, v in curve], rel=1e-6)
    assert len(events.Scalars("train/learning_rate")) == 20
    # Each job's wall time by what it went to, as shares at its last step.
    shares = {name: events.Scalars(f"time/{name}")
              for name in ("training", "data_wait", "checkpoint", "other")}  # fmt: skip
    assert all([event.step for event in shown] == [10, 20] for shown in shares.values())
    for job in range(2):
        parts = [shown[job].value for shown in shares.values()]
        assert all(0 <= part <= 1 for part in parts) and shares["training"][job].value > 0
        assert sum(parts) == pytest.approx(1, abs=1e-6)
    # Each checkpoint's renders are its validation images there, one tag a prompt.
    renders = _evaluation_renders(database, run)
    assert sorted(events.Tags()["images"]) == [f"renders/{n}" for n in range(4)]
    for number in range(4):
        shown = events.Images(f"renders/{number}")
        assert [event.step for event in shown] == [10, 20]
        for event, step in zip(shown, (10, 20), strict=True):
            stored = tmp_path / "sdq-data/store" / image_key(renders[step][number])
            assert _pixels(event.encoded_image_string) == _pixels(stored.read_bytes())
    # W&B (offline) gets the same figures in its run sdq-run-RUN, each against its own step.
    logged = _wandb_history(wandb_dir, run)
    assert [(row["train/step"], row["train/loss"]) for row in logged if "train/loss" in row] == [
        tuple(point) for point in trained["losses"]
    ]
    for metric, curve in scores.items():
        points = sorted((row["evaluate/step"], row[f"evaluate/{metric}"]) for row in logged
                        if f"evaluate/{metric}" in row)  # fmt: skip
        assert points == [tuple(point) for point in curve]
    # (An image's fields travel flattened: renders/0/_type, renders/0/sha256...)
    pictured = sorted((row["renders/step"], row[f"renders/{n}/_type"]) for row in logged
                      for n in range(4) if "renders/step" in row)  # fmt: skip
    assert pictured == [(10, "image-file")] * 4 + [(20, "image-file")] * 4

    # The same checkpoint and spec, asked again: served from the record, the same values.
    again = sdq_json(env, "evaluate", f"{run}@20", "--metrics", ALL, cwd=tmp_path)
    assert {m: s["value"] for m, s in again["scores"].items()} == {
        metric: curve[-1][1] for metric, curve in scores.items()
    }
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT cached FROM jobs WHERE run_id = ?",
                          (again["run_id"],)).fetchone() == (1,)  # fmt: skip
    # The base on the run's spec: the same held-out draws, another model's loss.
    base = sdq_json(env, "evaluate", "tiny", "--like", str(run), "--metrics", "heldout_loss",
                    cwd=tmp_path)["scores"]["heldout_loss"]  # fmt: skip
    assert base["samples"] == 4 and base["value"] not in {v for _, v in scores["heldout_loss"]}
    # Against a dataset's own images: its first 6 kept samples, their captions rendered.
    done = _sdq(env, tmp_path, "evaluate", f"{run}@20", "--reference", "toy", "--samples", "6",
                "--metrics", "fd_clip,kid")  # fmt: skip
    assert done.returncode == 0, done.stderr
    referenced = json.loads(done.stdout)["scores"]
    # The renders' bar counts their 6 jobs (it said 6/1), then the scoring's 1.
    assert re.findall(r"run \d+ \S+ (\d+/\d+)", done.stderr) == ["6/6", "1/1"], done.stderr
    evaluated = json.loads(done.stdout)["run_id"]
    asked = _sdq(env, tmp_path, "train", "status", str(evaluated))
    assert f"run {evaluated} is not a train run (its kind: evaluate)" in asked.stderr
    assert {metric: score["samples"] for metric, score in referenced.items()} == {
        "fd_clip": 6, "kid": 6
    }  # fmt: skip
    assert referenced["fd_clip"]["value"] >= 0
    assert referenced["fd_clip"]["value"] != dict(scores["fd_clip"])[20]
    lone = _sdq(env, tmp_path, "evaluate", f"{run}@20", "--reference", "toy", "--samples", "6",
                "--metrics", "fd_clip,kid", "--prompts", str(one))  # fmt: skip
    said = ("fd_clip, kid need at least 2 renders and 2 real images to compare, and this "
            "evaluation has 1 and 6: give more prompts (--prompts)")  # fmt: skip
    assert lone.returncode == 2 and said in " ".join(lone.stderr.split()), lone.stderr
    no_latents = _sdq(env, tmp_path, "evaluate", "tiny", "--reference", "toy", "--metrics",
                      "heldout_loss,fd_clip", "--clip", "tiny")  # fmt: skip
    assert no_latents.returncode == 2 and "not on --reference's images" in no_latents.stderr
    no_clip = _sdq(env, tmp_path, "evaluate", "tiny", "--reference", "toy", "--metrics", "kid")
    assert no_clip.returncode == 2 and "give --clip MODEL" in no_clip.stderr  # its own flag
    no_prompts = _sdq(env, tmp_path, "evaluate", "tiny", "--metrics", "clip_score", "--clip",
                      "tiny")  # fmt: skip
    assert no_prompts.returncode == 2 and "renders need prompts" in no_prompts.stderr

    # Choosing by score: the lowest held-out loss, the highest CLIP score.
    losses = dict(scores["heldout_loss"])
    best = min(losses, key=losses.get)
    resumed = sdq_json(env, "train", "toy", "--resume-from", f"{run}@best:heldout_loss",
                       "--resolution", "64", "--batch-size", "4", "--steps", "2",
                       cwd=tmp_path)  # fmt: skip
    assert resumed["resumed_from"] == {"run": run, "step": best}
    none_yet = _sdq(env, tmp_path, "train", "toy", "--resume-from", f"{resumed['run_id']}"
                    "@best:clip_score", "--resolution", "64", "--steps", "2")  # fmt: skip
    said = (f"train run {resumed['run_id']} has no clip_score score at any step (the metrics it "
            "was scored on: none)")  # fmt: skip
    assert none_yet.returncode == 2 and said in " ".join(none_yet.stderr.split()), none_yet.stderr
    nowhere = _sdq(env, tmp_path, "model", "push", "9999@best:kid", "nowhere")
    assert nowhere.returncode == 2, nowhere.stderr
    assert "9999@best:kid: run 9999 is not a train run" in nowhere.stderr

    # The best by CLIP score pushed as a model of its own: the checkpoint's files, copied
    # within the store, its revision (so its lineage), and the same held-out loss.
    clip_scores = dict(scores["clip_score"])
    highest = max(clip_scores, key=clip_scores.get)
    pushed = sdq_json(env, "model", "push", f"{run}@best:clip_score", "best-toy", cwd=tmp_path)
    assert (pushed["run"], pushed["step"], pushed["uploaded"]) == (run, highest, True)
    with sqlite3.connect(database) as db:
        [(prefix, revision)] = db.execute(
            "SELECT model_prefix, model_revision FROM checkpoints WHERE run_id = ? AND step = ?",
            (run, highest),
        ).fetchall()  # fmt: skip
    assert pushed["revision"] == revision
    store = tmp_path / "sdq-data/store"
    copied = store / f"models/best-toy/{revision[:16]}"
    assert pushed["uri"] == copied.as_uri()
    assert _contents(copied) == _contents(store / prefix)
    scored = sdq_json(env, "evaluate", "best-toy", "--like", str(run), "--metrics",
                      "heldout_loss", cwd=tmp_path)["scores"]["heldout_loss"]  # fmt: skip
    assert scored["value"] == losses[highest]
    unknown = _sdq(env, tmp_path, "model", "push", f"{run}@best:fid_clip", "nothing")
    assert unknown.returncode == 2 and "fid_clip" in unknown.stderr, unknown.stderr

    # Weights torch.save wrote, but not Inception's: the evaluation ends dead, saying so.
    other = tmp_path / "other.pth"
    torch.save({"fc.weight": torch.zeros(2, 2)}, other)
    wrong = _sdq(env, tmp_path, "evaluate", f"{run}@20", "--metrics", "fid", "--fid-weights",
                 str(other))  # fmt: skip
    assert wrong.returncode == DEAD_JOBS, wrong.stderr
    assert "are not Inception-v3's FID weights" in wrong.stderr, wrong.stderr
    assert 'Missing key(s) in state_dict: "Conv2d_1a_3x3.conv.weight"' in wrong.stderr

    # A checkpoint deleted by --keep-checkpoints before its evaluation ran: that job ends
    # saying so, the others score.
    # The train command fails, as a waited-for run with dead jobs does, its status naming
    # the evaluation and why (`sdq train status` too).
    ended = _sdq(env, tmp_path, "train", "toy", *TRAIN, "--keep-checkpoints", "1",
                 "--eval-metrics", "heldout_loss")  # fmt: skip
    assert ended.returncode == DEAD_JOBS, ended.stderr
    kept = json.loads(ended.stdout)
    assert [step for step, _ in kept["scores"]["heldout_loss"]] == [20]
    [dead] = kept["dead_asked_for"]
    shown = run_sdq(env, "train", "status", str(kept["run_id"]), cwd=tmp_path).stdout
    assert f"dead: run {dead['run_id']} (evaluation of train run {kept['run_id']} at step 10)" in (
        " ".join(shown.split())
    ), shown
    with sqlite3.connect(database) as db:
        [(status, attempts, error)] = db.execute(
            "SELECT j.status, j.attempts, j.error FROM jobs j JOIN runs r ON r.id = j.run_id "
            "WHERE r.kind = 'evaluate' AND j.status != 'succeeded' "
            "AND json_extract(r.options, '$.evaluation_of') = ?", (kept["run_id"],),
        ).fetchall()  # fmt: skip
    assert (status, attempts) == ("dead", 1) and dead["error"] == error
    assert "no model at step 10" in error and "keep more checkpoints" in error


def test_a_run_scored_on_a_dataset_of_its_own(tmp_path: Path) -> None:
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    encoded_dataset(env, "toy", 8, tmp_path)
    encoded_dataset(env, "judge", 6, tmp_path)
    database = tmp_path / "sdq-data/sdq.db"
    plain = [option for option in TRAIN if option not in ("--holdout", "0.25")]
    metrics = ["--eval-metrics", "heldout_loss"]
    for options, message in [
        (["--eval-dataset", "toy", *metrics], "--eval-dataset toy is the dataset the run trains"),
        (["--eval-dataset", "nothing", *metrics], "--eval-dataset: no dataset named 'nothing'"),
        (["--eval-dataset", "judge", "--holdout", "0.25", *metrics], "that nothing scores"),
        (["--eval-dataset", "judge"], "give the metrics too"),
    ]:  # fmt: skip
        refused = _sdq(env, tmp_path, "train", "toy", *plain, *options)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT count(*) FROM runs WHERE kind = 'train'").fetchone() == (0,)

    # Three checkpoints, every second one scored, and the last.
    trained = sdq_json(env, "train", "toy", *plain, "--steps", "30", "--eval-dataset", "judge",
                       *metrics, "--eval-samples", "5", "--eval-every-checkpoints", "2",
                       cwd=tmp_path)  # fmt: skip
    run = trained["run_id"]
    assert [checkpoint["step"] for checkpoint in trained["checkpoints"]] == [10, 20, 30]
    losses = dict(trained["scores"]["heldout_loss"])
    assert sorted(losses) == [20, 30]
    # The status says each metric's latest value and its best, with their steps.
    shown = subprocess.run(
        [sys.executable, "-m", "sdq.producer.cli", "train", "status", str(run)],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    best = min(losses, key=losses.get)
    assert f"{losses[best]:.4f} at step {best}" in shown.stdout, shown.stdout
    with sqlite3.connect(database) as db:
        [(options,)] = db.execute("SELECT options FROM runs WHERE id = ?", (run,)).fetchall()
        trained_on = db.execute(
            "SELECT DISTINCT d.name FROM train_inputs t JOIN latent_shards l "
            "ON l.id = t.latent_shard_id JOIN datasets d ON d.id = l.dataset_id "
            "WHERE t.run_id = ?", (run,),
        ).fetchall()  # fmt: skip
        samples = db.execute("SELECT DISTINCT samples FROM checkpoint_scores WHERE run_id = ?",
                             (run,)).fetchall()  # fmt: skip
    assert trained_on == [("toy",)] and samples == [(5,)]
    # An evaluate job is shown as every kind's are, with its spec's fields; its run too.
    with sqlite3.connect(database) as db:
        [(evaluation, evaluated_in)] = db.execute(
            "SELECT id, run_id FROM jobs WHERE kind = 'evaluate' ORDER BY id LIMIT 1"
        ).fetchall()
    shown_job = sdq_json(env, "show", str(evaluation), cwd=tmp_path)
    assert (shown_job["run"], shown_job["step"], shown_job["metrics"]) == (run, 20, "heldout_loss")
    assert sdq_json(env, "status", str(evaluated_in), cwd=tmp_path)["jobs"]
    # Scored on judge's first 5 samples, listed once in the store by their content.
    held_out = json.loads(options)["evaluation"]["held_out"]
    assert held_out["key"].startswith("evaluate/references/judge-") and held_out["samples"] == 5
    listed = pq.read_table(tmp_path / "sdq-data/store" / held_out["key"]).to_pydict()
    assert all("/judge/" in key for key in listed["latent_key"])
    assert listed["row"] == [0, 1, 2, 3, 4]
    # Another model on the same spec: judge's samples, the same draws.
    base = sdq_json(env, "evaluate", "tiny", "--like", str(run), "--metrics", "heldout_loss",
                    cwd=tmp_path)["scores"]["heldout_loss"]  # fmt: skip
    assert base["samples"] == 5 and base["value"] > 0


def _wandb_history(folder: Path, run: int) -> list[dict]:
    """Every row W&B logged offline to the run `sdq-run-RUN`, read from its `.wandb` files
    (what `wandb sync` uploads: protobuf records in LevelDB's log format, 32 KiB blocks of
    chunks each with a 7-byte header: CRC, length, FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto.wandb_internal_pb2 import Record

    rows = []
    # Two runs begun within one second get the same folder name but for a "-1" suffix.
    named = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-sdq-run-{run}(-\d+)?")
    folders = [path for path in folder.glob("wandb/offline-run-*") if named.fullmatch(path.name)]
    for path in sorted(found / f"run-sdq-run-{run}.wandb" for found in folders):
        data, record = path.read_bytes(), b""
        assert data[:4] == b":W&B"
        position = 7
        while position + 7 <= len(data):
            left = 32768 - position % 32768
            _crc, length, chunk = struct.unpack("<IHB", data[position : position + 7])
            if left < 7 or chunk == 0:  # the block's trailer
                position += left
                continue
            record += data[position + 7 : position + 7 + length]
            position += 7 + length
            if chunk in (1, 4):  # FULL, LAST
                parsed = Record.FromString(record)
                record = b""
                if parsed.WhichOneof("record_type") == "history":
                    # A key with a slash travels as its parts.
                    rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                 for item in parsed.history.item})  # fmt: skip
    return rows


def _evaluation_renders(database: Path, run: int) -> dict[int, list[str]]:
    """The spec hashes of each scored step's renders, in the prompts' order."""
    with sqlite3.connect(database) as db:
        specs = [json.loads(spec) for (spec,) in db.execute(
            "SELECT j.spec FROM jobs j JOIN runs r ON r.id = j.run_id WHERE r.kind = 'evaluate' "
            "AND json_extract(r.options, '$.evaluation_of') = ?", (run,),
        )]  # fmt: skip
    return {spec["step"]: spec["renders"] for spec in specs}


def _pixels(png: bytes) -> list[int]:
    with Image.open(io.BytesIO(png)) as image:
        return list(image.convert("RGB").getdata())


def _contents(folder: Path) -> dict[Path, bytes]:
    return {path.relative_to(folder): path.read_bytes() for path in folder.rglob("*")
            if path.is_file()}  # fmt: skip


def _evaluations(database_url: str, run_id: int) -> list[tuple[str, int]]:
    with psycopg.connect(database_url) as connection:
        return connection.execute(
            "SELECT j.status, j.attempts FROM jobs j JOIN runs r ON r.id = j.run_id "
            "WHERE r.kind = 'evaluate' AND (r.options->>'evaluation_of')::int = %s ORDER BY j.id",
            (run_id,),
        ).fetchall()


@pytest.mark.slow
def test_evaluation_never_holds_training_and_a_later_worker_scores_every_checkpoint(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    env = {**own_deployment, **DOWNLOAD_ENV}
    database_url = env["SDQ_DATABASE_URL"]
    clip = str(tiny_clip(tmp_path / "clip"))
    not_evaluating = ("--queues", "train,generate,encode")
    workers = [
        WorkerProcess(env, tmp_path / "cpu.log", pool="cpu").start(),
        WorkerProcess(env, tmp_path / "gpu.log", args=not_evaluating).start(),
    ]
    try:
        encoded_dataset(env, "evaluated", 16, tmp_path)
        inception = str(random_fid_weights(tmp_path / "inception.pth"))
        trained = sdq_json(env, "train", "evaluated", *TRAIN, "--eval-metrics", ALL,
                           "--eval-clip", clip, "--fid-weights", inception, "--wait",
                           cwd=tmp_path)  # fmt: skip
        # No worker consumes `evaluate`: the run went on and ended all the same.
        assert (trained["status"], trained["step"]) == ("succeeded", 20)
        assert trained["scores"] == {}
        assert _evaluations(database_url, trained["run_id"]) == [("queued", 0), ("queued", 0)]
        # Another machine's worker (a name of its own) on the evaluate queue alone.
        evaluator = WorkerProcess(env, tmp_path / "evaluate.log", args=("--queues", "evaluate"),
                                  host="evaluator")  # fmt: skip
        workers.append(evaluator.start())
        wait_for(
            lambda: _evaluations(database_url, trained["run_id"]) == [("succeeded", 1)] * 2,
            what="both checkpoints' evaluations",
            timeout=300,
        )
        status = sdq_json(env, "train", "status", str(trained["run_id"]), cwd=tmp_path)
        assert sorted(status["scores"]) == sorted(METRICS)
        assert all([step for step, _ in curve] == [10, 20] for curve in status["scores"].values())
        # `sdq evaluate --wait` against the workers: one checkpoint on a spec of its own (the
        # held-out loss alone), waited for; the same draws give the run's own value.
        waited = sdq_json(env, "evaluate", f"{trained['run_id']}@20", "--metrics",
                          "heldout_loss", "--wait", cwd=tmp_path)  # fmt: skip
        assert waited["status"] == "succeeded" and waited["run_id"] > trained["run_id"]
        assert waited["scores"]["heldout_loss"]["value"] == pytest.approx(
            dict(status["scores"]["heldout_loss"])[20], rel=1e-5
        )
        # `sdq metrics` shows the run's training as gauges, for a while after its end too.
        gauges = scraped(env, {"sdq_train_step", "sdq_train_loss", "sdq_train_samples_per_second"})
        run = (("run", str(trained["run_id"])),)
        assert gauges[("sdq_train_step", run)] == 20
        assert gauges[("sdq_train_loss", run)] == pytest.approx(status["losses"][-1][1])
        assert gauges[("sdq_train_samples_per_second", run)] > 0
    finally:
        for worker in workers:
            worker.stop()


@pytest.mark.slow
def test_an_evaluation_outlasts_a_store_outage_and_its_killed_worker(
    own_deployment: dict[str, str], s3: dict[str, str], s3_client, tmp_path: Path
) -> None:
    """The store goes away while an evaluation scores (waited out, no attempt spent), then
    its worker is killed with its pool mid-retry: a new worker scores it, once, and the
    real images' features are stored once."""
    prefix = f"evaluate-faults-{tmp_path.name}"
    with store_behind_a_proxy(own_deployment, s3, prefix) as (env, proxy):
        database_url = env["SDQ_DATABASE_URL"]
        renderer = WorkerProcess(env, tmp_path / "generate.log", args=("--queues", "generate"))
        workers = [renderer.start(), WorkerProcess(env, tmp_path / "cpu.log", pool="cpu").start(),
                   BeatProcess(env, tmp_path / "beat.log").start()]  # fmt: skip
        try:
            with HostileServer() as server:
                listing = write_list(tmp_path / "list.csv", server.base, 8)
                sdq_json(env, "download", str(listing), "--dataset", "judged", "--resolution",
                         "64", "--wait", cwd=tmp_path)  # fmt: skip
            prompts = tmp_path / "prompts.txt"
            prompts.write_text("".join(f"a picture, number {n}\n" for n in range(6)))
            weights = random_fid_weights(tmp_path / "inception.pth")
            run = sdq_json(env, "evaluate", "tiny", "--reference", "judged", "--samples", "6",
                           "--metrics", "fid", "--fid-weights", str(weights), "--prompts",
                           str(prompts), cwd=tmp_path)["run_id"]  # fmt: skip
            # The renders are made, and nothing scores them yet.
            assert wait_for_run(database_url, run - 1) == {"succeeded": 6}
            proxy.outage()
            evaluator = WorkerProcess(env, tmp_path / "evaluate.log", args=("--queues", "evaluate"),
                                      host="evaluator").start()  # fmt: skip
            wait_for(lambda: any(OUTAGE in (detail or "") for _, _, detail, _ in
                                 job_history(database_url, run)),
                     what="the evaluation to meet the outage", timeout=120)  # fmt: skip
            wait_for(lambda: job_history(database_url, run)[-1][1] == "running",
                     what="the evaluation to run again", timeout=60)  # fmt: skip
            os.killpg(evaluator.process.pid, signal.SIGKILL)  # the parent and every child
            evaluator.process.wait()
            proxy.restore()
            workers.append(WorkerProcess(env, tmp_path / "evaluate-2.log", host="evaluator-2",
                                         args=("--queues", "evaluate")).start())  # fmt: skip
            assert wait_for_run(database_url, run) == {"succeeded": 1}
        finally:
            for worker in workers:
                worker.stop()
    history = job_history(database_url, run)
    setbacks = [detail for _, status, detail, _ in history if status in ("failed", "dead")]
    assert setbacks and all(OUTAGE in detail for detail in setbacks), history
    assert history[-1][3] <= 2  # the killed attempt at most; the outage spent none
    with psycopg.connect(database_url) as connection:
        rows = connection.execute(
            "SELECT s.metric, s.samples FROM checkpoint_scores s JOIN jobs j ON j.id = s.job_id "
            "WHERE j.run_id = %s", (run,),
        ).fetchall()  # fmt: skip
    assert rows == [("fid", 6)]
    stored = s3_client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/evaluate/reference/")
    assert len(stored["Contents"]) == 1  # the real images' features, computed once
