"""`sdq export RUN DIR`: a run's images and their metadata in each format, byte for byte
what the store holds."""

import csv
import io
import json
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import sdq_json, write

# Its tests share a module-wide fixture: in one test process when run in parallel.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("test_export")]


@pytest.fixture(scope="module")
def run(worker, service_env: dict[str, str], tmp_path_factory) -> dict:
    prompts = write(
        tmp_path_factory.mktemp("export") / "p.csv",
        "prompt,seed,style\nexported castle,1,ink\nexported boat,2,oil\n",
    )
    return sdq_json(service_env, "submit", str(prompts), "--steps", "2", "--wait")


def stored(s3_client, uri: str) -> bytes:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()


def images_of(run: dict, s3_client) -> dict[str, bytes]:
    """spec hash -> the PNG the store holds."""
    return {
        job["uri"].rsplit("/", 1)[1].removesuffix(".png"): stored(s3_client, job["uri"])
        for job in run["jobs"]
    }


def export(env: dict[str, str], run_id: int, folder: Path, format: str) -> dict:
    return sdq_json(env, "export", str(run_id), str(folder), "--format", format)


def test_folder_export(run, service_env, s3_client, tmp_path: Path) -> None:
    done = export(service_env, run["run_id"], tmp_path, "folder")
    assert done["images"] == 2
    rows = list(csv.DictReader((tmp_path / "metadata.csv").open()))
    assert {row["style"] for row in rows} == {"ink", "oil"}
    assert {row["seed"] for row in rows} == {"1", "2"}
    for spec_hash, data in images_of(run, s3_client).items():
        [row] = [row for row in rows if row["spec_hash"] == spec_hash]
        assert (tmp_path / row["file_name"]).read_bytes() == data
        assert row["model"] == "tiny" and len(row["model_revision"]) == 64


def test_parquet_export(run, service_env, s3_client, tmp_path: Path) -> None:
    [path] = export(service_env, run["run_id"], tmp_path, "parquet")["files"]
    table = pq.read_table(path).to_pylist()
    assert {row["spec_hash"]: row["png"] for row in table} == images_of(run, s3_client)
    assert {row["prompt"] for row in table} == {"exported castle, ink", "exported boat, oil"}


def test_webdataset_export(run, service_env, s3_client, tmp_path: Path) -> None:
    [path] = export(service_env, run["run_id"], tmp_path, "webdataset")["files"]
    with tarfile.open(path) as tar:
        members = {member.name: tar.extractfile(member).read() for member in tar.getmembers()}
    images = images_of(run, s3_client)
    assert set(members) == {f"{h}.{ext}" for h in images for ext in ("png", "json")}
    for spec_hash, data in images.items():
        assert members[f"{spec_hash}.png"] == data
        assert json.load(io.BytesIO(members[f"{spec_hash}.json"]))["spec_hash"] == spec_hash
