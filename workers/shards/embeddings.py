"""The embedding shard format, written by curate: one parquet row per kept sample of an
image shard, its key beside its CLIP image embedding (a fixed-size binary value, fp16, as
latent shards keep tensors), whose width the schema metadata describes. Dedup and
retrieval read these. No torch here."""

import io
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdq.workers.shards.latents import METADATA_KEY, fixed_size_binary, read_tensor

EMBEDDING = "embedding"


def embedding_shard_bytes(
    keys: list[str],
    embeddings: np.ndarray,
    about: dict[str, Any],
    columns: dict[str, pa.Array] | None = None,
) -> bytes:
    """The shard's file; `columns`, any further per-row columns (a dedup cluster's part
    marks its own members)."""
    tensors = {EMBEDDING: {"shape": list(embeddings.shape[1:]), "dtype": str(embeddings.dtype)}}
    table = pa.table(
        {
            "key": pa.array(keys, pa.string()),
            EMBEDDING: fixed_size_binary(embeddings),
            **(columns or {}),
        }
    ).replace_schema_metadata({METADATA_KEY: json.dumps({**about, "tensors": tensors})})
    buffer = io.BytesIO()
    compression = {name: "zstd" for name in table.column_names} | {EMBEDDING: "none"}
    pq.write_table(table, buffer, compression=compression,
                   use_dictionary=["key"], write_statistics=["key"])  # fmt: skip
    return buffer.getvalue()


def read_embeddings(data: bytes) -> tuple[list[str], np.ndarray]:
    """A shard's keys and their embeddings (samples x width), a view of the file's pages."""
    table = pq.read_table(pa.BufferReader(data), columns=["key", EMBEDDING])
    return table.column("key").to_pylist(), read_tensor(table, EMBEDDING)
