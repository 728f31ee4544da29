"""A train run's latent shards, listed once at submit in a manifest in the store (a run over
LAION-2B's ~2M shards would copy ~42 MB into every job's spec): one parquet row a shard,
in the order the run reads them."""

import io
from collections.abc import Sequence

from sdq.models.train.specs import LatentInput


def inputs_key(run: int) -> str:
    return f"train/{run}/inputs.parquet"


def inputs_manifest(inputs: Sequence[LatentInput]) -> bytes:
    """A run's latent shards in their order, as parquet: one row each."""
    import pyarrow as pa  # here: every `sdq` command imports this module, few write parquet
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "uri": pa.array([item.uri for item in inputs], pa.string()),
            "key": pa.array([item.key for item in inputs], pa.string()),
            "samples": pa.array([item.samples for item in inputs], pa.int64()),
            "bucket": pa.array([item.bucket for item in inputs], pa.string()),
        }
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()


def read_inputs_manifest(data: bytes) -> tuple[LatentInput, ...]:
    import pyarrow.parquet as pq

    rows = pq.read_table(io.BytesIO(data)).to_pydict()
    buckets = rows.get("bucket") or [None] * len(rows["key"])  # none before buckets were
    return tuple(
        LatentInput(uri=uri, key=key, samples=samples, bucket=bucket)
        for uri, key, samples, bucket in zip(
            rows["uri"], rows["key"], rows["samples"], buckets, strict=True
        )
    )
