"""The curate jobs' own fields, for the generic listings."""

from typing import Any


def spec_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """A job's dataset, image shard and CLIP model, from its spec."""
    return {"dataset": spec["dataset"], "shard": spec["shard"], "model": spec["model_name"]}
