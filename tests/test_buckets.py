"""Aspect-ratio buckets: the shapes of an area, which one an image goes to, and
`sdq encode --buckets` end to end (embedded): each image in its bucket as a plain
resize-then-crop makes it, encoded as a plain diffusers loop encodes it, its original size
and crop kept beside its latents, one latent shard per bucket, the images too small for
their bucket left out and counted, and what cannot work refused before anything is written."""

import io
import json
import sqlite3
import subprocess
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from diffusers import DDPMScheduler
from PIL import Image
from sqlalchemy import text

from sdq.migrations import upgrade
from sdq.models import tiny
from sdq.models.datasets import latent_seed
from sdq.models.datasets.buckets import SDXL_BUCKETS, Bucket, buckets_for, nearest_bucket, place
from sdq.models.db import make_engine, session_factory
from sdq.models.encode.specs import EncodeSpec
from sdq.models.train.specs import LatentInput
from sdq.workers.encode.batches import Batch, Target, by_bucket
from sdq.workers.encode.work import _forget_other_buckets
from sdq.workers.evaluate.held_out import HeldOutSamples
from sdq.workers.evaluate.metrics import heldout_loss
from sdq.workers.shards.latents import CONDITIONS, read_tensor
from sdq.workers.tiny import build_unet, build_vae
from sdq.workers.train.loop.data import BucketedStream, bucket_schedule
from tests.conftest import ROOT, run_sdq, sdq_json
from tests.hostile_server import HostileServer
from tests.netns_download import DOWNLOAD_ENV
from tests.services import clean_env
from tests.test_train_data import Shards

pytestmark = pytest.mark.timeout(300)

# Images as found on the web, and the bucket of the 128² area each goes to once the
# download kept its ratio with the shorter side at 128 px (None: too small for it).
FOUND = {
    "256x128": Bucket(192, 128),  # 2:1, nearer 3:2 than 3:1; the width cropped
    "96x200": None,  # nearest 128x192, but 96 px wide as found: never upscaled
    "300x100": Bucket(192, 64),  # 3:1 exactly, scaled down, nothing cropped
    "160x160": Bucket(128, 128),
    "130x250": Bucket(128, 192),  # the height cropped
    "500x300": Bucket(192, 128),
}


def test_the_buckets_of_an_area_are_sdxl_s_scaled_to_it() -> None:
    assert buckets_for(1024) == tuple(sorted(
        (Bucket(*shape) for shape in SDXL_BUCKETS), key=lambda bucket: bucket.aspect
    ))  # fmt: skip
    for side in (256, 512, 768):
        buckets = buckets_for(side)
        assert Bucket(side, side) in buckets
        assert all(b.width % 64 == 0 and b.height % 64 == 0 for b in buckets)
        # Each within a rounding step of the area, from 1:4 to 4:1.
        assert all(abs(b.width * b.height - side**2) <= 64 * 2 * side for b in buckets)
        assert min(b.aspect for b in buckets) == pytest.approx(1 / 4, rel=0.25)
        assert max(b.aspect for b in buckets) == pytest.approx(4, rel=0.25)


@pytest.mark.parametrize("width,height", [(640, 480), (480, 640), (1920, 1080), (300, 1200),
                                          (512, 512), (5000, 900), (777, 333)])  # fmt: skip
def test_an_image_goes_where_it_is_cropped_least_and_is_covered(width: int, height: int) -> None:
    buckets = buckets_for(512)

    def kept(bucket: Bucket) -> float:
        """The share of the image a cover-and-crop into the bucket keeps."""
        scale = max(bucket.width / width, bucket.height / height)
        return bucket.width * bucket.height / (width * height * scale**2)

    placed = place(buckets, width, height)
    assert placed.bucket == nearest_bucket(buckets, width, height)
    assert kept(placed.bucket) == pytest.approx(max(map(kept, buckets)))
    covered = (round(width * placed.scale), round(height * placed.scale))
    assert covered[0] >= placed.bucket.width and covered[1] >= placed.bucket.height
    assert (placed.left, placed.top) == (
        (covered[0] - placed.bucket.width) // 2,
        (covered[1] - placed.bucket.height) // 2,
    )


def expected_pixels(stored: Image.Image, bucket: Bucket) -> tuple[np.ndarray, int, int]:
    """The plain way: resize the whole image to cover the bucket, crop the middle."""
    scale = max(bucket.width / stored.width, bucket.height / stored.height)
    covered = (round(stored.width * scale), round(stored.height * scale))
    resized = stored.resize(covered, Image.Resampling.BOX) if scale != 1 else stored
    left, top = (covered[0] - bucket.width) // 2, (covered[1] - bucket.height) // 2
    return np.array(resized.crop((left, top, left + bucket.width, top + bucket.height))), top, left


def download_found(env: dict[str, str], cwd: Path, downloads: list[tuple[str, str, str]]) -> None:
    """The FOUND images downloaded as each (dataset, resize mode, side) of `downloads`."""
    with HostileServer() as server:
        listing = cwd / "shapes.csv"
        listing.write_text("url,caption\n" + "".join(
            f"{server.base}/sized/{size}/{n}.jpg,picture {n}\n" for n, size in enumerate(FOUND)
        ))  # fmt: skip
        for name, mode, side in downloads:
            sdq_json(env, "download", str(listing), "--dataset", name, "--resolution", side,
                     "--resize-mode", mode, "--min-size", "32", "--rows-per-shard", "4",
                     "--wait", cwd=cwd)  # fmt: skip


def run(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_sdq(env, *args, cwd=cwd)


@torch.inference_mode()
def test_encode_buckets_places_each_image_in_one_latent_shard_per_bucket(tmp_path: Path) -> None:
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    # The longer side at twice the area's side keeps what the area's buckets need.
    download_found(env, tmp_path, [("shapes", "keep_ratio", "128"),
                                   ("squares", "center_crop", "128"),
                                   ("longest", "keep_ratio_largest", "256")])  # fmt: skip

    # What cannot work is refused before anything is written, saying what to do.
    cropped = run(env, tmp_path, "encode", "squares", "--model", "tiny", "--buckets", "128")
    assert cropped.returncode == 2, cropped.stderr
    assert "--resize-mode center_crop" in cropped.stderr and "keep_ratio" in cropped.stderr
    # Nor is training on its buckets sent to an encode that would refuse it.
    trained = run(env, tmp_path, "train", "squares", "--base", "tiny", "--resolution", "128",
                  "--buckets", "--steps", "2")  # fmt: skip
    said = " ".join(trained.stderr.split())
    assert trained.returncode == 2 and "--resize-mode center_crop" in said, said
    assert "leave out --buckets" in said and "sdq encode" not in said, said
    too_big = run(env, tmp_path, "encode", "shapes", "--model", "tiny", "--buckets", "128,512")
    assert too_big.returncode == 2 and "too small for the buckets of 512x512" in " ".join(
        too_big.stderr.split()
    ), too_big.stderr
    too_long = run(env, tmp_path, "encode", "longest", "--model", "tiny", "--buckets", "512")
    assert too_long.returncode == 2 and "256 px on their longer side" in " ".join(
        too_long.stderr.split()
    ), too_long.stderr
    both = run(env, tmp_path, "encode", "shapes", "--model", "tiny", "--buckets", "128",
               "--resolution", "128")  # fmt: skip
    assert both.returncode == 2 and "not --resolution and --buckets" in both.stderr, both.stderr
    assert sdq_json(env, "dataset", "show", "shapes", cwd=tmp_path)["latents"] == []

    shown = sdq_json(env, "encode", "shapes", "--model", "tiny", "--buckets", "128",
                     "--batch-size", "3", "--wait", cwd=tmp_path)  # fmt: skip
    [latents] = shown["latents"]
    expected = [bucket for bucket in FOUND.values() if bucket]
    assert latents["buckets"] == {
        bucket.name: expected.count(bucket) for bucket in sorted(set(expected))
    }
    assert latents["shards"] == 6  # a file per image shard and bucket its images went to
    assert (latents["samples"], latents["left_out"]) == (5, {"too small for 128": 1})
    longest = sdq_json(env, "encode", "longest", "--model", "tiny", "--buckets", "128",
                       "--wait", cwd=tmp_path)["latents"][0]  # fmt: skip
    assert (longest["buckets"], longest["left_out"]) == (latents["buckets"], latents["left_out"])

    # Each bucket's latents are a plain loop's over the image placed so; its original
    # size (as found) and crop are kept beside them.
    store = tmp_path / "sdq-data" / "store"
    images = pq.read_table(store / "datasets/shapes/images/00000.parquet").to_pylist()
    images += pq.read_table(store / "datasets/shapes/images/00001.parquet").to_pylist()
    by_key = {row["key"]: row for row in images}
    vae = build_vae()
    seen = 0
    for path in sorted((store / latents["prefix"]).glob("*.parquet")):
        table = pq.read_table(path)
        bucket = Bucket(*map(int, path.stem.split("-")[1].split("x")))
        about = json.loads(table.schema.metadata[b"sdq"])
        assert about["bucket"] == {"width": bucket.width, "height": bucket.height}
        got = read_tensor(table, "latents")
        assert got.shape == (table.num_rows, 4, bucket.height // 8, bucket.width // 8)
        for index, row in enumerate(table.to_pylist()):
            source = by_key[row["key"]]
            found = (source["original_width"], source["original_height"])
            assert FOUND[f"{found[0]}x{found[1]}"] == bucket
            stored = Image.open(io.BytesIO(source["jpg"])).convert("RGB")
            pixels, top, left = expected_pixels(stored, bucket)
            assert [row[name] for name in CONDITIONS] == [*found, top, left]
            image = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 127.5 - 1
            generator = torch.Generator().manual_seed(latent_seed("shapes", row["key"]))
            plain = vae.encode(image).latent_dist.sample(generator=generator) * 0.18215
            np.testing.assert_allclose(got[index], plain[0].numpy(), atol=0.02)
            seen += 1
    assert seen == 5

    # Squares at the area are another set: training on them says they are not made yet.
    trained = run(env, tmp_path, "train", "shapes", "--base", "tiny", "--resolution", "128",
                  "--steps", "1")  # fmt: skip
    assert trained.returncode == 2 and "at 128 px" in trained.stderr, trained.stderr

    # Trained on the buckets, each step one bucket's batch: two jobs make the model one job
    # makes (exact resume), and the run says how many steps each bucket had.
    revisions = []
    for every in ("6", "3"):
        trained = sdq_json(env, "train", "shapes", "--base", "tiny", "--resolution", "128",
                           "--buckets", "--batch-size", "2", "--steps", "6",
                           "--checkpoint-every", every, "--wait", cwd=tmp_path)  # fmt: skip
        assert (trained["status"], trained["step"]) == ("succeeded", 6)
        mix = trained["buckets"]
        assert sum(mix.values()) == 6 and set(mix) <= set(latents["buckets"]), mix
        page = (store / f"runs/{trained['run_id']}/training.html").read_text()
        assert "steps per bucket: " + ", ".join(f"{b} {n}" for b, n in mix.items()) in page
        revisions.append(trained["checkpoints"][-1]["model_revision"])
    assert revisions[0] == revisions[1]
    # Its checkpoints scored on held-out samples of several buckets, a batch a shape.
    evaluated = sdq_json(env, "train", "shapes", "--base", "tiny", "--resolution", "128",
                         "--buckets", "--batch-size", "2", "--steps", "2", "--holdout", "0.5",
                         "--eval-metrics", "heldout_loss", cwd=tmp_path)  # fmt: skip
    [(step, loss)] = evaluated["scores"]["heldout_loss"]
    assert step == 2 and np.isfinite(loss)

    # Lineage lists the samples each run trained on: every encoded one once (each is in one
    # bucket's shard; the image too small for the area is in none), less those a run held
    # out, which are the ones its evaluation scored.
    encoded = sorted(
        key
        for path in (store / latents["prefix"]).glob("*.parquet")
        for key in pq.read_table(path, columns=["key"])["key"].to_pylist()
    )
    held = pq.read_table(store / f"train/{evaluated['run_id']}/held_out.parquet")
    held_keys = held["key"].to_pylist()
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:

        def trained_on(run_id: int) -> list[str]:
            return sorted(key for (key,) in db.execute(
                "SELECT s.key FROM train_samples t JOIN samples s ON s.id = t.sample_id "
                "WHERE t.run_id = ?", (run_id,)))  # fmt: skip

        assert len(encoded) == 5 and trained_on(trained["run_id"]) == encoded
        assert 0 < len(held_keys) < 5
        assert sorted(trained_on(evaluated["run_id"]) + held_keys) == encoded


# Twelve shards in three buckets, their sizes, and the bucket of each.
BUCKETED = [(5, "192x128"), (7, "128x128"), (6, "128x192"), (3, "192x128"), (8, "128x128"),
            (5, "128x192"), (4, "192x128"), (6, "128x128"), (9, "128x128"), (4, "128x192"),
            (6, "192x128"), (5, "128x128")]  # fmt: skip


def bucketed_samples(lanes: int, steps: int, first_step: int = 0, mine=None, last=None):
    """Each batch's bucket and samples (shard * 1000 + row), and the shards it loaded."""
    shards = Shards(tuple(size for size, _ in BUCKETED))
    inputs = tuple(LatentInput(uri=f"s3://b/{n}", key=str(n), samples=size, bucket=bucket)
                   for n, (size, bucket) in enumerate(BUCKETED))  # fmt: skip
    stream = BucketedStream(inputs, seed=3, batch_size=4, lanes=lanes, load=shards.load,
                            shards_ahead=1, threads=2)  # fmt: skip
    batches = stream.batches(first_step, mine, last_step=last)
    taken = [(batch.step, batch.bucket, [int(v) for v in batch.latents.reshape(-1)])
             for batch in islice(batches, steps)]  # fmt: skip
    batches.close()
    return taken, shards.loaded


def test_each_batch_is_one_bucket_s_and_ranks_and_resumes_take_the_same_samples() -> None:
    whole, _ = bucketed_samples(lanes=4, steps=40)
    assert [step for step, _, _ in whole] == list(range(1, 41))
    for _, bucket, values in whole:
        assert {BUCKETED[value // 1000][1] for value in values} == {bucket}
    # Two ranks of two lanes each train on the slices of the one rank's batches.
    halves = [bucketed_samples(lanes=4, steps=40, mine=range(2 * r, 2 * r + 2))[0]
              for r in range(2)]  # fmt: skip
    assert [
        (s, b, first + second) for (s, b, first), (_, _, second) in zip(*halves, strict=True)
    ] == whole
    # A job that starts at step 23 goes on with the same buckets and samples.
    assert bucketed_samples(lanes=4, steps=17, first_step=23)[0] == whole[23:]
    # Nothing past the run's last step is fetched: the shards its steps read, each once.
    taken, loaded = bucketed_samples(lanes=1, steps=2, last=2)
    assert sorted(loaded) == sorted({value // 1000 for _, _, values in taken for value in values})


def test_buckets_are_drawn_in_proportion_to_their_samples_in_blocks_from_the_seed() -> None:
    sizes = [10, 30, 60]
    drawn = bucket_schedule(sizes, seed=1, first=0, last=30_000)
    shares = np.bincount(drawn, minlength=3) / len(drawn)
    np.testing.assert_allclose(shares, [0.1, 0.3, 0.6], atol=0.01)
    # Any stretch of steps is the same draws, across the blocks' seams.
    np.testing.assert_array_equal(bucket_schedule(sizes, 1, 4000, 9000), drawn[4000:9000])
    assert not np.array_equal(bucket_schedule(sizes, 2, 0, 100), drawn[:100])


def test_a_shard_encoded_again_into_other_buckets_keeps_no_row_of_the_old_ones(
    tmp_path: Path,
) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/sdq.db")
    upgrade(engine)
    shapes = [(64, 64, False), (192, 128, True), (128, 192, True), (128, 128, True)]
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO datasets (id, name, options) VALUES (1, 'd', '{}')"))
        connection.execute(text(
            "INSERT INTO shards (id, dataset_id, number, source_uri, source_id, first_row, "
            "row_count) VALUES (1, 1, 0, 'l', 's', 0, 4)"
        ))  # fmt: skip
        for width, height, bucketed in shapes:
            connection.execute(text(
                "INSERT INTO latent_shards (dataset_id, shard_id, image_sha256, model_name, "
                "model_revision, resolution, bucketed, width, height, uri, sha256, samples, "
                "tensors, seconds, finished_at) VALUES (1, 1, 'i', 'tiny', 'r', 128, :b, :w, "
                ":h, 'u', 's', 1, '{}', 1, '2026-11-28 00:00:00')"
            ), {"b": bucketed, "w": width, "h": height})  # fmt: skip
    spec = EncodeSpec(dataset="d", shard=0, shard_sha256="i", image_format="jpg",
                      model_name="tiny", model_source="tiny", model_revision="r",
                      resolution=128, dtype="float32", buckets=True)  # fmt: skip
    with session_factory(engine).begin() as session:
        _forget_other_buckets(session, 1, spec, [Bucket(192, 128)])
    with engine.begin() as connection:
        left = connection.execute(text("SELECT width, height, bucketed FROM latent_shards"))
        assert sorted(left.all()) == [(64, 64, False), (192, 128, True)]


@torch.inference_mode()
def test_held_out_samples_of_several_buckets_are_scored_a_shape_at_a_time() -> None:
    """A run on buckets holds out samples of several shapes: its held-out loss is the mean
    over every sample, each scored as it would be alone."""
    unet = build_unet()
    scheduler = DDPMScheduler.from_config(tiny.SCHEDULER_CONFIG)
    rng = np.random.default_rng(0)
    width = tiny.UNET_CONFIG["cross_attention_dim"]
    tensors = [
        {"latents": rng.standard_normal((4, height, width_)).astype(np.float32),
         "text_embeddings": rng.standard_normal((7, width)).astype(np.float32)}
        for height, width_ in [(8, 8), (8, 16), (8, 8), (16, 8)]
    ]  # fmt: skip
    keys = ["a", "b", "c", "d"]
    mixed = heldout_loss(unet, scheduler, HeldOutSamples(keys, [""] * 4, tensors), timesteps=3)
    alone = [
        heldout_loss(unet, scheduler, HeldOutSamples([key], [""], [sample]), timesteps=3)
        for key, sample in zip(keys, tensors, strict=True)
    ]
    assert mixed == pytest.approx(float(np.mean(alone)), rel=1e-5)


def test_a_bucket_s_images_wait_for_a_full_vae_batch() -> None:
    """Encoding buckets, each VAE batch is one bucket's, full but for the last, its rows in
    the shard's order with their own token ids, seeds and conditions, and the images too
    small for it counted: not a bucket's few images of each batch the CPU decoded."""
    wide, tall, square_ = ((128, Bucket(w, h)) for w, h in [(192, 128), (128, 192), (128, 128)])
    # Five batches of four images: the bucket of each (the square's images too small for it).
    goes = [wide, tall, wide, square_] * 5
    chunks = []
    for start in range(0, len(goes), 4):
        rows = list(range(start, start + 4))
        targets = {}
        for key in dict.fromkeys(goes[row] for row in rows):
            placed = [n for n, row in enumerate(rows) if goes[row] == key]
            kept = [] if key == square_ else placed
            bucket = key[1]
            # Each image's pixels and its first condition say its row.
            pixels = torch.tensor([rows[n] for n in kept], dtype=torch.uint8)
            pixels = pixels[:, None, None, None].expand(-1, bucket.height, bucket.width, 3)
            conditions = np.array([[rows[n], 0, 0, 0] for n in kept], np.int32).reshape(-1, 4)
            targets[key] = Target(pixels, kept, len(placed) - len(kept), conditions)
        chunks.append(Batch(rows, targets, [torch.tensor([[row, 0] for row in rows])],
                            seeds=[1000 + row for row in rows]))  # fmt: skip
    regrouped = list(by_bucket(chunks, batch_size=4, pin=False))

    made = {key: [batch for batch in regrouped if key in batch.targets]
            for key in (wide, tall, square_)}  # fmt: skip
    assert {key: [len(batch.rows) for batch in batches] for key, batches in made.items()} == {
        wide: [4, 4, 2], tall: [4, 1], square_: [0]
    }  # fmt: skip
    assert made[square_][0].targets[square_].left_out == 5
    for batch in regrouped:
        [(key, target)] = batch.targets.items()
        assert all(goes[row] == key for row in batch.rows)
        assert batch.rows == sorted(batch.rows) and batch.seeds == [1000 + r for r in batch.rows]
        assert batch.token_ids[0][:, 0].tolist() == batch.rows
        assert target.pixels[:, 0, 0, 0].tolist() == batch.rows
        assert target.kept == list(range(len(batch.rows)))
        assert target.conditions[:, 0].tolist() == batch.rows
