"""What a request for images may say, and the job specs it becomes: OpenAI's images request
(so that its clients work unchanged) and sdq's own fields, checked before anything is
written. A problem names its field."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sdq.models.generate.generations import PlannedJob
from sdq.models.generate.settings import GenerateSettings
from sdq.models.generate.specs import SAMPLERS
from sdq.models.specs import ModelIdentity
from sdq.producer.generate.plan import Defaults, plan_jobs
from sdq.producer.prompts import MAX_GUIDANCE, MAX_SEED, PromptRow, parse_size

Sampler = Literal[tuple(SAMPLERS)]  # type: ignore[valid-type]


class ImageRequest(BaseModel):
    """`POST /v1/images/generations` and `POST /v1/jobs`. Fields neither sdq nor OpenAI's
    images API defines are refused (422), so a misspelt one is never silently dropped."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=4000)
    n: int = Field(1, ge=1, description="Images, seeds seed, seed+1, ...")
    size: str | None = Field(None, description="WIDTHxHEIGHT in multiples of 8 [the model's]")
    response_format: Literal["url", "b64_json"] = "url"
    # OpenAI's own optional fields: `user` is recorded on the run; `quality` and `style`
    # are accepted and ignored (here `steps`, `guidance` and the prompt say that).
    user: str | None = Field(None, max_length=256)
    quality: str | None = None
    style: str | None = None
    # sdq's own.
    model: str | None = Field(None, description="As --model names it [sdq serve --model]")
    negative_prompt: str = ""
    steps: int = Field(25, ge=1)
    guidance: float = Field(7.5, ge=0, le=MAX_GUIDANCE)
    sampler: Sampler | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    lora: list[str] = Field(default_factory=list, description="As --lora: NAME[:SCALE]")
    safety_check: bool = False


class Refusal(Exception):
    """A field whose value cannot be served: 422, or 404 for a name that names nothing."""

    def __init__(self, field: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.status = field, message, status


def check_limits(request: ImageRequest, settings: GenerateSettings) -> tuple[int, int] | None:
    """The request's size (None: the model's own), once its numbers are within the
    deployment's limits."""
    if request.n > settings.serve_max_images:
        raise Refusal(
            "n", f"at most {settings.serve_max_images} images a request (SDQ_SERVE_MAX_IMAGES)"
        )
    if request.steps > settings.serve_max_steps:
        raise Refusal("steps", f"at most {settings.serve_max_steps} steps (SDQ_SERVE_MAX_STEPS)")
    if request.size is None:
        return None
    try:
        return parse_size(request.size)
    except ValueError as error:
        raise Refusal("size", str(error)) from None


def planned_jobs(
    request: ImageRequest,
    *,
    size: tuple[int, int] | None,
    model: ModelIdentity,
    loras: tuple[dict[str, Any], ...],
) -> list[PlannedJob]:
    """The request's images as a prompt file's one row would make them."""
    width, height = size or (None, None)
    row = PromptRow(line=1, prompt=request.prompt, negative_prompt=request.negative_prompt)
    defaults = Defaults(
        steps=request.steps,
        guidance=request.guidance,
        width=width,
        height=height,
        seed=request.seed,
        n=request.n,
        sampler=request.sampler,
        safety_check=request.safety_check,
        loras=loras,
    )
    return list(plan_jobs([row], model=model, defaults=defaults))
