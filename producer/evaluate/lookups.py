"""The evaluate jobs' own fields, for the generic listings."""

from typing import Any


def spec_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """A job's model, its checkpoint's run and step where it scores one, and its metrics."""
    checkpoint = {"run": spec["run"], "step": spec["step"]} if spec.get("run") else {}
    return {"model": spec["model_name"], **checkpoint,
            "metrics": ",".join(spec["evaluation"]["metrics"])}  # fmt: skip
