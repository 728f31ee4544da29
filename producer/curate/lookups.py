"""The curate jobs' own fields, for the generic listings."""

from typing import Any


def spec_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """A scoring job's dataset, image shard and CLIP model; a near-duplicate job's (`sdq
    dataset filter --dedup`) dataset, threshold and cluster, from its spec."""
    if "shard" in spec:
        return {"dataset": spec["dataset"], "shard": spec["shard"], "model": spec["model_name"]}
    cluster = {} if spec["cluster"] is None else {"cluster": spec["cluster"]}
    return {"dataset": spec["dataset"], "threshold": spec["threshold"], **cluster}
