"""sdq encode end to end, embedded and on the services with a real GPU-pool worker: the
latents and text embeddings equal a direct diffusers and transformers computation with
the same tiny VAE, text encoder and seeds, and SQL leads from each latent shard back to
the URLs it was made of."""

import io
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from sdq.models.datasets import latent_seed
from sdq.models.tiny import content_hash
from sdq.workers.shards.latents import read_tensor
from sdq.workers.tiny import build_pipeline, build_text_encoder, build_tokenizer, build_vae
from tests.conftest import BUCKET, ROOT, WorkerProcess, run_sdq, sdq_json
from tests.hostile_server import HostileServer
from tests.netns_download import DOWNLOAD_ENV
from tests.services import clean_env

pytestmark = pytest.mark.timeout(300)
RESOLUTION = 64


def write_list(path: Path, base: str, rows: int) -> Path:
    """Distinct pictures, and one row that fails, so shards hold rows without images."""
    lines = ["url,caption"]
    for n in range(rows):
        path_part = "/not-an-image.jpg" if n == 2 else f"/img/{n}.jpg"
        lines.append(f"{base}{path_part},picture number {n}")
    path.write_text("\n".join(lines) + "\n")
    return path


def download_and_encode(env: dict[str, str], listing: Path, dataset: str, cwd: Path) -> dict:
    sdq_json(
        env, "download", str(listing), "--dataset", dataset, "--resolution", str(RESOLUTION),
        "--rows-per-shard", "4", "--wait", cwd=cwd,
    )  # fmt: skip
    return sdq_json(
        env, "encode", dataset, "--model", "tiny", "--resolution", str(RESOLUTION),
        "--batch-size", "3", "--wait", cwd=cwd,
    )  # fmt: skip


@torch.inference_mode()
def check_latent_shard(
    latents: pa.Table,
    images: pa.Table,
    dataset: str,
    resolution: int = RESOLUTION,
    smallest: int = 0,
) -> None:
    """Every kept image of the image shard at least `smallest` px on its shorter side as
    it was found, and only those, in order, encoded as a plain diffusers/transformers loop
    encodes it at `resolution`, one sample at a time."""
    kept = [
        row
        for row in images.filter(pa.compute.equal(images["status"], "success")).to_pylist()
        if min(row["original_width"], row["original_height"]) >= smallest
    ]
    assert latents["key"].to_pylist() == [row["key"] for row in kept]
    assert latents["url"].to_pylist() == [row["url"] for row in kept]
    assert latents["sha256"].to_pylist() == [row["sha256"] for row in kept]
    seeds = [latent_seed(dataset, row["key"]) for row in kept]
    assert latents["seed"].to_pylist() == seeds
    vae, text_encoder, tokenizer = build_vae(), build_text_encoder(), build_tokenizer()
    got_latents = read_tensor(latents, "latents")
    got_embeddings = read_tensor(latents, "text_embeddings")
    got_tokens = read_tensor(latents, "token_ids")
    assert got_latents.shape == (len(kept), 4, resolution // 8, resolution // 8)
    for index, (row, seed) in enumerate(zip(kept, seeds, strict=True)):
        stored = Image.open(io.BytesIO(row["jpg"])).convert("RGB")  # a square already
        if stored.width != resolution:
            stored = stored.resize((resolution, resolution), Image.Resampling.BOX)
        pixels = np.array(stored)
        image = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 127.5 - 1
        generator = torch.Generator().manual_seed(seed)
        expected = vae.encode(image).latent_dist.sample(generator=generator) * 0.18215
        np.testing.assert_allclose(got_latents[index], expected[0].numpy(), rtol=1e-4, atol=1e-5)
        tokens = tokenizer(
            row["caption"], padding="max_length", max_length=77, truncation=True,
            return_tensors="pt",
        ).input_ids  # fmt: skip
        np.testing.assert_array_equal(got_tokens[index], tokens[0].numpy())
        embedding = text_encoder(tokens)[0][0].numpy()
        np.testing.assert_allclose(got_embeddings[index], embedding, rtol=1e-4, atol=1e-5)


def test_encode_embedded_matches_a_direct_computation_and_is_served_again(
    tmp_path: Path,
) -> None:
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    with HostileServer() as server:
        listing = write_list(tmp_path / "list.csv", server.base, 10)
        summary = download_and_encode(env, listing, "pets", cwd=tmp_path)
    [latents] = summary["latents"]
    assert latents["model"] == "tiny"
    assert latents["revision"] == content_hash()
    assert (latents["resolution"], latents["shards"], latents["samples"]) == (RESOLUTION, 3, 9)
    store = tmp_path / "sdq-data" / "store"
    for number in range(3):
        name = f"{number:05d}.parquet"
        check_latent_shard(
            pq.read_table(store / latents["prefix"] / name),
            pq.read_table(store / "datasets/pets/images" / name),
            "pets",
        )
    again = sdq_json(env, "encode", "pets", "--model", "tiny", "--resolution", "64", cwd=tmp_path)
    assert again["latents"] == summary["latents"]

    # The same weights saved as a diffusers folder load through from_pretrained: another
    # revision (its files' hash), its dtype "auto", which is float32 on this CPU (float16
    # on a GPU): the same numbers.
    folder = tmp_path / "tiny-saved"
    build_pipeline().save_pretrained(folder)
    saved = sdq_json(
        env, "encode", "pets", "--model", str(folder), "--resolution", "64", cwd=tmp_path
    )
    [from_folder] = [entry for entry in saved["latents"] if entry != latents]
    for number in range(3):
        name = f"{number:05d}.parquet"
        loaded = read_tensor(pq.read_table(store / from_folder["prefix"] / name), "latents")
        assert loaded.dtype == np.float32
        np.testing.assert_allclose(
            loaded,
            read_tensor(pq.read_table(store / latents["prefix"] / name), "latents"),
            atol=1e-4,
        )


def test_one_pass_encodes_several_resolutions_and_leaves_out_what_is_too_small(
    tmp_path: Path,
) -> None:
    """`--resolutions 32,64` over images stored at 64 px, three of them found at 40 px:
    each target's latents are a plain loop's at its size, the small ones are left out of
    64 (never upscaled) and counted; a target above the stored size is refused."""
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    sizes = ["96x80", "48x40", "120x72", "40x56", "80x80", "44x40"]
    with HostileServer() as server:
        listing = tmp_path / "sized.csv"
        listing.write_text("url,caption\n" + "".join(
            f"{server.base}/sized/{size}/{n}.jpg,picture {n}\n" for n, size in enumerate(sizes)
        ))  # fmt: skip
        sdq_json(env, "download", str(listing), "--dataset", "sized", "--resolution", "64",
                 "--min-size", "32", "--rows-per-shard", "4", "--wait", cwd=tmp_path)  # fmt: skip
    refused = run_sdq(
        env, "encode", "sized", "--model", "tiny", "--resolutions", "32,128", cwd=tmp_path
    )
    assert refused.returncode == 2 and "too small for 128" in refused.stderr, refused.stderr
    shown = sdq_json(env, "encode", "sized", "--model", "tiny", "--resolutions", "64,32",
                     "--batch-size", "3", "--wait", cwd=tmp_path)  # fmt: skip
    latents = {entry["resolution"]: entry for entry in shown["latents"]}
    assert (latents[32]["samples"], latents[32]["left_out"]) == (6, {})
    # The other way at a resolution encoded (upscaling) would replace those latents.
    other_way = run_sdq(
        env, "encode", "sized", "--model", "tiny", "--resolution", "64", cwd=tmp_path
    )
    assert other_way.returncode == 2, other_way.stderr
    assert "made with --resolutions (smaller images left out)" in " ".join(other_way.stderr.split())
    assert (latents[64]["samples"], latents[64]["left_out"]) == (3, {"too small for 64": 3})
    store = tmp_path / "sdq-data" / "store"
    for resolution, smallest in ((32, 0), (64, 64)):
        for number in range(2):
            name = f"{number:05d}.parquet"
            check_latent_shard(
                pq.read_table(store / latents[resolution]["prefix"] / name),
                pq.read_table(store / "datasets/sized/images" / name),
                "sized", resolution, smallest,
            )  # fmt: skip
    # Trained at the resolution whose latents left images out: on the rest.
    trained = sdq_json(env, "train", "sized", "--base", "tiny", "--resolution", "64",
                       "--batch-size", "2", "--steps", "2", "--wait", cwd=tmp_path)  # fmt: skip
    assert (trained["status"], trained["step"]) == ("succeeded", 2)


def test_encode_on_services_writes_latents_to_s3_with_lineage_to_the_urls(
    download_env: dict[str, str],
    cpu_worker: WorkerProcess,
    worker: WorkerProcess,
    s3_client,
    tmp_path: Path,
) -> None:
    with HostileServer() as server:
        listing = write_list(tmp_path / "list.csv", server.base, 7)
        summary = download_and_encode(download_env, listing, "birds", cwd=ROOT)
    [latents] = summary["latents"]
    assert (latents["shards"], latents["samples"]) == (2, 6)

    def read(uri: str) -> pa.Table:
        body = s3_client.get_object(Bucket=BUCKET, Key=uri.removeprefix(f"s3://{BUCKET}/"))
        return pq.read_table(io.BytesIO(body["Body"].read()))

    with psycopg.connect(download_env["SDQ_DATABASE_URL"]) as connection:
        shards = connection.execute(
            "SELECT l.uri, h.uri, l.samples, l.tensors FROM latent_shards l "
            "JOIN shards h ON h.id = l.shard_id JOIN datasets d ON d.id = l.dataset_id "
            "WHERE d.name = 'birds' ORDER BY h.number"
        ).fetchall()
        assert len(shards) == 2
        for latent_uri, image_uri, samples, tensors in shards:
            table = read(latent_uri)
            check_latent_shard(table, read(image_uri), "birds")
            assert samples == len(table)
            assert tensors["latents"] == {"shape": [4, 8, 8], "dtype": "float32"}
            # From a latent shard back to the URLs and captions it learned from.
            lineage = connection.execute(
                "SELECT s.url, s.caption FROM latent_shards l "
                "JOIN samples s ON s.shard_id = l.shard_id AND s.status = 'success' "
                "WHERE l.uri = %s ORDER BY s.key",
                (latent_uri,),
            ).fetchall()
            assert lineage == list(
                zip(table["url"].to_pylist(), table["caption"].to_pylist(), strict=True)
            )
        again = sdq_json(download_env, "encode", "birds", "--model", "tiny", "--resolution", "64")
        assert again["jobs"] == again["cached"] == 2
        cached = connection.execute(
            "SELECT bool_and(cached) FROM jobs WHERE run_id = %s", (again["run_id"],)
        ).fetchone()[0]
        assert cached


def test_encode_refuses_what_it_cannot_do_by_name(download_env: dict[str, str]) -> None:
    def encode(*args: str) -> subprocess.CompletedProcess:
        return run_sdq(download_env, "encode", *args, cwd=ROOT)

    unknown = encode("no-such-dataset", "--model", "tiny")
    assert unknown.returncode == 2
    assert "no dataset named 'no-such-dataset'" in unknown.stderr
    odd = encode("birds", "--model", "tiny", "--resolution", "100")
    assert odd.returncode == 2
    assert "--resolution 100: not a positive multiple of 8" in odd.stderr
    model = encode("birds", "--model", "no-such-model")
    assert model.returncode == 2
    assert "unknown model 'no-such-model':" in model.stderr
    misspelt = encode("birds", "--model", "tinny")
    assert misspelt.returncode == 2
    assert "unknown model 'tinny' (did you mean 'tiny'?)" in misspelt.stderr


def test_a_dataset_with_no_usable_samples_is_named_so_by_encode_and_train(
    tmp_path: Path,
) -> None:
    """Every row failed (404): encode and train say the dataset has nothing to use,
    instead of encoding 0 samples and then advising the same encode again."""
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    with HostileServer() as server:
        listing = tmp_path / "gone.csv"
        listing.write_text("url,caption\n" + "".join(
            f"{server.base}/missing-{n}.jpg,gone {n}\n" for n in range(3)))  # fmt: skip
        sdq_json(env, "download", str(listing), "--dataset", "gone", cwd=tmp_path, exit_code=1)

    def refused(*args: str) -> str:
        result = run_sdq(env, *args, "--model" if args[0] == "encode" else "--base", "tiny",
                         "--resolution", str(RESOLUTION), cwd=tmp_path)  # fmt: skip
        assert result.returncode == 2, result.stderr
        return " ".join(result.stderr.split())

    said = "dataset 'gone' has no usable samples: all 3 downloaded so far failed or were duplicates"
    assert said in refused("encode", "gone")
    trained = refused("train", "gone", "--steps", "4")
    assert said in trained and "sdq encode" not in trained


def test_a_dead_encode_job_is_found_where_its_run_s_status_says(tmp_path: Path) -> None:
    """An image shard changed in the store since it was recorded cannot be encoded: its job
    is dead, and the command `sdq status` names for a run's dead jobs lists it, an encode
    job as a generation job."""
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    with HostileServer() as server:
        listing = write_list(tmp_path / "toy.csv", server.base, 4)
        sdq_json(env, "download", str(listing), "--dataset", "toy", "--resolution", "64",
                 "--wait", cwd=tmp_path)  # fmt: skip
    [shard] = (tmp_path / "sdq-data/store/datasets/toy/images").glob("*.parquet")
    shard.write_bytes(shard.read_bytes()[:-100])

    def sdq(*args: str, exit_code: int = 0) -> str:
        done = run_sdq(env, *args, cwd=tmp_path)
        assert done.returncode == exit_code, done.stderr
        return done.stdout + " ".join(done.stderr.split())

    encoded = sdq("encode", "toy", "--model", "tiny", "--resolution", "64", exit_code=1)
    run_id = int(re.search(r"run (\d+): 1 job dead", encoded)[1])
    listing_command = f"sdq find --run {run_id} --status dead"
    said = " ".join(sdq("status", str(run_id)).split())
    assert f"1 failed for good: `{listing_command}` lists them" in said, said
    [job] = json.loads(sdq(*listing_command.split()[1:], "--json"))
    assert (job["run_id"], job["kind"], job["status"]) == (run_id, "encode", "dead")
