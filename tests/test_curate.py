"""sdq curate end to end, embedded: a tiny random CLIP built in code and saved as a
transformers folder, an aesthetic head in the LAION predictor's own key layout (a torch
.pth) and an NSFW head (safetensors). Every kept sample's scores in SQL and its embedding in
the store equal a plain transformers loop's; bad inputs are refused by name with nothing
written."""

import hashlib
import io
import itertools
import sqlite3
import subprocess
from pathlib import Path

import numpy as np
import psycopg
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

from sdq.models import tiny
from sdq.models.curate.specs import head_key
from sdq.workers.curate.scoring import Pixels
from sdq.workers.shards.embeddings import read_embeddings
from sdq.workers.tiny import build_clip
from tests.conftest import BUCKET, ROOT, WorkerProcess, run_sdq, sdq_json
from tests.hostile_server import HostileServer
from tests.netns_download import DOWNLOAD_ENV
from tests.services import clean_env
from tests.test_encode import write_list

pytestmark = pytest.mark.timeout(300)
WIDTH = 16  # the tiny CLIP's embedding


def tiny_clip(folder: Path) -> Path:
    """The `tiny` CLIP (workers/tiny.py) saved as a transformers folder: a CLIP given by
    path, as a user's own is."""
    for part in build_clip():
        part.save_pretrained(folder)
    return folder


def head_state(widths: list[int], indices: list[int], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for index, (inputs, outputs) in zip(indices, itertools.pairwise(widths), strict=True):
        state[f"layers.{index}.weight"] = torch.randn((outputs, inputs), generator=generator) * 0.3
        state[f"layers.{index}.bias"] = torch.randn((outputs,), generator=generator) * 0.1
    return state


# LAION's improved aesthetic predictor: Linear(D,1024), Linear(1024,128), Linear(128,64),
# Linear(64,16), Linear(16,1), with dropouts between at indices 1, 3 and 5.
AESTHETIC = ([WIDTH, 1024, 128, 64, 16, 1], [0, 2, 4, 6, 7])
NSFW = ([WIDTH, 64, 32, 1], [0, 2, 4])


@torch.inference_mode()
def plain_scores(clip: Path, jpg: bytes, caption: str, aesthetic, nsfw) -> tuple[float, ...]:
    """A plain transformers loop, one sample at a time: CLIPScore, the heads' outputs."""
    model = CLIPModel.from_pretrained(clip).eval()
    processor = CLIPImageProcessorPil.from_pretrained(clip)
    tokenizer = CLIPTokenizer.from_pretrained(clip)
    image = Image.open(io.BytesIO(jpg)).convert("RGB")
    tokens = tokenizer([caption], padding="max_length", max_length=77, truncation=True,
                       return_tensors="pt")  # fmt: skip
    out = model(**tokens, pixel_values=processor(images=image, return_tensors="pt").pixel_values)
    embedding = out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
    text = out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True)
    clip_score = max(100 * float((embedding * text).sum()), 0.0)

    def mlp(state, relu: bool) -> float:
        x = embedding[0]
        layers = sorted({int(key.split(".")[1]) for key in state})
        for position, index in enumerate(layers):
            x = x @ state[f"layers.{index}.weight"].T + state[f"layers.{index}.bias"]
            if relu and position < len(layers) - 1:
                x = x.clamp(min=0)
        return float(torch.sigmoid(x)) if relu else float(x)

    return clip_score, mlp(aesthetic, relu=False), mlp(nsfw, relu=True), embedding[0].numpy()


@pytest.mark.parametrize(
    "settings",
    [
        {"size": {"shortest_edge": 112}, "crop_size": {"height": 112, "width": 112}},
        {"size": {"shortest_edge": 32}, "crop_size": {"height": 40, "width": 24}},
        {"size": {"height": 48, "width": 64}, "do_center_crop": False},
        {"size": {"shortest_edge": 30}, "crop_size": {"height": 30, "width": 30},
         "resample": 2, "do_normalize": False},
    ],
)  # fmt: skip
def test_curate_s_pixels_are_clip_s_processor_s_to_the_bit(settings: dict) -> None:
    """Resized and cropped to bytes on the host, rescaled and normalised from a table on
    the device: the values CLIP's image processor makes of the same images, landscape,
    portrait, square, smaller than the crop (zero bytes around) and larger."""
    processor = CLIPImageProcessorPil(**settings)
    pixels = Pixels.of(processor, torch.device("cpu"))
    generator = np.random.default_rng(0)
    for width, height in [(200, 37), (37, 200), (112, 112), (17, 9), (641, 480), (113, 112)]:
        image = Image.fromarray(generator.integers(0, 256, (height, width, 3), dtype=np.uint8))
        expected = processor(images=image, return_tensors="pt")["pixel_values"]
        ours = pixels.normalized(torch.from_numpy(np.stack([pixels.cropped(image)])), torch.float32)
        assert torch.equal(ours, expected), (width, height)


def test_curate_embedded_scores_as_a_plain_clip_loop_and_refuses_bad_inputs(
    tmp_path: Path,
) -> None:
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    clip = tiny_clip(tmp_path / "tiny-clip")
    aesthetic, nsfw = head_state(*AESTHETIC, seed=1), head_state(*NSFW, seed=2)
    torch.save(aesthetic, tmp_path / "aesthetic.pth")
    save_file(nsfw, tmp_path / "nsfw.safetensors")
    with HostileServer() as server:
        listing = write_list(tmp_path / "list.csv", server.base, 10)
        sdq_json(env, "download", str(listing), "--dataset", "pets", "--resolution", "64",
                 "--rows-per-shard", "4", cwd=tmp_path)  # fmt: skip

    def curate(*options: str) -> subprocess.CompletedProcess:
        return run_sdq(env, "curate", *options, "--json", cwd=tmp_path)

    # Bad inputs: refused by name, exit 2, nothing written.
    narrow = head_state([WIDTH * 2, 8, 1], [0, 2], seed=3)
    save_file(narrow, tmp_path / "narrow.safetensors")
    # Another model's tensors: named, not an error from reading them as a head's.
    save_file({"weight": torch.zeros(1, WIDTH), "fc.bias": torch.zeros(1)},
              tmp_path / "other.safetensors")  # fmt: skip
    refusals = [
        (("pets", "--model", "tiny", "--nsfw-head", str(tmp_path / "other.safetensors")),
         f"--nsfw-head {tmp_path / 'other.safetensors'}: not a head of linear layers keyed "
         "layers.<i>.weight and .bias (it has fc.bias, weight)"),
        (("pets", "--model", str(clip), "--nsfw-head", str(tmp_path / "narrow.safetensors")),
         f"--nsfw-head {tmp_path / 'narrow.safetensors'}: the head takes 32-wide embeddings; "
         f"CLIP model tiny-clip makes {WIDTH}-wide ones"),
        # An NSFW head given as the aesthetic one: not LAION's predictor's layers.
        (("pets", "--model", "tiny", "--aesthetic-head", str(tmp_path / "nsfw.safetensors")),
         f"--aesthetic-head {tmp_path / 'nsfw.safetensors'}: layers of widths {WIDTH} -> 64 -> "
         "32 -> 1, not LAION's aesthetic predictor"),
        (("nowhere", "--model", str(clip)), "no dataset named 'nowhere'"),
        (("pets", "--model", str(tmp_path / "sdq-data")), "is not a CLIP model"),
    ]  # fmt: skip
    for options, message in refusals:
        refused = curate(*options)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        assert db.execute("SELECT count(*) FROM runs WHERE kind = 'curate'").fetchone() == (0,)
    assert not (tmp_path / "sdq-data/store/heads").exists()

    heads = ("--aesthetic-head", str(tmp_path / "aesthetic.pth"),
             "--nsfw-head", str(tmp_path / "nsfw.safetensors"))  # fmt: skip
    done = curate("pets", "--model", str(clip), *heads, "--batch-size", "3")
    assert done.returncode == 0, done.stderr
    rows = quality(tmp_path)
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        statuses = db.execute("SELECT status, count(*) FROM jobs WHERE kind = 'curate' "
                              "GROUP BY status").fetchall()  # fmt: skip
    assert statuses == [("succeeded", 3)]
    scored = [row for row in rows if row[5]]
    assert len(rows) == 10 and len(scored) == 9  # the broken row kept no image, no score
    assert all(row[2] is None for row in rows if not row[5])
    store = tmp_path / "sdq-data/store"
    images = {
        row["key"]: row
        for path in sorted((store / "datasets/pets/images").glob("*.parquet"))
        for row in pq.read_table(path).to_pylist()
    }
    embeddings = {}
    for path in sorted((store / "datasets/pets/clip").rglob("*.parquet")):
        keys, vectors = read_embeddings(path.read_bytes())
        embeddings.update(zip(keys, vectors, strict=True))
    assert sorted(embeddings) == [row[0] for row in scored]
    for key, caption, clip_score, aesthetic_score, nsfw_score, _ in scored:
        want = plain_scores(clip, images[key]["jpg"], caption, aesthetic, nsfw)
        assert (clip_score, aesthetic_score, nsfw_score) == pytest.approx(
            want[:3], rel=1e-4, abs=1e-4
        )
        assert 0 < nsfw_score < 1
        np.testing.assert_allclose(embeddings[key].astype(np.float32), want[3], atol=2e-3)
    # The dataset's summary shows the scores' ranges.
    shown = sdq_json(env, "dataset", "show", "pets", cwd=tmp_path)["scores"]
    assert shown["samples"] == 9
    assert shown["clip_score"]["min"] == pytest.approx(min(row[2] for row in scored), abs=1e-3)
    assert shown["nsfw"]["max"] == pytest.approx(max(row[4] for row in scored), abs=1e-3)
    # Scoring again with the same model and heads: served from the store, nothing redone.
    again = curate("pets", "--model", str(clip), *heads)
    assert again.returncode == 0, again.stderr
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        cached = db.execute("SELECT count(*) FROM jobs WHERE kind = 'curate' AND cached").fetchone()
    assert cached == (3,)
    # `--model tiny`: the same CLIP built in code, no folder needed, the same scores.
    built_here = curate("pets", "--model", "tiny", *heads)
    assert built_here.returncode == 0, built_here.stderr
    again_rows = quality(tmp_path)
    assert [row[:2] for row in again_rows] == [row[:2] for row in rows]
    for row, before in zip(again_rows, rows, strict=True):
        # Batches of 64 here, of 3 before: the same figures to float32's rounding.
        assert row[2:5] == (pytest.approx(before[2:5], rel=1e-5) if before[5] else (None,) * 3)
    # Heads built here as well (`tiny`): curate runs offline, scoring with the heads' weights
    # as stored (random, in their layouts, for this CLIP's width).
    offline = curate("pets", "--model", "tiny", "--aesthetic-head", "tiny", "--nsfw-head", "tiny")
    assert offline.returncode == 0, offline.stderr
    tiny_heads = [
        load_file(store / head_key(hashlib.sha256(tiny.head_file(widths, stream)).hexdigest(),
                                   ".safetensors"))
        for widths, stream in (([WIDTH, 1024, 128, 64, 16, 1], 1), ([WIDTH, 64, 1], 2))
    ]  # fmt: skip
    for key, caption, clip_score, aesthetic_score, nsfw_score, kept in quality(tmp_path):
        if kept:
            want = plain_scores(clip, images[key]["jpg"], caption, *tiny_heads)
            assert (clip_score, aesthetic_score, nsfw_score) == pytest.approx(
                want[:3], rel=1e-4, abs=1e-4
            )


def quality(home: Path) -> list[tuple]:
    """Each sample of 'pets' with its latest scores, as the sample_quality view gives them."""
    with sqlite3.connect(home / "sdq-data/sdq.db") as db:
        return db.execute(
            "SELECT key, caption, clip_score, aesthetic, nsfw, kept FROM sample_quality "
            "WHERE dataset = 'pets' ORDER BY key"
        ).fetchall()


def test_curate_on_services_scores_in_postgres_and_stores_embeddings_in_s3(
    download_env: dict[str, str],
    cpu_worker: WorkerProcess,
    worker: WorkerProcess,
    s3_client,
    tmp_path: Path,
) -> None:
    """A real GPU-pool worker takes the curate queue like any other: the scores land in
    Postgres, one row per kept sample, and the embeddings in S3, keyed as the rows are."""
    clip = tiny_clip(tmp_path / "tiny-clip")
    save_file(head_state(*AESTHETIC, seed=1), tmp_path / "aesthetic.safetensors")
    with HostileServer() as server:
        listing = write_list(tmp_path / "list.csv", server.base, 7)
        sdq_json(download_env, "download", str(listing), "--dataset", "owls", "--resolution",
                 "64", "--rows-per-shard", "4", "--wait", cwd=ROOT)  # fmt: skip
    run = sdq_json(download_env, "curate", "owls", "--model", str(clip), "--aesthetic-head",
                   str(tmp_path / "aesthetic.safetensors"), "--wait", cwd=ROOT)  # fmt: skip
    assert run["by_status"] == {"failed": 1, "success": 6}
    with psycopg.connect(download_env["SDQ_DATABASE_URL"]) as connection:
        scored = connection.execute(
            "SELECT key, clip_score, aesthetic, nsfw FROM sample_quality "
            "WHERE dataset = 'owls' AND clip_score IS NOT NULL ORDER BY key"
        ).fetchall()
        uris = [uri for (uri,) in connection.execute(
            "SELECT output_uri FROM jobs WHERE kind = 'curate' AND status = 'succeeded' "
            "ORDER BY id"
        )]  # fmt: skip
    assert len(scored) == 6 and all(nsfw is None and aesthetic is not None
                                    for _, _, aesthetic, nsfw in scored)  # fmt: skip
    keys = []
    for uri in uris:
        body = s3_client.get_object(Bucket=BUCKET, Key=uri.removeprefix(f"s3://{BUCKET}/"))
        shard_keys, vectors = read_embeddings(body["Body"].read())
        assert vectors.shape == (len(shard_keys), WIDTH) and vectors.dtype == np.float16
        keys += shard_keys
    assert sorted(keys) == [key for key, *_ in scored]
