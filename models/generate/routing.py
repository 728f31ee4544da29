"""Sending generation jobs to a worker that has their pipeline warm: a compiled pipeline
renders a shape it has compiled at once, and any other after minutes of compiling.

A worker that has compiled a pipeline at the deployment's warm shapes (SDQ_COMPILE,
SDQ_WARM_SHAPES) also consumes a queue per (pipeline, shape), named by the spec's warm key;
the hook below gives that key for the specs of those shapes, and a message whose first job
has one goes to its queue when a live worker consumes it (workers/routing.py)."""

from collections.abc import Callable
from typing import Any

from sdq.models.generate.settings import GenerateSettings
from sdq.models.generate.specs import GenerationSpec
from sdq.models.settings import Settings

WarmKey = Callable[[dict[str, Any]], str | None]


def warm_routing(settings: Settings) -> WarmKey | None:
    """The routing hook (models/jobs/kinds.py): a spec's warm key when its size is one the
    deployment warms; None where it warms none."""
    shapes = set(settings.group(GenerateSettings).warm_shapes)
    if not shapes:
        return None

    def warm_key(spec: dict[str, Any]) -> str | None:
        if (spec["width"], spec["height"]) not in shapes:
            return None
        return GenerationSpec.from_dict(spec).warm_key()

    return warm_key
