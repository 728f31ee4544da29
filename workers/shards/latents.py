"""The latent shard format, written by encode and read by training: one parquet row per
sample, its lineage (key, url, caption, source image sha256, seed) beside its tensors, whose
shapes and dtypes the schema metadata describes. No torch here."""

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

METADATA_KEY = b"sdq"


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


def latent_shard_bytes(
    lineage: Mapping[str, list[str]], encoded: Encoded, about: dict[str, Any]
) -> bytes:
    """One row per sample: its lineage columns (key, url, caption and source image sha256)
    beside its seed, latents, text embeddings and token ids. The tensors are fixed-size
    lists, flat; their shapes and dtypes are in the schema metadata under `sdq`, with
    `about`."""
    columns: dict[str, pa.Array] = {
        **{name: pa.array(values, pa.string()) for name, values in lineage.items()},
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
