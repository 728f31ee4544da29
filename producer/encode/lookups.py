"""The encode jobs' own fields, for the generic listings (a dataset's latents are the
datasets' own questions: producer/datasets/lookups.py)."""

from typing import Any


def spec_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """A job's dataset, image shard, model and resolution, from its spec."""
    return {
        "dataset": spec["dataset"],
        "shard": spec["shard"],
        "model": spec["model_name"],
        "resolution": spec["resolution"],
    }
