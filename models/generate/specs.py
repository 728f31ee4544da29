"""A generation's specification: everything that decides an image, and the hash that names
it; the samplers people know by name; and how jobs are batched into calls."""

from dataclasses import dataclass, field
from typing import Any

from sdq.models.specs import SPEC_VERSION, ModelIdentity, canonical_sha256

# Images of more pixels than this are decoded by the VAE in tiles: a whole 2048x2048
# decode alone takes more memory than most GPUs have.
TILED_DECODE_PIXELS = 1536 * 1536


# The sampler names common Stable Diffusion tools print in their `parameters` text.
SAMPLER_NAMES = {
    "EulerDiscreteScheduler": "Euler",
    "EulerAncestralDiscreteScheduler": "Euler a",
    "DPMSolverMultistepScheduler": "DPM++ 2M",
    "DDIMScheduler": "DDIM",
    "PNDMScheduler": "PLMS",
    "LMSDiscreteScheduler": "LMS",
    "HeunDiscreteScheduler": "Heun",
    "UniPCMultistepScheduler": "UniPC",
    "DDPMScheduler": "DDPM",
}


# `--sampler NAME`: the diffusers scheduler it is, and what it sets in the model's
# scheduler config (the names A1111 and ComfyUI users know). The class and the config are
# in the spec, and so in its hash: each sampler makes other images.
DPMPP_2M = {"algorithm_type": "dpmsolver++", "solver_order": 2}
SAMPLERS: dict[str, tuple[str, dict[str, Any]]] = {
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "ddim": ("DDIMScheduler", {}),
    "ddpm": ("DDPMScheduler", {}),
    "pndm": ("PNDMScheduler", {"skip_prk_steps": True}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", DPMPP_2M),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", {**DPMPP_2M, "use_karras_sigmas": True}),
    "unipc": ("UniPCMultistepScheduler", {}),
}


def sampler_scheduler(name: str, model_config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The scheduler class and config of sampler NAME for a model: the model's own noise
    schedule (betas, prediction type, timestep spacing) with the sampler's settings. Keys
    of the model's own scheduler that the sampler's class does not take, it ignores."""
    scheduler, settings = SAMPLERS[name]
    return scheduler, {**model_config, **settings}


@dataclass(frozen=True, kw_only=True)
class GenerationSpec:
    model_name: str
    model_source: str
    model_revision: str
    scheduler: str
    scheduler_config: dict[str, Any]
    prompt: str
    negative_prompt: str
    seed: int
    steps: int
    guidance: float
    width: int
    height: int
    dtype: str
    # The VAE decodes in overlapping tiles, blended: memory bounded whatever the size, and
    # slightly other pixels than a whole decode, so it is in the spec (TILED_DECODE_PIXELS).
    vae_tiling: bool = False
    # Each image through the model's safety checker (`--safety-check`); a flagged one is
    # recorded as flagged and never stored. Off by default, as most serving runs it.
    safety_check: bool = False
    # LoRA weights fused into the model at render time, in order (`--lora`, models/loras.py):
    # each {"name", "source", "sha256", "scale"}; only the content and scale are the image's.
    loras: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def by_model(cls, name: str, source: str, revision: str, **render: Any) -> "GenerationSpec":
        """A render by the model named so, of the `render` fields (prompt, seed, size...):
        how every spec is made, a submit's and a training's validation alike, so that what
        follows from them (tiling a large decode) is decided once."""
        tiled = render["width"] * render["height"] > TILED_DECODE_PIXELS
        return cls(model_name=name, model_source=source, model_revision=revision,
                   vae_tiling=tiled, **render)  # fmt: skip

    @classmethod
    def warming(cls, model: ModelIdentity) -> "GenerationSpec":
        """A render of the model's pipeline as jobs load it by default (its precision, no
        LoRA), for a worker to warm up on before it takes any."""
        return cls.by_model(
            model.name, model.source, model.revision, scheduler=model.scheduler,
            scheduler_config=model.scheduler_config, prompt="", negative_prompt="", seed=0,
            steps=1, guidance=7.5, width=model.default_size, height=model.default_size,
            dtype=model.default_dtype,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict (a recursive deep copy), nor fields() (a quarter of a
        # second per 100k specs): the instance's __dict__ holds exactly its fields, in
        # order. Only scheduler_config and loras are mutable, so only they are copied.
        data = dict(vars(self))
        data["scheduler_config"] = dict(self.scheduler_config)
        data["loras"] = [dict(lora) for lora in self.loras]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GenerationSpec":
        return cls(**data)

    def identity(self) -> dict[str, Any]:
        """What the hash is taken of. The name and source say where a model was found, not
        what it is: two names for one revision render identical images, so only the
        revision is part of it."""
        identity = self.to_dict()
        del identity["model_name"], identity["model_source"]
        # As specs were before these fields: their hashes stay theirs.
        if not self.vae_tiling:
            del identity["vae_tiling"]
        if not self.safety_check:
            del identity["safety_check"]
        if self.loras:
            identity["loras"] = self.lora_identity()
        else:
            del identity["loras"]
        identity["version"] = SPEC_VERSION
        return identity

    def hash(self) -> str:
        return canonical_sha256(self.identity())

    def warm_key(self) -> str:
        """Names a compiled pipeline warm at this spec's size (models/generate/routing.py):
        the model's revision and dtype make the pipeline, the size its shape. A compiled
        worker swaps LoRAs into one pipeline of the model (workers/generate/loras.py), so
        every LoRA set shares one key, apart from the base."""
        with_loras = ["swapped"] if self.loras else []  # [] as the base's key always was
        pipeline = canonical_sha256([self.model_revision, self.dtype, with_loras])
        return f"{pipeline[:16]}.{self.width}x{self.height}"

    def lora_identity(self) -> list[list[Any]]:
        """What the LoRAs make of the model: each one's content and scale, in order."""
        return [[lora["sha256"], float(lora["scale"])] for lora in self.loras]

    def batch_key(self) -> str:
        """Specs with equal keys can share one pipeline call."""
        return canonical_sha256(
            [
                self.model_revision,
                self.model_source,
                self.scheduler,
                self.scheduler_config,
                self.steps,
                self.guidance,
                self.width,
                self.height,
                self.dtype,
                # Only where there are: keys of specs without LoRAs stay as they were.
                *([self.lora_identity()] if self.loras else []),
            ]
        )[:32]


def batches(planned: list[tuple[int, str]], size: int) -> list[list[int]]:
    """Groups (job id, batch key) pairs into lists of at most `size` ids sharing a batch key."""
    groups: dict[str, list[int]] = {}
    for job_id, key in planned:
        groups.setdefault(key, []).append(job_id)
    return [
        ids[start : start + size] for ids in groups.values() for start in range(0, len(ids), size)
    ]


@dataclass(frozen=True, kw_only=True)
class FixedRenders:
    """Renders another run asks of a model at each of its checkpoints, with fixed prompts,
    seeds and settings (validation images, an evaluation's renders): the same at every
    checkpoint, so that what changes in them is what training changed."""

    prompts: tuple[tuple[str, int], ...]  # (prompt, seed)
    size: int
    scheduler: str
    dtype: str
    steps: int = 25
    guidance: float = 7.5
    # The scheduler's settings every model is rendered with, where they are fixed too (an
    # evaluation's: a checkpoint and a base compared on the same sampler); None: the
    # model's own.
    scheduler_config: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FixedRenders":
        prompts = tuple((prompt, seed) for prompt, seed in data["prompts"])
        return cls(**{**data, "prompts": prompts})

    def specs(
        self,
        model: tuple[str, str, str],
        scheduler_config: dict[str, Any],
        loras: tuple[dict[str, Any], ...] = (),
    ) -> list[GenerationSpec]:
        """A render of each prompt by the model (name, source, revision), with `loras` (as
        a spec records them) applied."""
        return [
            self._spec(model, scheduler_config, loras, prompt, seed)
            for prompt, seed in self.prompts
        ]

    def _spec(
        self,
        model: tuple[str, str, str],
        scheduler_config: dict[str, Any],
        loras: tuple[dict[str, Any], ...],
        prompt: str,
        seed: int,
    ) -> GenerationSpec:
        return GenerationSpec.by_model(
            *model, scheduler=self.scheduler, prompt=prompt,
            scheduler_config=self.scheduler_config or scheduler_config,
            negative_prompt="", seed=seed, steps=self.steps, guidance=self.guidance,
            width=self.size, height=self.size, dtype=self.dtype, loras=list(loras),
        )  # fmt: skip


def image_key(spec_hash: str) -> str:
    return f"images/{spec_hash}.png"
