"""The download jobs' own fields, for the generic listings."""

from typing import Any


def spec_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """A job's dataset, shard and the list rows it covers, from its spec."""
    first, last = spec["first_row"], spec["first_row"] + spec["row_count"] - 1
    return {"dataset": spec["dataset"], "shard": spec["shard"], "rows": f"{first}-{last}"}
