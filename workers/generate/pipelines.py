"""Loading pipelines once per worker process and rendering batches. GPU-side: imports torch.

A worker process serves one device (sdq starts one process per GPU with
CUDA_VISIBLE_DEVICES set), loads a pipeline the first time a task needs it, after any
fork, and keeps the last few loaded for the tasks that follow, each with the text
encoder's outputs for its recent prompts: a run that crosses subjects with styles repeats
its prompts and negative prompts, and a call encodes only the ones it has not seen.
"""

from collections import OrderedDict
from dataclasses import dataclass, replace
from time import perf_counter

import numpy as np
import torch
from diffusers import AutoPipelineForText2Image, DiffusionPipeline, StableDiffusionPipeline
from diffusers import schedulers as diffusers_schedulers
from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
from PIL.Image import Image
from transformers import CLIPImageProcessor

from sdq.models import tiny
from sdq.models.generate.specs import TILED_DECODE_PIXELS, GenerationSpec
from sdq.workers.generate.shared_prompts import EncoderPrompts, SharedPrompts, text_encoder_digest
from sdq.workers.gpu import device_name, release_device_memory, torch_dtype
from sdq.workers.tiny import build_pipeline
from sdq.workers.weights import ModelFiles, PipelineError, check_tiny_revision


class PromptEmbeddings:
    """The text encoder's output for the last `size` texts (prompts and negative prompts
    alike) of one loaded pipeline, least recently used evicted first; in front of the
    deployment's shared ones (`shared`), where there are.

    Each text's row is a copy of its own: a view would keep its whole call's tensor on the
    device for as long as any one of its texts is kept."""

    def __init__(self, size: int, shared: "EncoderPrompts | None" = None) -> None:
        self.size = size
        self.shared = shared
        self.encoded = 0  # texts the text encoder has run on, for the benchmarks and tests
        self._kept: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __call__(self, pipeline: StableDiffusionPipeline, texts: list[str]) -> torch.Tensor:
        """The embeddings of `texts`, in order; the ones neither kept here nor shared are
        encoded in one call (and shared)."""
        missing = [text for text in dict.fromkeys(texts) if text not in self._kept]
        if missing and self.shared:
            found = self.shared.get(missing)
            self._kept.update((text, row.to(pipeline.device)) for text, row in found.items())
            missing = [text for text in missing if text not in found]
        if missing:
            encoded, _ = pipeline.encode_prompt(missing, pipeline.device, 1, False)
            rows = {text: row.clone() for text, row in zip(missing, encoded, strict=True)}
            self._kept.update(rows)
            self.encoded += len(missing)
            if self.shared:
                self.shared.put(rows)
        for text in texts:
            self._kept.move_to_end(text)
        embeddings = torch.stack([self._kept[text] for text in texts])
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
        return embeddings


@dataclass(eq=False)
class Loaded:
    """A pipeline as a worker keeps it: loaded once, with its prompts' embeddings; when
    compiled, the batch sizes its calls are padded to (the shapes it compiled for)."""

    pipeline: DiffusionPipeline
    prompts: PromptEmbeddings
    batches: tuple[int, ...] = ()


class PipelineCache:
    """The pipelines this process has loaded, least recently used evicted first."""

    def __init__(
        self,
        *,
        files: ModelFiles,
        size: int,
        prompt_cache_size: int = 1024,
        shared_prompts: SharedPrompts | None = None,
        compile_mode: str | None = None,
        compile_batches: tuple[int, ...] = (),
        warm_shapes: tuple[tuple[int, int], ...] = (),
        compile_backend: str = "inductor",
    ) -> None:
        self.files = files
        self.size = size
        self.prompt_cache_size = prompt_cache_size
        self.shared_prompts = shared_prompts
        self.compile_mode = compile_mode
        self.compile_batches = compile_batches if compile_mode else ()
        self.warm_shapes = warm_shapes
        # torch.compile's backend: inductor for work; "eager" traces and guards as it
        # does, without code generation (the tests count recompilations with it).
        self.compile_backend = compile_backend
        self._loaded: OrderedDict[tuple[str, str, torch.dtype], Loaded] = OrderedDict()
        self._checkers: dict[tuple[str, str, torch.dtype], SafetyChecker] = {}

    def get(self, spec: GenerationSpec) -> tuple[Loaded, float | None]:
        """The spec's pipeline, and the seconds it took to load it now (None: it was
        loaded already)."""
        key = (spec.model_source, spec.model_revision, torch_dtype(spec.dtype))
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key], None
        while len(self._loaded) >= self.size:
            self._loaded.popitem(last=False)
            release_device_memory()
        started = perf_counter()
        pipeline = self._load(spec)
        prompts = PromptEmbeddings(self.prompt_cache_size, self._shared(pipeline))
        loaded = Loaded(pipeline, prompts, self.compile_batches)
        warm(loaded, spec, self.warm_shapes)
        self._loaded[key] = loaded
        return loaded, perf_counter() - started

    def _shared(self, pipeline: DiffusionPipeline) -> "EncoderPrompts | None":
        """The deployment's shared embeddings of the pipeline's text encoder, where there
        are (Stable Diffusion pipelines: one text encoder, whose output is all a prompt
        becomes)."""
        if self.shared_prompts is None or not isinstance(pipeline, StableDiffusionPipeline):
            return None
        return self.shared_prompts.for_encoder(text_encoder_digest(pipeline))

    def clear(self) -> None:
        self._loaded.clear()
        self._checkers.clear()
        release_device_memory()

    def safety_checker(self, spec: GenerationSpec) -> "SafetyChecker":
        """The model's own safety checker, loaded the first time a spec asks for it."""
        key = (spec.model_source, spec.model_revision, torch_dtype(spec.dtype))
        if key not in self._checkers:
            self._checkers[key] = self._load_checker(spec)
        return self._checkers[key]

    def _load_checker(self, spec: GenerationSpec) -> "SafetyChecker":
        if spec.model_source == tiny.TINY_NAME:
            raise PipelineError(f"model {spec.model_name} has no safety checker")
        where = self.files.locate(spec.model_source, spec.model_revision)
        try:
            model = StableDiffusionSafetyChecker.from_pretrained(
                where.path, subfolder="safety_checker", revision=where.revision
            )
            features = CLIPImageProcessor.from_pretrained(
                where.path, subfolder="feature_extractor", revision=where.revision
            )
        except OSError as error:
            raise PipelineError(
                f"model {spec.model_name} has no safety checker to run (--safety-check): {error}"
            ) from error
        model = model.to(device_name(), dtype=torch_dtype(spec.dtype)).eval()
        return SafetyChecker(model, features)

    def _load(self, spec: GenerationSpec) -> DiffusionPipeline:
        dtype = torch_dtype(spec.dtype)
        if spec.model_source == tiny.TINY_NAME:
            check_tiny_revision(spec.model_revision)
            pipeline = build_pipeline()
        else:
            where = self.files.locate(spec.model_source, spec.model_revision)
            # Without the model's safety checker: a spec that asks for one runs it apart
            # (SafetyChecker), so a flagged image is known as such, never a black one.
            pipeline = AutoPipelineForText2Image.from_pretrained(
                where.path,
                revision=where.revision,
                dtype=dtype,
                safety_checker=None,
                requires_safety_checker=False,
            )
        if pipeline.dtype != dtype:
            pipeline = pipeline.to(dtype=dtype)
        pipeline = pipeline.to(device_name())
        pipeline.set_progress_bar_config(disable=True)
        if torch.cuda.is_available() or self.compile_mode:
            # Convolutions in channels-last layout run on tensor cores without transposes.
            pipeline.unet.to(memory_format=torch.channels_last)
            pipeline.vae.to(memory_format=torch.channels_last)
        if self.compile_mode:
            compile_pipeline(pipeline, self.compile_mode, backend=self.compile_backend)
        return pipeline


@dataclass(frozen=True)
class SafetyChecker:
    """A model's safety checker as the pipeline would run it, asked only which images it
    flags: the pipeline's own use blacks them out, and a black image would be stored."""

    model: StableDiffusionSafetyChecker
    features: CLIPImageProcessor

    def flagged(self, images: list[Image]) -> list[bool]:
        inputs = self.features(images, return_tensors="pt").pixel_values
        inputs = inputs.to(self.model.device, self.model.dtype)
        # The checker blacks out what it flags in `images`: it gets placeholders.
        placeholders = np.zeros((len(images), 1, 1, 3))
        with torch.inference_mode():
            _, flags = self.model(clip_input=inputs, images=placeholders)
        return [bool(flag) for flag in flags]


def compile_pipeline(pipeline: DiffusionPipeline, mode: str, *, backend: str = "inductor") -> None:
    """The U-Net and the VAE's decoder (the module: the same graph whatever the slicing)
    compiled for static shapes, their attention's Q, K and V projections fused into one
    matmul each (diffusers' recipe for SD on torch 2). On a GPU, "max-autotune" and
    "reduce-overhead" replay each shape's CUDA graph, and cuDNN picks its fastest kernels
    for each shape once. Compiling is lazy: the first call of each shape compiles (warm)."""
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
    pipeline.fuse_qkv_projections()
    options = {"mode": mode} if backend == "inductor" else {"backend": backend}
    pipeline.unet = torch.compile(pipeline.unet, dynamic=False, **options)
    pipeline.vae.decoder = torch.compile(pipeline.vae.decoder, dynamic=False, **options)


def warm(loaded: Loaded, spec: GenerationSpec, shapes: tuple[tuple[int, int], ...]) -> None:
    """Compiles a compiled pipeline for every batch size it pads to at each shape, with
    classifier-free guidance (the U-Net's batch doubled) as a job has it: one step each,
    before any job waits on it."""
    warming = replace(spec, prompt="", negative_prompt="", seed=0, steps=1, guidance=7.5)
    for width, height in shapes if loaded.batches else ():
        for size in loaded.batches:
            render(loaded, [replace(warming, width=width, height=height)] * size)


def render(loaded: Loaded, specs: list[GenerationSpec]) -> list[Image]:
    """One pipeline call for specs that share a batch key; each image has its own generator,
    so an image is the same whatever it was batched with."""
    first = specs[0]
    key = first.batch_key()
    if any(spec.batch_key() != key for spec in specs[1:]):
        raise ValueError("render() needs specs with one batch key")
    pipeline = loaded.pipeline
    pipeline.scheduler = _scheduler(first)
    called = len(specs)
    specs = padded(specs, loaded.batches)
    _set_decoding(pipeline, first, len(specs))
    # CPU generators give the same starting noise on every kind of GPU.
    generators = [torch.Generator("cpu").manual_seed(spec.seed) for spec in specs]
    with torch.inference_mode():
        result = pipeline(
            **_prompts(loaded, specs),
            num_inference_steps=first.steps,
            guidance_scale=first.guidance,
            width=first.width,
            height=first.height,
            generator=generators,
            output_type="pil",
        )
    return result.images[:called]


def padded(specs: list[GenerationSpec], batches: tuple[int, ...]) -> list[GenerationSpec]:
    """The call's specs, then copies of its last up to the next compiled batch size: a
    compiled pipeline meets only the shapes it compiled for. Each image has its own
    generator, so padding changes none of the call's images."""
    size = next((batch for batch in batches if batch >= len(specs)), len(specs))
    return specs + [specs[-1]] * (size - len(specs))


def _set_decoding(pipeline: DiffusionPipeline, spec: GenerationSpec, images: int) -> None:
    """Tiles where the spec says (it changes the pixels); one image at a time where the
    call's images together pass the tiling size (the same pixels, a bounded peak)."""
    vae = pipeline.vae
    if not hasattr(vae, "use_tiling"):
        return
    vae.use_tiling = spec.vae_tiling
    vae.use_slicing = images * spec.width * spec.height > TILED_DECODE_PIXELS


def _prompts(loaded: Loaded, specs: list[GenerationSpec]) -> dict[str, object]:
    """The call's prompts: as embeddings from the kept ones where the pipeline is a Stable
    Diffusion one (one text encoder, whose output is all a prompt becomes), else as text
    for the pipeline to encode."""
    prompts = [spec.prompt for spec in specs]
    negatives = [spec.negative_prompt for spec in specs]
    if not (isinstance(loaded.pipeline, StableDiffusionPipeline) and loaded.prompts.size):
        return {"prompt": prompts, "negative_prompt": negatives}
    return {
        "prompt_embeds": loaded.prompts(loaded.pipeline, prompts),
        "negative_prompt_embeds": loaded.prompts(loaded.pipeline, negatives),
    }


def _scheduler(spec: GenerationSpec):
    scheduler_class = getattr(diffusers_schedulers, spec.scheduler, None)
    if scheduler_class is None:
        raise PipelineError(f"unknown scheduler {spec.scheduler!r}")
    # A fresh scheduler per call: schedulers keep step state that must not leak across batches.
    return scheduler_class.from_config(spec.scheduler_config)
