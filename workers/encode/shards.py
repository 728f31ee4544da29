"""Parquet in and out for encoding, on the CPU: the kept samples of an image shard, their
pixels at the encoding resolution, and the latent shard written with what it holds
described in its schema metadata. No torch here."""

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image

from sdq.models.datasets import ImageOptions, SampleStatus
from sdq.workers.download.images import resize, to_rgb

METADATA_KEY = b"sdq"


@dataclass(frozen=True)
class ImageShard:
    """The samples of one image shard that kept an image, in key order."""

    keys: list[str]
    urls: list[str]
    captions: list[str]
    sha256s: list[str]
    images: list[bytes]

    def __len__(self) -> int:
        return len(self.keys)


def read_image_shard(data: bytes, image_column: str) -> ImageShard:
    table = pq.read_table(
        io.BytesIO(data), columns=["key", "url", "caption", "sha256", "status", image_column]
    )
    kept = table.filter(pc.equal(table["status"], SampleStatus.success))
    return ImageShard(
        keys=kept["key"].to_pylist(),
        urls=kept["url"].to_pylist(),
        captions=kept["caption"].to_pylist(),
        sha256s=kept["sha256"].to_pylist(),
        images=kept[image_column].to_pylist(),
    )


def pixels(data: bytes, resolution: int) -> np.ndarray:
    """An image as uint8 RGB, height x width x 3, center-cropped to the resolution (a
    no-op for a dataset already made at it)."""
    with Image.open(io.BytesIO(data)) as image:
        if image.format == "JPEG" and min(image.size) >= 2 * resolution:
            image.draft("RGB", (image.width // 2, image.height // 2))
        square = resize(to_rgb(image), ImageOptions(resolution=resolution))
        return np.asarray(square)


@dataclass(frozen=True)
class Encoded:
    """What the device made of a shard's samples, in the shard's order."""

    seeds: list[int]
    latents: np.ndarray  # samples x channels x height x width
    text_embeddings: np.ndarray  # samples x tokens x hidden size
    token_ids: np.ndarray  # samples x tokens

    def tensors(self) -> dict[str, np.ndarray]:
        return {
            "latents": self.latents,
            "text_embeddings": self.text_embeddings,
            "token_ids": self.token_ids,
        }


def latent_shard_bytes(shard: ImageShard, encoded: Encoded, about: dict[str, Any]) -> bytes:
    """One row per sample: its key, url, caption and source image sha256 beside its seed,
    latents, text embeddings and token ids. The tensors are fixed-size lists, flat; their
    shapes and dtypes are in the schema metadata under `sdq`, with `about`."""
    columns: dict[str, pa.Array] = {
        "key": pa.array(shard.keys, pa.string()),
        "url": pa.array(shard.urls, pa.string()),
        "caption": pa.array(shard.captions, pa.string()),
        "sha256": pa.array(shard.sha256s, pa.string()),
        "seed": pa.array(encoded.seeds, pa.int64()),
    }
    columns.update({name: _fixed_size_list(array) for name, array in encoded.tensors().items()})
    metadata = {**about, "tensors": describe(encoded)}
    table = pa.table(columns).replace_schema_metadata({METADATA_KEY: json.dumps(metadata)})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()


def describe(encoded: Encoded) -> dict[str, dict[str, Any]]:
    """Each tensor's shape per sample and dtype, as a reader needs them to unflatten."""
    return {
        name: {"shape": list(array.shape[1:]), "dtype": str(array.dtype)}
        for name, array in encoded.tensors().items()
    }


def _fixed_size_list(array: np.ndarray) -> pa.FixedSizeListArray:
    flat = np.ascontiguousarray(array).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), int(np.prod(array.shape[1:])))


def read_tensor(table: pa.Table, name: str) -> np.ndarray:
    """A tensor column of a latent shard back in its shape: samples x the recorded shape."""
    about = json.loads(table.schema.metadata[METADATA_KEY])["tensors"][name]
    column = table.column(name).combine_chunks()
    flat = column.values.to_numpy(zero_copy_only=False)
    return flat.reshape(len(table), *about["shape"]).astype(about["dtype"], copy=False)
