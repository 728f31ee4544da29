"""Rendering in this process with the real task code: reproducibility, model sources, errors."""

import hashlib
import io
import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

from sdq.models import tiny
from sdq.models.db import make_engine, session_factory
from sdq.models.generate.specs import SAMPLERS, GenerationSpec
from sdq.models.jobs.claims import claim
from sdq.models.jobs.delivery import Outcome, deliver, keep_leases
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.lifecycle import Worker, as_utc, utcnow
from sdq.models.registry import resolve_model, tiny_identity
from sdq.models.settings import JobSettings
from sdq.models.store import LocalStore, S3Store
from sdq.models.tables import Job, JobEvent, JobStatus, Run
from sdq.producer.generate.plan import Defaults, plan_jobs
from sdq.producer.generate.submit import Batching, record_run
from sdq.producer.prompts import PromptRow
from sdq.workers.generate.pipelines import PipelineCache, render
from sdq.workers.generate.work import GenerateWork
from sdq.workers.holding import hold
from sdq.workers.tiny import build_pipeline
from sdq.workers.weights import ModelFiles
from tests.conftest import BUCKET, write
from tests.services import aws_env, free_port

# Its tests share a module-wide fixture: in one test process when run in parallel.
pytestmark = pytest.mark.xdist_group("test_rendering")

# Pinned: the tiny model must be the same on every machine, in every CI run.
TINY_CONTENT_HASH = "7cdee06cebe26e85a74cb5daead99b943047167755715c7ce556ffaed195aca6"


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> PipelineCache:
    root = tmp_path_factory.mktemp("pipelines")
    return PipelineCache(files=ModelFiles(LocalStore(root / "store"), root / "cache"), size=2)


def specs(*prompts: str, seed: int = 1, steps: int = 5):
    rows = [PromptRow(line=index + 2, prompt=prompt) for index, prompt in enumerate(prompts)]
    planned = plan_jobs(rows, model=tiny_identity(), defaults=Defaults(seed=seed, steps=steps))
    return [job.spec for job in planned]


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def test_tiny_is_the_same_model_everywhere(pipelines: PipelineCache) -> None:
    assert tiny.content_hash() == TINY_CONTENT_HASH
    weights = hashlib.sha256()
    loaded, _ = pipelines.get(specs("x")[0])
    for module in (loaded.pipeline.unet, loaded.pipeline.vae, loaded.pipeline.text_encoder):
        for _, tensor in sorted(module.state_dict().items()):
            weights.update(tensor.cpu().numpy().tobytes())
    assert weights.hexdigest() == "dd91be1dab2d2a8474718c4c0ea44ccaf403b2575b6a2309473928aaf8e58c64"


def test_same_spec_same_pixels_whatever_the_batch(pipelines: PipelineCache) -> None:
    alone = specs("a lighthouse")
    batch = specs("a cat", "a lighthouse", "a boat")
    pipeline, _ = pipelines.get(alone[0])
    first = pixels(render(pipeline, alone)[0])
    again = pixels(render(pipeline, alone)[0])
    in_batch = pixels(render(pipeline, batch)[1])
    assert np.array_equal(first, again)
    # Each image starts from its own seeded noise, so batch-mates cannot change it; what
    # remains is floating-point rounding of batched kernels: at most one level, rarely.
    difference = np.abs(first.astype(int) - in_batch.astype(int))
    assert difference.max() <= 1 and (difference > 0).mean() < 0.001
    other_seed = pixels(render(pipeline, [replace(alone[0], seed=2)])[0])
    assert not np.array_equal(first, other_seed)
    assert first.std() > 10, "the image is noise with structure, not a flat colour"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-saved"
    build_pipeline().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checked_folder(tmp_path_factory) -> Path:
    """The tiny pipeline saved with a tiny safety checker that flags every image, as a real
    SD 1.5 folder ships one (safety_checker/, feature_extractor/)."""
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    small = {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4,
             "num_hidden_layers": 1}  # fmt: skip
    config = CLIPConfig(
        text_config={**small, "vocab_size": 99},
        vision_config={**small, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    checker = StableDiffusionSafetyChecker(config)
    checker.concept_embeds_weights.data.fill_(-2.0)  # below any cosine: every image flagged
    features = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    pipeline = build_pipeline()
    pipeline.register_modules(safety_checker=checker, feature_extractor=features)
    pipeline.register_to_config(requires_safety_checker=True)
    folder = tmp_path_factory.mktemp("models") / "tiny-checked"
    pipeline.save_pretrained(folder)
    return folder


def run_json(sdq, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    result = sdq("run", *args, "--json", env=env)
    return result.exit_code, json.loads(result.stdout)


def images_by_seed(status: dict, s3_client) -> dict[int, np.ndarray]:
    images = {}
    for job in status["jobs"]:
        bucket, _, key = job["uri"].removeprefix("s3://").partition("/")
        body = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
        images[job["seed"]] = pixels(Image.open(io.BytesIO(body)))
    return images


def test_every_model_source_loads_the_same_weights(sdq, tiny_folder, s3_client, tmp_path) -> None:
    def run(seed: int, model: str) -> dict:
        prompts = write(tmp_path / f"{seed}.csv", f"prompt,seed\nsources: a red castle,{seed}\n")
        code, status = run_json(
            sdq, str(prompts), "--steps", "4", "--model", model, "--dtype", "float32"
        )
        assert code == 0 and status["counts"] == {"succeeded": 1}, status
        return status

    pushed = sdq("model", "push", str(tiny_folder), "pushed-tiny")
    assert pushed.exit_code == 0 and " pushed to s3://" in pushed.output, pushed.output
    again = sdq("model", "push", str(tiny_folder), "pushed-tiny")
    assert again.exit_code == 0 and "already in the store" in again.output, again.output
    for path in tiny_folder.rglob("*"):
        if path.is_file():
            key = f"uploaded/tiny/{path.relative_to(tiny_folder).as_posix()}"
            s3_client.upload_file(str(path), BUCKET, key)
    sources = {77: str(tiny_folder), 78: "pushed-tiny", 79: f"s3://{BUCKET}/uploaded/tiny"}
    for seed, model in sources.items():
        status = run(seed, model)
        assert status["cached"] == 0
        rendered = images_by_seed(status, s3_client)[seed]
        reference = images_by_seed(run(seed, "tiny"), s3_client)[seed]
        assert np.array_equal(rendered, reference), f"{model} renders other pixels than tiny"

    # A run done here on a machine without a GPU renders a half-precision model in float32.
    prompts = write(tmp_path / "cpu.csv", "prompt,seed\nsources: on the cpu,5\n")
    code, status = run_json(sdq, str(prompts), "--steps", "2", "--model", str(tiny_folder))
    assert code == 0, status
    shown = json.loads(sdq("show", str(status["jobs"][0]["id"]), "--json").stdout)
    assert shown["spec"]["dtype"] == "float32"

    models = json.loads(sdq("model", "list", "--json").stdout)
    by_name = {model["name"]: model for model in models}
    assert {"tiny", "tiny-saved", "pushed-tiny"} <= set(by_name)
    # A pushed copy keeps the folder's content hash: one model under two names.
    assert by_name["pushed-tiny"]["revision"] == by_name["tiny-saved"]["revision"]
    assert by_name["pushed-tiny"]["store_prefix"].startswith("models/pushed-tiny/")


def test_safety_checking_is_a_choice_and_a_flagged_image_is_recorded_never_stored(
    sdq, checked_folder, s3_client, tmp_path
) -> None:
    rows = "prompt,seed\nsafety: a lighthouse,1\nsafety: a harbour,2\n"
    prompts = write(tmp_path / "p.csv", rows)
    model = ["--steps", "2", "--model", str(checked_folder)]
    # Off by default, though the model ships a checker: the images as rendered, not black.
    code, plain = run_json(sdq, str(prompts), *model)
    assert code == 0 and plain["counts"] == {"succeeded": 2}, plain
    assert all(image.max() > 0 for image in images_by_seed(plain, s3_client).values())

    for _ in range(2):  # the second time, nothing is served from the first: nothing was kept
        code, checked = run_json(sdq, str(prompts), *model, "--safety-check")
        assert code == 0 and checked["counts"] == {"succeeded": 2} and checked["cached"] == 0
        assert [job["uri"] for job in checked["jobs"]] == [None, None]
    run_id = checked["run_id"]
    [summary] = json.loads(
        sdq("sql", f"SELECT flagged FROM run_summary WHERE run_id = {run_id}", "--json").stdout
    )
    assert summary == {"flagged": 2}
    history = sdq("sql", f"SELECT job_id, flagged FROM job_history WHERE run_id = {run_id}",
                  "--json")  # fmt: skip
    assert [row["flagged"] for row in json.loads(history.stdout)] == [True, True]
    spec_hashes = {
        json.loads(sdq("show", str(job["id"]), "--json").stdout)["spec_hash"]
        for job in plain["jobs"] + checked["jobs"]
    }
    assert len(spec_hashes) == 4  # the choice is in the spec's hash
    flagged = sdq("get", str(checked["jobs"][0]["id"]), "-o", str(tmp_path / "x.png"))
    assert flagged.exit_code == 2 and "the safety checker flagged it" in flagged.output
    bucket, _, key = checked["gallery"].removeprefix("s3://").partition("/")
    page = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    assert page.count("flagged by the safety checker") == 2 and "<img" not in page


def planned(prompt: str, model=None):
    model = model or tiny_identity()
    return list(
        plan_jobs(
            [PromptRow(line=2, prompt=prompt)], model=model, defaults=Defaults(seed=1, steps=2)
        )
    )


def recorded(sessions, jobs, model=None) -> list[int]:
    """Writes a run as `sdq submit` does, and returns its job ids."""
    submission = record_run(
        sessions,
        jobs,
        model=model or tiny_identity(),
        source="test",
        options={},
        batching=Batching(8, 1),
    )
    with sessions() as session:
        return list(
            session.scalars(select(Job.id).where(Job.run_id == submission.run_id).order_by(Job.id))
        )


@dataclass
class Direct:
    """What the generate task hands the delivery skeleton, built by hand."""

    sessions: sessionmaker
    store: object
    pipelines: PipelineCache
    settings: JobSettings
    worker: Worker = field(default_factory=lambda: Worker("test-host:1", "cpu"))

    def deliver(self, job_ids: list[int]) -> Outcome:
        work = GenerateWork(
            store=self.store, sessions=self.sessions, pipelines=self.pipelines, batch_size=8
        )
        return deliver(
            job_ids,
            work,
            kind=GENERATE.name,
            sessions=self.sessions,
            worker=self.worker,
            settings=self.settings,
        )


def direct_work(database_url: str, store, pipelines, **settings) -> Direct:
    sessions = session_factory(make_engine(database_url))
    return Direct(sessions, store, pipelines, JobSettings(**settings))


@pytest.mark.parametrize("outage", ["unreachable", "bucket gone"])
def test_an_outage_does_not_use_up_attempts_within_its_budget(
    migrated_postgres, pipelines, monkeypatch, s3, outage: str
) -> None:
    """The store unreachable, or back without its bucket (an object store that came back
    empty): not the jobs' fault either way."""
    endpoint = f"http://127.0.0.1:{free_port()}" if outage == "unreachable" else None
    for key, value in (aws_env(endpoint) if endpoint else s3).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    store = S3Store(BUCKET if endpoint else "a-bucket-that-is-gone")
    work = direct_work(migrated_postgres, store, pipelines, max_attempts=2)
    job_ids = recorded(work.sessions, planned(f"store {outage} for a while"))
    for _ in range(4):  # twice the attempts, each failing on the store
        assert work.deliver(job_ids).retry == job_ids
    with work.sessions() as session:
        job = session.get(Job, job_ids[0])
        assert (job.status, job.attempts) == (JobStatus.failed, 0)
        details = session.scalars(
            select(JobEvent.detail).where(
                JobEvent.job_id == job.id, JobEvent.status == JobStatus.failed
            )
        ).all()
    assert len(details) == 4 and all("the attempt is not counted" in d for d in details)


def test_unreachable_store_past_the_outage_budget_gives_up(
    migrated_postgres, pipelines, monkeypatch
) -> None:
    for key, value in aws_env(f"http://127.0.0.1:{free_port()}").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    work = direct_work(
        migrated_postgres, S3Store(BUCKET), pipelines, max_attempts=2, outage_budget_seconds=0
    )
    sessions = work.sessions
    job_ids = recorded(sessions, planned("store is down"))
    first = work.deliver(job_ids)
    assert first.retry == job_ids and "cannot reach" in first.error
    with sessions() as session:
        job = session.get(Job, job_ids[0])
        assert (job.status, job.attempts) == (JobStatus.failed, 1)
    second = work.deliver(job_ids)
    assert second.retry == []
    with sessions() as session:
        job = session.get(Job, job_ids[0])
        assert (job.status, job.attempts) == (JobStatus.dead, 2) and "cannot reach" in job.error


def test_permanent_errors_fail_the_job_at_once(
    migrated_postgres, pipelines, tiny_folder, tmp_path
) -> None:
    work = direct_work(migrated_postgres, LocalStore(tmp_path / "store"), pipelines)
    sessions = work.sessions
    # A model folder that was there at submit time and is gone on the worker.
    folder = tmp_path / "vanishing"
    shutil.copytree(tiny_folder, folder)
    with sessions() as session:
        identity = resolve_model(str(folder), store=work.store, session=session)
    gone = recorded(sessions, planned("gone", identity), identity)
    shutil.rmtree(folder)
    # One that is there but no longer a diffusers pipeline.
    broken_folder = tmp_path / "broken"
    shutil.copytree(tiny_folder, broken_folder)
    with sessions() as session:
        broken_identity = resolve_model(str(broken_folder), store=work.store, session=session)
    broken = recorded(sessions, planned("broken", broken_identity), broken_identity)
    (broken_folder / "model_index.json").unlink()
    # One whose U-Net weights were cut short (a copy that stopped half-way).
    damaged_folder = tmp_path / "damaged"
    shutil.copytree(tiny_folder, damaged_folder)
    with sessions() as session:
        damaged_identity = resolve_model(str(damaged_folder), store=work.store, session=session)
    damaged = recorded(sessions, planned("damaged", damaged_identity), damaged_identity)
    weights = damaged_folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    # A size the pipeline cannot make (the CLI refuses it; a hand-written job may not).
    odd = [replace(job, spec=replace(job.spec, width=100)) for job in planned("odd size")]
    for job_ids, message in [
        (gone, "does not exist"),
        (broken, "is not a diffusers pipeline: no model_index.json"),
        (damaged, f"Unable to load weights from checkpoint file for '{weights}'"),
        (recorded(sessions, odd), "divisible by 8"),
    ]:
        outcome = work.deliver(job_ids)
        assert outcome.retry == [] and message in outcome.error
        with sessions() as session:
            job = session.get(Job, job_ids[0])
            assert (job.status, job.attempts) == (JobStatus.dead, 1) and message in job.error


def test_a_job_that_outlives_its_attempts_ends_dead(migrated_postgres, pipelines, tmp_path) -> None:
    work = direct_work(migrated_postgres, LocalStore(tmp_path / "store"), pipelines, max_attempts=2)
    sessions = work.sessions
    job_ids = recorded(sessions, planned("kills every worker"))
    # Two workers took it and died holding it: their leases ran out.
    for attempt in range(2):
        with sessions.begin() as session:
            lost = Worker(f"dead-host:{attempt}", "cpu")
            assert claim(
                session, job_ids, kind=GENERATE.name, worker=lost, lease_seconds=0, max_attempts=2
            )
    outcome = work.deliver(job_ids)
    assert outcome.done == [] and outcome.held == []
    with sessions() as session:
        job = session.get(Job, job_ids[0])
        assert (job.status, job.attempts) == (
            JobStatus.dead,
            2,
        ) and "attempts exhausted" in job.error
        assert session.get(Run, job.run_id).finished_at is not None


def test_runs_are_stamped_finished_when_their_last_job_ends(
    migrated_postgres, pipelines, tmp_path
) -> None:
    work = direct_work(migrated_postgres, LocalStore(tmp_path / "store"), pipelines)
    sessions = work.sessions
    job_ids = recorded(sessions, planned("finish me") + planned("and me"))
    with sessions() as session:
        run_id = session.get(Job, job_ids[0]).run_id
        assert session.get(Run, run_id).finished_at is None
    work.deliver(job_ids[:1])
    with sessions() as session:
        assert session.get(Run, run_id).finished_at is None
    work.deliver(job_ids[1:])
    with sessions() as session:
        assert session.get(Run, run_id).finished_at is not None


def test_a_failed_upload_is_retried_to_exactly_one_image(
    migrated_postgres, pipelines, s3, s3_client, monkeypatch
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for key, value in aws_env(f"http://127.0.0.1:{free_port()}").items():
        monkeypatch.setenv(key, value)
    down = direct_work(migrated_postgres, S3Store(BUCKET, "retried"), pipelines)
    job_ids = recorded(down.sessions, planned("retried after the store came back"))
    assert down.deliver(job_ids).retry == job_ids
    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    back = replace(down, store=S3Store(BUCKET, "retried"))
    assert back.deliver(job_ids).done == job_ids
    with down.sessions() as session:
        job = session.get(Job, job_ids[0])
    assert (job.status, job.attempts) == (JobStatus.succeeded, 1)  # the outage is not counted
    listing = s3_client.list_objects_v2(Bucket=BUCKET, Prefix="retried/")["Contents"]
    assert [item["Key"] for item in listing] == [f"retried/images/{job.spec_hash}.png"]
    body = s3_client.get_object(Bucket=BUCKET, Key=listing[0]["Key"])["Body"].read()
    assert hashlib.sha256(body).hexdigest() == job.output_sha256


def test_leases_are_renewed_while_the_work_runs(migrated_postgres, pipelines, tmp_path) -> None:
    work = direct_work(
        migrated_postgres, LocalStore(tmp_path / "store"), pipelines, lease_seconds=1
    )
    sessions, worker = work.sessions, work.worker
    job_ids = recorded(sessions, planned("a long render"))
    with sessions.begin() as session:
        claim(session, job_ids, kind=GENERATE.name, worker=worker, lease_seconds=1, max_attempts=3)
    with keep_leases(sessions, job_ids, worker=worker, settings=work.settings):
        time.sleep(2.5)  # more than twice the lease: only renewals keep it alive
        with sessions() as session:
            lease = as_utc(session.get(Job, job_ids[0]).lease_expires_at)
        assert lease > utcnow()
    with sessions.begin() as session:
        assert not claim(
            session,
            job_ids,
            kind=GENERATE.name,
            worker=Worker("other:1", "cpu"),
            lease_seconds=1,
            max_attempts=3,
        )


def test_a_spec_rendered_after_submit_is_served_at_the_worker(
    migrated_postgres, pipelines, tmp_path
) -> None:
    work = direct_work(migrated_postgres, LocalStore(tmp_path / "store"), pipelines)
    sessions = work.sessions
    # Two runs ask for the same image before either is rendered.
    first = recorded(sessions, planned("asked for twice at once"))
    second = recorded(sessions, planned("asked for twice at once"))
    assert work.deliver(first).done == first
    outcome = work.deliver(second)
    assert outcome.reused == second and outcome.done == []
    with sessions() as session:
        original, served = session.get(Job, first[0]), session.get(Job, second[0])
        assert served.cached and served.status == JobStatus.succeeded
        assert (served.output_uri, served.output_sha256) == (
            original.output_uri,
            original.output_sha256,
        )


def test_a_worker_loads_each_pipeline_once_and_keeps_the_last_few(tmp_path) -> None:
    cache = PipelineCache(
        files=ModelFiles(LocalStore(tmp_path / "store"), tmp_path / "cache"), size=1
    )
    spec = specs("x")[0]
    first, loading = cache.get(spec)
    assert loading is not None and loading > 0
    # Same model: no reload, and no load time. "auto" on the CPU is float32: the same too.
    assert spec.dtype == "float32"
    assert cache.get(replace(spec, prompt="y", seed=9)) == (first, None)
    assert cache.get(replace(spec, dtype="auto")) == (first, None)
    other, _ = cache.get(replace(spec, dtype="bfloat16"))
    assert other is not first and str(other.pipeline.unet.dtype) == "torch.bfloat16"
    again, loading = cache.get(spec)
    assert again is not first and loading is not None  # evicted by the size-1 cache


def test_every_sampler_renders_and_is_part_of_the_spec(pipelines: PipelineCache) -> None:
    """`--sampler` picks the diffusers scheduler on the model's own noise schedule: each
    renders, is named in the spec (so its hash), and makes its own image."""
    rows = [PromptRow(line=2, prompt="a lighthouse")]
    by_sampler = {}
    for sampler in [None, *SAMPLERS]:
        defaults = Defaults(seed=3, steps=4, sampler=sampler)
        [job] = plan_jobs(rows, model=tiny_identity(), defaults=defaults)
        pipeline, _ = pipelines.get(job.spec)
        by_sampler[sampler] = (job.spec, pixels(render(pipeline, [job.spec])[0]))
    default_spec, _ = by_sampler[None]
    for sampler, (spec, image) in by_sampler.items():
        if sampler is None:
            continue
        assert spec.scheduler == SAMPLERS[sampler][0]
        assert spec.scheduler_config["beta_schedule"] == default_spec.scheduler_config[
            "beta_schedule"]  # fmt: skip
        assert image.std() > 10
    hashes = {spec.hash() for spec, _ in by_sampler.values()}
    assert len(hashes) == len(SAMPLERS)  # tiny's own is Euler: the same spec, the same hash
    assert by_sampler[None][0].hash() == by_sampler["euler"][0].hash()
    # Samplers that step differently draw different pictures from the same noise.
    assert not np.array_equal(by_sampler["euler"][1], by_sampler["euler_a"][1])
    assert not np.array_equal(by_sampler["euler"][1], by_sampler["dpmpp_2m"][1])
    assert np.array_equal(by_sampler[None][1], by_sampler["euler"][1])


def test_a_call_encodes_only_the_prompts_it_has_not_seen(tmp_path) -> None:
    """Subjects crossed with styles repeat prompts and negative prompts: each text goes
    through the text encoder once while its pipeline is loaded, and the images are the
    ones diffusers' pipeline makes from the texts themselves."""
    files = ModelFiles(LocalStore(tmp_path / "store"), tmp_path / "cache")
    kept = PipelineCache(files=files, size=1, prompt_cache_size=3)
    first, second = specs("a cat", "a boat", "a cat"), specs("a boat", "a dog")
    loaded, _ = kept.get(first[0])
    images = render(loaded, first) + render(loaded, second)
    # "a cat", "a boat" and the empty negative prompt; then "a dog" alone.
    assert loaded.prompts.encoded == 4
    render(loaded, specs("a cat"))  # evicted by the size-3 cache: encoded again
    assert loaded.prompts.encoded == 5
    reference = build_pipeline()
    expected = np.concatenate([diffusers_renders(reference, call) for call in (first, second)])
    close(images, expected)


def diffusers_renders(pipeline, specs: list[GenerationSpec], **call) -> np.ndarray:
    """The images as diffusers' pipeline makes them from the texts themselves."""
    pipeline.set_progress_bar_config(disable=True)
    first = specs[0]
    return pipeline(
        prompt=[spec.prompt for spec in specs],
        num_inference_steps=first.steps,
        guidance_scale=first.guidance,
        width=first.width,
        height=first.height,
        generator=[torch.Generator("cpu").manual_seed(spec.seed) for spec in specs],
        output_type="np",
        **call,
    ).images


def close(made: list[Image.Image], direct: np.ndarray) -> None:
    """The same pixels within batching's tolerance: off by a level or two at most, rarely."""
    for image, expected in zip(made, direct, strict=True):
        difference = np.abs(pixels(image).astype(int) - (expected * 255).round().astype(int))
        assert difference.max() <= 2 and (difference > 0).mean() < 0.02, difference.max()


def test_large_images_decode_in_tiles_and_their_spec_says_so(pipelines: PipelineCache) -> None:
    rows = [PromptRow(line=2, prompt="a field")]

    def planned_at(side: int) -> GenerationSpec:
        defaults = Defaults(seed=1, steps=2, width=side, height=side)
        [job] = plan_jobs(rows, model=tiny_identity(), defaults=defaults)
        return job.spec

    large, small = planned_at(1600), planned_at(512)
    assert large.vae_tiling and not small.vae_tiling
    # Only a tiled spec names it: every spec made before tiling keeps its hash.
    assert "vae_tiling" in large.identity() and "vae_tiling" not in small.identity()
    # tiny's VAE tiles at 64 px: at 128 px a tiled decode blends four tiles, and the same
    # latents give other pixels than a whole decode.
    spec = replace(planned_at(128), vae_tiling=False)
    loaded, _ = pipelines.get(spec)
    whole = pixels(render(loaded, [spec])[0])
    tiled = pixels(render(loaded, [replace(spec, vae_tiling=True)])[0])
    assert whole.shape == tiled.shape == (128, 128, 3) and not np.array_equal(whole, tiled)
    assert replace(spec, vae_tiling=True).hash() != spec.hash()


def test_a_compiling_worker_compiles_its_pipeline_once_with_fused_attention(tmp_path) -> None:
    """SDQ_COMPILE: the U-Net and the VAE decoder wrapped by torch.compile (it compiles on
    the first call of each shape: minutes on a CPU, so not called here), channels-last
    where asked, Q, K and V fused."""
    cache = PipelineCache(files=ModelFiles(LocalStore(tmp_path / "store"), tmp_path / "cache"),
                          size=1, compile_mode="default", channels_last=True)  # fmt: skip
    loaded, _ = cache.get(specs("x")[0])
    pipeline = loaded.pipeline
    assert type(pipeline.unet).__name__ == "OptimizedModule"
    assert type(pipeline.vae.decoder).__name__ == "OptimizedModule"
    attention = next(m for m in pipeline.unet.modules() if type(m).__name__ == "Attention")
    assert attention.fused_projections
    conv = next(m for m in pipeline.unet.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert cache.get(specs("y")[0]) == (loaded, None)  # once per process
    # SDQ_CHANNELS_LAST=0, the default: the weights as they were made.
    contiguous = PipelineCache(files=cache.files, size=1, compile_mode="default")
    unet = contiguous.get(specs("x")[0])[0].pipeline.unet
    conv = next(m for m in unet.modules() if isinstance(m, torch.nn.Conv2d))
    assert not conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_a_compiled_pipeline_meets_only_the_shapes_it_warmed(tmp_path) -> None:
    """SDQ_COMPILE with SDQ_WARM_SHAPES: loading compiles every padded batch size at each
    warm shape; renders of any batch size up to the largest, at those shapes, compile
    nothing more (torch._dynamo's counters; the "eager" backend traces and guards as
    inductor does, without its minutes of code generation); and a padded call's images
    are the ones an uncompiled pipeline makes, within batching's tolerance."""
    from torch._dynamo.utils import counters

    files = ModelFiles(LocalStore(tmp_path / "store"), tmp_path / "cache")
    shapes = ((64, 64), (96, 64))
    torch._dynamo.reset()
    counters.clear()
    compiled = PipelineCache(files=files, size=1, compile_mode="default", compile_batches=(1, 2, 4),
                             warm_shapes=shapes, compile_backend="eager")  # fmt: skip
    loaded, _ = compiled.get(specs("warm")[0])
    warmed = counters["stats"]["unique_graphs"]
    assert warmed >= 2 * len(shapes) * 3  # the U-Net and the decoder, each shape and size

    def call(count: int, width: int, height: int) -> list[GenerationSpec]:
        prompts = [f"a lighthouse number {n}" for n in range(count)]
        return [replace(spec, width=width, height=height) for spec in specs(*prompts, steps=2)]

    images = {(n, shape): render(loaded, call(n, *shape)) for n in (1, 2, 3, 4) for shape in shapes}
    assert counters["stats"]["unique_graphs"] == warmed  # not one recompilation
    assert all(len(made) == n for (n, _), made in images.items())  # the padding dropped

    plain, _ = PipelineCache(files=files, size=1).get(specs("warm")[0])
    for made, direct in zip(images[(3, (96, 64))], render(plain, call(3, 96, 64)), strict=True):
        difference = np.abs(pixels(made).astype(int) - pixels(direct).astype(int))
        assert difference.max() <= 2 and (difference > 0).mean() < 0.01


def test_a_task_of_another_kind_lets_the_loaded_pipelines_go(tmp_path) -> None:
    """A GPU process serves generate, encode and train in turn: one kind's models leave
    before another's load, and stay while tasks of their own kind follow."""
    cache = PipelineCache(files=ModelFiles(LocalStore(tmp_path / "store"), tmp_path / "cache"),
                          size=1)  # fmt: skip
    spec = specs("x")[0]
    hold("generate", cache.clear)
    loaded, _ = cache.get(spec)
    hold("generate", cache.clear)
    assert cache.get(spec) == (loaded, None)  # kept for the next generate task
    let_go: list[str] = []
    hold("encode", lambda: let_go.append("encoders"))
    again, loading = cache.get(spec)
    assert again is not loaded and loading is not None  # let go, loaded anew
    hold("generate", cache.clear)
    assert let_go == ["encoders"]


def test_workers_share_each_text_s_embedding_once_per_text_encoder(redis_port, tmp_path) -> None:
    """Two workers' pipelines over one Redis: the second encodes nothing the first did, and
    renders the same pixels; the cache keeps its bound; another text encoder shares
    nothing; a cache that cannot be reached only means encoding here."""
    import redis

    from sdq.workers.generate.shared_prompts import LAST_USED, SharedPrompts, text_encoder_digest
    from sdq.workers.tiny import fill_weights

    url = f"redis://127.0.0.1:{redis_port}/4"
    redis.Redis.from_url(url).flushdb()
    files = ModelFiles(LocalStore(tmp_path / "store"), tmp_path / "cache")

    def worker(shared: SharedPrompts) -> PipelineCache:
        return PipelineCache(files=files, size=1, prompt_cache_size=8, shared_prompts=shared)

    calls = [specs("a cat", "a boat"), specs("a boat", "a dog")]
    rendered = []
    for cache in (worker(SharedPrompts(url, 100)), worker(SharedPrompts(url, 100))):
        loaded, _ = cache.get(calls[0][0])
        images = [pixels(image) for call in calls for image in render(loaded, call)]
        rendered.append((loaded.prompts, images))
    (first, first_images), (second, second_images) = rendered
    assert first.encoded == 4  # "a cat", "a boat", the empty negative prompt, "a dog"
    assert second.encoded == 0
    assert all(np.array_equal(a, b) for a, b in zip(first_images, second_images, strict=True))
    # Each kept row is a copy of its own, not a view holding its call's whole tensor.
    for kept in (first, second):
        for rows in kept._kept.values():
            row = rows["prompt_embeds"]
            assert row.untyped_storage().nbytes() == row.numel() * row.element_size()

    pipeline = build_pipeline()
    tiny_digest = text_encoder_digest(pipeline)
    assert text_encoder_digest(build_pipeline()) == tiny_digest  # the same weights, one key
    fill_weights(pipeline.text_encoder, seed=7)
    assert text_encoder_digest(pipeline) != tiny_digest  # another encoder shares nothing

    bounded = SharedPrompts(url, 2).for_encoder(tiny_digest)
    for text in ("one", "two", "three"):  # the least recently used goes first
        bounded.put({text: {"prompt_embeds": torch.zeros(3)}})
    assert redis.Redis.from_url(url).zcard(LAST_USED) == 2
    assert list(bounded.get(["one", "two", "three"])) == ["two", "three"]

    unreachable = SharedPrompts(f"redis://127.0.0.1:{free_port()}/0", 100)
    loaded, _ = worker(unreachable).get(calls[0][0])
    alone = [pixels(image) for image in render(loaded, calls[0])]
    assert all(np.array_equal(a, b) for a, b in zip(alone, first_images[:2], strict=True))
    assert loaded.prompts.encoded == 3
