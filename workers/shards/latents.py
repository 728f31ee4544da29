"""The latent shard format, written by encode and read by training: one parquet row per
sample, its lineage (key, url, caption, source image sha256, seed) beside its tensors, whose
shapes and dtypes the schema metadata describes. No torch here.

Each tensor is one fixed-size binary value per sample, its bytes as the device made them
(fp16 on a GPU), stored uncompressed: reading a column is one copy of its pages, and a row
is a view of it, where the fixed-size lists of earlier shards cost a decompression and a
conversion per element (a 1,000-row SD 2 shard: ~0.04 s against ~2.5 s). Those still
read, through the same functions. zstd gains ~6% on fp16 tensors; the text columns keep it.
"""

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdq.models.datasets import POOLED_EMBEDDINGS as POOLED

METADATA_KEY = b"sdq"
# The columns of a sample's original size and crop (see Encoded.conditions).
CONDITIONS = ("original_width", "original_height", "crop_top", "crop_left")
# What training reads of every shard.
TRAINING_TENSORS = ("latents", "text_embeddings")
# What it reads of an SDXL model's besides: the U-Net's added conditions, by diffusers' names
# (UNet2DConditionModel's added_cond_kwargs), the pooled embeddings and the time ids.
POOLED_CONDITION, TIME_IDS_CONDITION = "text_embeds", "time_ids"


@dataclass(frozen=True)
class Encoded:
    """What the device made of a shard's samples, in the shard's order."""

    seeds: list[int]
    latents: np.ndarray  # samples x channels x height x width
    text_embeddings: np.ndarray  # samples x tokens x hidden size
    token_ids: np.ndarray  # samples x tokens
    # Bucketed or for SDXL: samples x (original width, original height, crop top, crop
    # left), what SDXL's micro-conditioning is made of; stored as int columns of those names.
    conditions: np.ndarray | None = None
    # SDXL: samples x width, its second text encoder's pooled (projected) embedding.
    pooled_embeddings: np.ndarray | None = None

    def tensors(self) -> dict[str, np.ndarray]:
        tensors = {
            "latents": self.latents,
            "text_embeddings": self.text_embeddings,
            "token_ids": self.token_ids,
        }
        if self.pooled_embeddings is not None:
            tensors[POOLED] = self.pooled_embeddings
        return tensors


def latent_shard_bytes(
    lineage: Mapping[str, list[str]], encoded: Encoded, about: dict[str, Any]
) -> bytes:
    """One row per sample: its lineage columns (key, url, caption and source image sha256)
    beside its seed, latents, text embeddings and token ids. The tensors are fixed-size
    binary values; their shapes and dtypes are in the schema metadata under `sdq`, with
    `about`."""
    columns: dict[str, pa.Array] = {
        **{name: pa.array(values, pa.string()) for name, values in lineage.items()},
        "seed": pa.array(encoded.seeds, pa.int64()),
    }
    if encoded.conditions is not None:
        columns.update(zip(CONDITIONS, map(pa.array, encoded.conditions.T), strict=True))
    tensors = encoded.tensors()
    columns.update({name: fixed_size_binary(array) for name, array in tensors.items()})
    metadata = {**about, "tensors": describe(encoded)}
    table = pa.table(columns).replace_schema_metadata({METADATA_KEY: json.dumps(metadata)})
    small = [name for name in columns if name not in tensors]
    buffer = io.BytesIO()
    pq.write_table(
        table,
        buffer,
        compression={name: "zstd" if name in small else "none" for name in columns},
        # A dictionary or min/max statistics of 150 KB values only cost space and time.
        use_dictionary=small,
        write_statistics=small,
    )
    return buffer.getvalue()


def describe(encoded: Encoded) -> dict[str, dict[str, Any]]:
    """Each tensor's shape per sample and dtype, as a reader needs them to unflatten."""
    return {
        name: {"shape": list(array.shape[1:]), "dtype": str(array.dtype)}
        for name, array in encoded.tensors().items()
    }


def fixed_size_binary(array: np.ndarray) -> pa.FixedSizeBinaryArray:
    rows = np.ascontiguousarray(array)
    width = rows.nbytes // len(rows) if len(rows) else rows.dtype.itemsize
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), len(rows), [None, pa.py_buffer(rows)]
    )


def read_tensor(table: pa.Table, name: str) -> np.ndarray:
    """A tensor column of a latent shard in its shape and dtype: samples x the recorded
    shape. A view of the column's memory in the binary layout; a converted copy in the list
    layout of earlier shards."""
    about = json.loads(table.schema.metadata[METADATA_KEY])["tensors"][name]
    shape, dtype = (len(table), *about["shape"]), np.dtype(about["dtype"])
    column = table.column(name).combine_chunks()
    if pa.types.is_fixed_size_binary(column.type):
        data = column.buffers()[1]
        offset = column.offset * column.type.byte_width
        return np.frombuffer(data, dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
    flat = column.values.to_numpy(zero_copy_only=False)
    return flat.reshape(shape).astype(dtype, copy=False)


def read_training_tensors(data: bytes | memoryview) -> dict[str, np.ndarray]:
    """What training reads of a shard's bytes: its `latents` and `text_embeddings`, in the
    dtype they were stored in (views of one copy of their pages, in the binary layout);
    an SDXL model's shard also gives the U-Net's added conditions, by the names diffusers
    gives them: `text_embeds` (the pooled embeddings) and `time_ids`."""
    file = pq.ParquetFile(pa.BufferReader(data))
    sdxl = POOLED in file.schema_arrow.names
    table = file.read(columns=[*TRAINING_TENSORS, *((POOLED, *CONDITIONS) if sdxl else ())])
    tensors = {name: read_tensor(table, name) for name in TRAINING_TENSORS}
    if sdxl:
        tensors[POOLED_CONDITION] = read_tensor(table, POOLED)
        tensors[TIME_IDS_CONDITION] = time_ids(table)
    return tensors


def time_ids(table: pa.Table) -> np.ndarray:
    """SDXL's micro-conditioning of each sample (samples x 6, float32): its original height
    and width, the crop's top and left, and the height and width it was encoded at, in
    that order, as diffusers' SDXL pipeline and training script make them."""
    about = json.loads(table.schema.metadata[METADATA_KEY])
    bucket = about.get("bucket") or {"width": about["resolution"], "height": about["resolution"]}
    width, height, top, left = (table.column(name).to_numpy() for name in CONDITIONS)
    target = np.broadcast_to([bucket["height"], bucket["width"]], (len(table), 2))
    return np.column_stack([height, width, top, left, target]).astype(np.float32)
