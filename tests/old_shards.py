"""Latent shards as sdq wrote them before the binary layout (every tensor a fixed-size list
column, zstd), which it still reads: for the tests and the benchmarks to make."""

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdq.workers.shards.latents import METADATA_KEY, Encoded


def list_layout_bytes(tensors: Encoded, lineage: dict[str, list[str]] | None = None) -> bytes:
    """A shard as sdq wrote them before: each tensor a fixed-size list column, zstd."""
    columns = {name: pa.array(values, pa.string()) for name, values in (lineage or {}).items()}
    described = {}
    for name, array in tensors.tensors().items():
        flat = pa.array(np.ascontiguousarray(array).reshape(-1))
        columns[name] = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(array.shape[1:])))
        described[name] = {"shape": list(array.shape[1:]), "dtype": str(array.dtype)}
    table = pa.table(columns).replace_schema_metadata(
        {METADATA_KEY: json.dumps({"tensors": described})}
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()
