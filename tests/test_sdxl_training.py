"""SDXL training: encode stores both text encoders' hidden states and the pooled embedding as
SDXL's pipeline makes them, with each image's original size and crop; training adds the
pooled embedding and the time ids (original size, crop, target size) to the U-Net's
conditioning as diffusers' SDXL training script does; and the trained model, whole or a
LoRA, renders through the workers. A tiny SDXL built in code (tests/test_sdxl_lora.py)."""

import copy
import io
import json
from dataclasses import replace

import numpy as np
import psycopg
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, StableDiffusionXLPipeline
from PIL import Image
from safetensors.torch import load_file

from sdq.models.encode.specs import EncodeSpec
from sdq.models.train.architectures import (
    UNET_ARCHITECTURES,
    InvalidArchitecture,
    check_fits,
    pooled_width,
)
from sdq.models.train.specs import LORA_FILE
from sdq.workers.encode.batches import Batch, Target, _decoder, square, token_ids_of
from sdq.workers.encode.encoders import Encoders, encode_batch, join
from sdq.workers.shards.latents import Encoded, latent_shard_bytes, read_training_tensors
from sdq.workers.train.loop.build import new_state
from sdq.workers.train.loop.step import step_inputs, train_step
from tests.conftest import BUCKET, WorkerProcess, run_sdq, sdq_json
from tests.hostile_server import HostileServer
from tests.services import wait_for
from tests.test_sdxl_lora import POOLED, build_sdxl
from tests.test_trainer import BATCH, batch, draws_of, spec

pytestmark = pytest.mark.timeout(600)
# The services' database is shared by the whole session: names of this file's own.
DATASET = "sdxl-shapes"
# Images of these sizes (width x height), cycled: each is cropped differently to 64 x 64.
SIZES = [(96, 64), (64, 80), (120, 120), (200, 100)]
SDXL_WIDTH = 2 * 32  # both tiny text encoders' hidden states side by side


def test_an_sdxl_step_is_the_sdxl_training_script_s_and_dropout_drops_the_pooled_too() -> None:
    """One step's loss is the one diffusers' train_text_to_image_sdxl.py computes from the
    same draws: the U-Net given the pooled embeddings and time ids as added conditions, a
    dropped caption's hidden states and pooled embedding both the empty prompt's."""
    shard = spec(ema=None, caption_dropout=0.5)
    unet = build_sdxl().unet
    plain_unet = copy.deepcopy(unet)
    state = new_state(shard, unet)
    generator = torch.Generator().manual_seed(4)
    state.empty_prompt = torch.randn((7, SDXL_WIDTH), generator=generator)
    state.empty_pooled = torch.randn((POOLED,), generator=generator)
    latents, _ = batch(3)
    embeddings = torch.randn((BATCH, 7, SDXL_WIDTH), generator=generator)
    pooled = torch.randn((BATCH, POOLED), generator=generator)
    time_ids = torch.tensor([[64, 96, 0, 16, 64, 64], [80, 64, 8, 0, 64, 64]], dtype=torch.float32)
    draws = draws_of(state, shard, latents.shape[1:])
    assert draws.dropped.tolist() == [False, True]  # both cases are exercised

    # The script's step, its draws sdq's.
    dropped = draws.dropped
    prompt_embeds = torch.where(dropped[:, None, None], state.empty_prompt, embeddings)
    pooled_embeds = torch.where(dropped[:, None], state.empty_pooled, pooled)
    scheduler = DDPMScheduler.from_config(shard.scheduler_config)
    noisy = scheduler.add_noise(latents, draws.noise, draws.timesteps)
    added = {"time_ids": time_ids, "text_embeds": pooled_embeds}
    prediction = plain_unet(noisy, draws.timesteps, prompt_embeds, added_cond_kwargs=added).sample
    expected = F.mse_loss(prediction.float(), draws.noise.float()).item()

    inputs = step_inputs(state, shard, latents, embeddings, {"text_embeds": pooled,
                                                             "time_ids": time_ids})  # fmt: skip
    assert train_step(state, shard, inputs).item() == pytest.approx(expected, rel=1e-5)
    # The added conditions trained their embedding: it is not the base's any more.
    trained = state.unet.add_embedding.linear_1.weight
    assert not torch.equal(trained, plain_unet.add_embedding.linear_1.weight)


def test_a_shard_s_time_ids_are_its_samples_sizes_crops_and_bucket() -> None:
    """Read for training, an SDXL model's shard gives the U-Net's added conditions by the
    names diffusers gives them; a Stable Diffusion model's gives none."""
    samples = 2
    tensors = {
        "seeds": [1, 2],
        "latents": np.zeros((samples, 4, 8, 16), np.float16),
        "text_embeddings": np.ones((samples, 7, SDXL_WIDTH), np.float16),
        "token_ids": np.zeros((samples, 7), np.int32),
    }
    conditions = np.array([[300, 100, 0, 22], [150, 90, 4, 0]], np.int32)
    pooled = np.arange(samples * POOLED, dtype=np.float16).reshape(samples, POOLED)
    lineage = {"key": ["a", "b"]}
    bucket = {"resolution": 64, "bucket": {"width": 128, "height": 64}}
    sdxl = read_training_tensors(latent_shard_bytes(
        lineage, Encoded(**tensors, conditions=conditions, pooled_embeddings=pooled), bucket
    ))  # fmt: skip
    assert list(sdxl) == ["latents", "text_embeddings", "text_embeds", "time_ids"]
    np.testing.assert_array_equal(sdxl["text_embeds"], pooled)
    # (original height, original width, crop top, crop left, target height, target width)
    assert sdxl["time_ids"].tolist() == [[100, 300, 0, 22, 64, 128], [90, 150, 4, 0, 64, 128]]
    assert sdxl["time_ids"].dtype == np.float32
    plain = read_training_tensors(latent_shard_bytes(lineage, Encoded(**tensors), bucket))
    assert list(plain) == ["latents", "text_embeddings"]


def test_an_architecture_takes_pooled_embeddings_exactly_where_the_dataset_has_them() -> None:
    sdxl = UNET_ARCHITECTURES["sdxl"]
    assert pooled_width(sdxl) == 1280 and pooled_width(UNET_ARCHITECTURES["sd15"]) is None
    check_fits(sdxl, latent_channels=4, text_width=2048, pooled=1280)
    with pytest.raises(InvalidArchitecture, match="needs pooled text embeddings, which the"):
        check_fits(sdxl, latent_channels=4, text_width=2048, pooled=None)
    with pytest.raises(InvalidArchitecture, match="has no text_time conditioning"):
        check_fits({**sdxl, "addition_embed_type": None}, latent_channels=4, text_width=2048,
                   pooled=1280)  # fmt: skip
    with pytest.raises(InvalidArchitecture, match="takes 1280-wide pooled text embeddings; the"):
        check_fits(sdxl, latent_channels=4, text_width=2048, pooled=16)
    with pytest.raises(InvalidArchitecture, match="needs addition_time_embed_dim"):
        pooled_width({**sdxl, "addition_time_embed_dim": None})


def _encoders(pipeline: StableDiffusionXLPipeline) -> Encoders:
    parts = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    named = {part: getattr(pipeline, part) for part in parts}
    return Encoders(**named, device=torch.device("cpu"), dtype=torch.float32)


def test_an_sdxl_shard_of_no_image_still_reads_as_one() -> None:
    """A target no image of a shard was kept for (all too small) makes a shard of none,
    whose columns training and evaluation read as an SDXL shard's."""
    encoders = _encoders(build_sdxl())
    empty = Target(torch.empty(0, 64, 64, 3, dtype=torch.uint8), [], left_out=3, conditions=None)
    key = square(64)
    batch = Batch(rows=[0, 1, 2], targets={key: empty}, seeds=[1, 2, 3], token_ids=[
        token_ids_of(["a", "b", "c"], tokenizer) for tokenizer in encoders.tokenizers
    ])  # fmt: skip
    joined = join(encoders, [encode_batch(encoders, batch)[key]], key[1])
    tensors = read_training_tensors(latent_shard_bytes({"key": []}, joined, {"resolution": 64}))
    shapes = {name: array.shape for name, array in tensors.items()}
    assert shapes == {"latents": (0, 4, 8, 8), "text_embeddings": (0, 77, SDXL_WIDTH),
                      "text_embeds": (0, POOLED), "time_ids": (0, 6)}  # fmt: skip


def test_a_padded_square_keeps_its_original_size_and_no_crop() -> None:
    """Downloaded with `--resize-mode border`, an image was padded to its square, not
    cropped: its time ids say so."""
    image = io.BytesIO()
    Image.new("RGB", (64, 64)).save(image, "PNG")
    spec = EncodeSpec(dataset="d", shard=0, shard_sha256="", image_format="png",
                      model_name="m", model_source="m", model_revision="r", resolution=64,
                      dtype="float32")  # fmt: skip
    for padded, crop in ((True, (0, 0)), (None, (0, 16))):
        decode = _decoder([replace(spec, padded=padded)], conditioned=True)
        [decoded] = decode(image.getvalue(), (96, 64)).values()
        assert decoded.conditions == (96, 64, *crop)


def _crop(width: int, height: int, side: int = 64) -> tuple[int, int]:
    """The crop's top and left, as diffusers' SDXL training script computes them: the image
    resized so that its shorter side is `side`, then center-cropped."""
    scale = side / min(width, height)
    resized_width, resized_height = round(width * scale), round(height * scale)
    return round((resized_height - side) / 2), round((resized_width - side) / 2)


def _latent_shards(database_url: str, model_revision: str) -> list[tuple[str, dict]]:
    with psycopg.connect(database_url) as db:
        return db.execute(
            "SELECT l.uri, l.tensors FROM latent_shards l JOIN datasets d ON d.id = l.dataset_id"
            " WHERE d.name = %s AND l.model_revision = %s ORDER BY l.uri",
            (DATASET, model_revision),
        ).fetchall()


def _s3_bytes(s3_client, uri: str) -> bytes:
    key = uri.removeprefix(f"s3://{BUCKET}/")
    return s3_client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _image(s3_client, database_url: str, job_id: int) -> np.ndarray:
    with psycopg.connect(database_url) as db:
        [uri] = db.execute("SELECT output_uri FROM jobs WHERE id = %s", (job_id,)).fetchone()
    return np.asarray(Image.open(io.BytesIO(_s3_bytes(s3_client, uri))), dtype=np.int16)


def test_an_sdxl_model_encodes_trains_and_renders_through_the_workers(
    download_env: dict[str, str],
    cpu_worker: WorkerProcess,
    worker: WorkerProcess,
    s3_client,
    tmp_path,
) -> None:
    """From download to render on the services: the latents' texts are what the SDXL
    pipeline's encode_prompt makes and their time ids what the SDXL script makes; a run
    (caption dropout, held-out loss) makes an SDXL pipeline that `sdq submit` and `sdq run`
    render, an image of which leads back to the URLs; a LoRA trained on the SDXL base is a
    file diffusers' SDXL pipeline loads, and renders over the base."""
    env, database_url = download_env, download_env["SDQ_DATABASE_URL"]
    folder = tmp_path / "tiny-sdxl"
    pipeline = build_sdxl()
    pipeline.save_pretrained(folder)
    with HostileServer() as server:
        listing = tmp_path / "sdxl.csv"
        sized = [SIZES[n % len(SIZES)] for n in range(12)]
        listing.write_text("url,caption\n" + "".join(
            f"{server.base}/sized/{w}x{h}/{n}.jpg,shape number {n}\n"
            for n, (w, h) in enumerate(sized)
        ))  # fmt: skip
        sdq_json(env, "download", str(listing), "--dataset", DATASET, "--resolution", "64",
                 "--rows-per-shard", "8", "--wait", cwd=tmp_path)  # fmt: skip
    encoded = sdq_json(env, "encode", DATASET, "--model", str(folder), "--resolution", "64",
                       "--wait", cwd=tmp_path)  # fmt: skip
    [latents] = encoded["latents"]

    # 1. Each shard's texts as the pipeline encodes them; its time ids as the script makes.
    shards = _latent_shards(database_url, latents["revision"])
    assert len(shards) == 2
    for uri, described in shards:
        assert described["pooled_embeddings"]["shape"] == [POOLED]
        data = _s3_bytes(s3_client, uri)
        table = pq.read_table(io.BytesIO(data), columns=["url", "caption"]).to_pydict()
        tensors = read_training_tensors(data)
        prompt_embeds, _, pooled, _ = pipeline.encode_prompt(
            table["caption"], do_classifier_free_guidance=False
        )
        np.testing.assert_array_equal(tensors["text_embeddings"], prompt_embeds.detach().numpy())
        np.testing.assert_array_equal(tensors["text_embeds"], pooled.detach().numpy())
        sizes = [tuple(map(int, url.split("/")[-2].split("x"))) for url in table["url"]]
        assert tensors["time_ids"].tolist() == [
            [height, width, *_crop(width, height), 64, 64] for width, height in sizes
        ]

    # 2. A whole U-Net trained on them, scored on its held-out samples, rendered.
    train = ["train", DATASET, "--base", str(folder), "--resolution", "64", "--batch-size", "4"]
    training = sdq_json(env, *train, "--steps", "6", "--checkpoint-every", "3",
                        "--caption-dropout", "0.25", "--holdout", "0.5",
                        "--eval-metrics", "heldout_loss", "--into", "sdxl-shapes-model",
                        cwd=tmp_path)  # fmt: skip
    # What it trains on, said at submit: the samples less those held out.
    assert training["samples"] + training["held_out"] == 12 and training["held_out"] > 0
    run = str(training["run_id"])
    wait_for(lambda: sdq_json(env, "train", "status", run)["status"] not in ("queued", "running"),
             what="the run to end", timeout=300)  # fmt: skip
    trained = sdq_json(env, "train", "status", run)
    assert (trained["status"], trained["step"]) == ("succeeded", 6)
    assert all(np.isfinite(loss) for _, loss in trained["losses"])
    wait_for(lambda: len(sdq_json(env, "train", "status", run)["scores"].get("heldout_loss", []))
             == 2, what="both checkpoints' held-out loss", timeout=240)  # fmt: skip
    model = trained["checkpoints"][-1]["uri"]
    index = json.loads(_s3_bytes(s3_client, f"{model}/model/model_index.json"))
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    prompts = tmp_path / "prompts.csv"
    prompts.write_text("prompt,seed\na shape,1\n")
    render = ["--steps", "2", "--dtype", "float32", "--size", "64x64"]
    submitted = sdq_json(env, "submit", str(prompts), "--model", "sdxl-shapes-model", *render,
                         "--wait", cwd=tmp_path)  # fmt: skip
    assert submitted["counts"] == {"succeeded": 1}
    job = submitted["jobs"][0]["id"]
    here = sdq_json(env, "run", str(prompts), "--model", "sdxl-shapes-model@3", *render,
                    cwd=tmp_path)  # fmt: skip
    assert here["counts"] == {"succeeded": 1}
    with psycopg.connect(database_url) as db:
        revision = db.execute("SELECT spec->>'model_revision' FROM jobs WHERE id = %s",
                              (job,)).fetchone()[0]  # fmt: skip
        sources = db.execute("SELECT url FROM image_sources WHERE job_id = %s",
                             (job,)).fetchall()  # fmt: skip
        # What the run learned from: its dataset less the samples it held out, each once.
        held = pq.read_table(
            io.BytesIO(_s3_bytes(s3_client, f"{env['SDQ_STORE_URL']}/train/{run}/held_out.parquet"))
        )
        held_out = db.execute("SELECT s.url FROM samples s JOIN datasets d ON d.id = s.dataset_id "
                              "WHERE d.name = %s AND s.key = ANY(%s)",
                              (DATASET, held["key"].to_pylist())).fetchall()  # fmt: skip
    assert revision == trained["checkpoints"][-1]["model_revision"]
    assert len(held_out) == training["held_out"]
    assert sorted(url.split("/")[-1] for (url,) in sources + held_out) == sorted(
        f"{n}.jpg" for n in range(12)
    )

    # 3. A LoRA on the SDXL base: a file diffusers' SDXL pipeline loads; it renders over it.
    lora = sdq_json(env, *train, "--steps", "4", "--checkpoint-every", "4", "--lr", "1e-2",
                    "--lora-rank", "4", "--into", "sdxl-shapes-lora", "--wait",
                    cwd=tmp_path)  # fmt: skip
    assert lora["status"] == "succeeded" and lora["lora_rank"] == 4
    key = f"{lora['checkpoints'][-1]['uri']}/model/{LORA_FILE}"
    (tmp_path / LORA_FILE).write_bytes(_s3_bytes(s3_client, key))
    loaded = StableDiffusionXLPipeline.from_pretrained(folder)
    loaded.load_lora_weights(tmp_path, weight_name=LORA_FILE)
    adapters = load_file(tmp_path / LORA_FILE)
    assert adapters and all(name.startswith("unet.") for name in adapters)
    jobs = {
        name: sdq_json(env, "submit", str(prompts), "--model", str(folder), *render, *extra,
                       "--wait", cwd=tmp_path)["jobs"][0]["id"]
        for name, extra in [("base", []), ("adapted", ["--lora", "sdxl-shapes-lora"])]
    }  # fmt: skip
    base, adapted = (_image(s3_client, database_url, job) for job in jobs.values())
    assert np.abs(adapted - base).max() > 0

    # 4. An architecture that cannot take the dataset is refused before anything is queued.
    scratch = [*train, "--steps", "2", "--from-scratch", "--unet-config", "sd15"]
    refused = run_sdq(env, *scratch, cwd=tmp_path)
    assert refused.returncode == 2
    assert "768-wide text embeddings; the dataset's latents" in " ".join(refused.stderr.split())
