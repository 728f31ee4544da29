"""From validated prompt rows to job specs: styles crossed, defaults filled, seeds drawn."""

import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from sdq.models.generate.generations import PlannedJob
from sdq.models.generate.specs import GenerationSpec, sampler_scheduler
from sdq.models.specs import ModelIdentity
from sdq.producer.prompts import MAX_SEED, PromptRow

DEFAULT_TEMPLATE = "{prompt}, {style}"


@dataclass(frozen=True, kw_only=True)
class Defaults:
    """What the command-line flags say for every row that does not say otherwise."""

    steps: int = 25
    guidance: float = 7.5
    width: int | None = None  # None: the model's native size
    height: int | None = None
    seed: int | None = None  # None: a fresh seed per image, drawn now and stored
    n: int = 1
    negative_prompt: str = ""
    dtype: str | None = None  # None: the model's preferred precision
    sampler: str | None = None  # None: the model's own scheduler
    safety_check: bool = False
    # LoRAs as the spec records them (models/loras.resolve_lora), resolved once per run.
    loras: tuple[dict[str, Any], ...] = ()


def plan_jobs(
    rows: Iterable[PromptRow],
    *,
    model: ModelIdentity,
    defaults: Defaults,
    styles: list[str] | None = None,
    template: str = DEFAULT_TEMPLATE,
) -> Iterator[PlannedJob]:
    """Every row times every style (a row's own `style` wins) times its `n` images."""
    for row in rows:
        for style in [row.style] if row.style else (styles or [None]):
            prompt = template.format(prompt=row.prompt, style=style) if style else row.prompt
            for seed in seeds_for(row, defaults):
                spec = _spec(row, prompt=prompt, seed=seed, model=model, defaults=defaults)
                yield PlannedJob(spec=spec, style=style, source_line=row.line, subject=row.prompt)


def seeds_for(row: PromptRow, defaults: Defaults) -> list[int]:
    """A given seed numbers the row's images seed, seed+1, ...; no seed draws fresh ones."""
    count = row.n or defaults.n
    base = row.seed if row.seed is not None else defaults.seed
    if base is None:
        return [secrets.randbelow(2**32) for _ in range(count)]
    return [(base + offset) % (MAX_SEED + 1) for offset in range(count)]


def _spec(
    row: PromptRow, *, prompt: str, seed: int, model: ModelIdentity, defaults: Defaults
) -> GenerationSpec:
    # Steps, sizes and n are never 0, so `or` picks the first given; guidance may be 0.
    negative = row.negative_prompt if row.negative_prompt is not None else defaults.negative_prompt
    scheduler, scheduler_config = model.scheduler, model.scheduler_config
    if defaults.sampler:
        scheduler, scheduler_config = sampler_scheduler(defaults.sampler, scheduler_config)
    width = row.width or defaults.width or model.default_size
    height = row.height or defaults.height or model.default_size
    return GenerationSpec.by_model(
        model.name,
        model.source,
        model.revision,
        scheduler=scheduler,
        scheduler_config=scheduler_config,
        prompt=prompt,
        negative_prompt=negative,
        seed=seed,
        steps=row.steps or defaults.steps,
        guidance=float(row.guidance if row.guidance is not None else defaults.guidance),
        width=width,
        height=height,
        dtype=defaults.dtype or model.default_dtype,
        safety_check=defaults.safety_check,
        loras=list(defaults.loras),
    )
