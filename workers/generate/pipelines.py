"""Loading pipelines once per worker process and rendering batches. GPU-side: imports torch.

A worker process serves one device (sdq starts one process per GPU with
CUDA_VISIBLE_DEVICES set), loads a pipeline the first time a task needs it, after any
fork, and keeps the last few loaded for the tasks that follow, each with the text
encoders' outputs for its recent prompts: a run that crosses subjects with styles repeats
its prompts and negative prompts, and a call encodes only the ones it has not seen. A
spec's LoRAs are fused into its pipeline's weights as it loads: the pipeline with them is
one more loaded pipeline, as fast as the base.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import torch
from diffusers import AutoPipelineForText2Image, DiffusionPipeline
from diffusers import schedulers as diffusers_schedulers
from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
from PIL.Image import Image
from transformers import CLIPImageProcessor

from sdq.models import tiny
from sdq.models.generate.specs import TILED_DECODE_PIXELS, GenerationSpec
from sdq.workers.generate.conditioning import PromptEmbeddings, call_conditioning, family_encoder
from sdq.workers.generate.shared_prompts import EncoderPrompts, SharedPrompts, text_encoder_digest
from sdq.workers.gpu import device_name, release_device_memory, torch_dtype
from sdq.workers.tiny import build_pipeline
from sdq.workers.weights import ModelFiles, PipelineError, check_tiny_revision


@dataclass(eq=False)
class Loaded:
    """A pipeline as a worker keeps it: loaded once, with its prompts' embeddings (None: a
    pipeline of a family sdq does not encode for, given the texts); when compiled, the
    batch sizes its calls are padded to (the shapes it compiled for)."""

    pipeline: DiffusionPipeline
    prompts: PromptEmbeddings | None
    batches: tuple[int, ...] = ()
    warm_keys: tuple[str, ...] = ()  # the shapes it compiled at load, by the specs' warm key


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
        self._loaded: OrderedDict[tuple[Any, ...], Loaded] = OrderedDict()
        self._checkers: dict[tuple[str, str, torch.dtype], SafetyChecker] = {}

    def get(self, spec: GenerationSpec) -> tuple[Loaded, float | None]:
        """The spec's pipeline, and the seconds it took to load it now (None: it was
        loaded already)."""
        key = (spec.model_source, spec.model_revision, torch_dtype(spec.dtype),
               *map(tuple, spec.lora_identity()))  # fmt: skip
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key], None
        while len(self._loaded) >= self.size:
            self._loaded.popitem(last=False)
            release_device_memory()
        started = perf_counter()
        pipeline = self._load(spec)
        loaded = Loaded(pipeline, self._embeddings(pipeline), self.compile_batches)
        loaded.warm_keys = warm(loaded, spec, self.warm_shapes)
        self._loaded[key] = loaded
        return loaded, perf_counter() - started

    def _embeddings(self, pipeline: DiffusionPipeline) -> PromptEmbeddings | None:
        """The pipeline's kept embeddings, in front of the deployment's shared ones for its
        text encoders (as they run, LoRAs fused), where there are."""
        encode = family_encoder(pipeline)
        if encode is None:
            return None
        shared: EncoderPrompts | None = None
        if self.shared_prompts is not None:
            shared = self.shared_prompts.for_encoder(text_encoder_digest(pipeline))
        return PromptEmbeddings(encode, self.prompt_cache_size, shared)

    def warm_keys(self) -> set[str]:
        """The (pipeline, shape) pairs this process has compiled, by the specs' warm key."""
        return {key for loaded in self._loaded.values() for key in loaded.warm_keys}

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
        if spec.loras:
            files = [self.files.lora_file(lora["source"], lora["sha256"]) for lora in spec.loras]
            fuse_loras(pipeline, spec, files)
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


def fuse_loras(pipeline: DiffusionPipeline, spec: GenerationSpec, files: list[Path]) -> None:
    """Fuses the spec's LoRAs into the pipeline's weights at their scales (diffusers'
    load_lora_weights, set_adapters, fuse_lora), then lets their layers go: the fused
    pipeline runs as fast as the base. Before compiling and fusing Q, K and V, whose
    module names the LoRAs' keys are written against."""
    names = [f"lora_{index}" for index in range(len(files))]
    for name, path, lora in zip(names, files, spec.loras, strict=True):
        try:
            pipeline.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
        except torch.OutOfMemoryError:
            raise
        except (ValueError, KeyError, RuntimeError) as error:
            raise PipelineError(
                f"LoRA {lora['name']} cannot apply to model {spec.model_name}: {error}"
            ) from error
    applied = {name for adapters in pipeline.get_list_adapters().values() for name in adapters}
    for name, lora in zip(names, spec.loras, strict=True):
        if name not in applied:  # diffusers only warns of a LoRA that matches no module
            raise PipelineError(
                f"LoRA {lora['name']} has no weights for model {spec.model_name}'s modules"
            )
    pipeline.set_adapters(names, adapter_weights=[float(lora["scale"]) for lora in spec.loras])
    pipeline.fuse_lora(adapter_names=names, lora_scale=1.0)
    pipeline.unload_lora_weights()


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


def warm(
    loaded: Loaded, spec: GenerationSpec, shapes: tuple[tuple[int, int], ...]
) -> tuple[str, ...]:
    """Compiles a compiled pipeline for every batch size it pads to at each shape, with
    classifier-free guidance (the U-Net's batch doubled) as a job has it: one step each,
    before any job waits on it. Returns the warm keys of the shapes it compiled."""
    warming = replace(spec, prompt="", negative_prompt="", seed=0, steps=1, guidance=7.5)
    keys = []
    for width, height in shapes if loaded.batches else ():
        shaped = replace(warming, width=width, height=height)
        for size in loaded.batches:
            render(loaded, [shaped] * size)
        keys.append(shaped.warm_key())
    return tuple(keys)


class GaveWay(Exception):
    """A pipeline call stopped between two of its steps for work someone waits for."""


def render(
    loaded: Loaded, specs: list[GenerationSpec], *, give_way: Callable[[], bool] | None = None
) -> list[Image]:
    """One pipeline call for specs that share a batch key; each image has its own generator,
    so an image is the same whatever it was batched with. `give_way` is asked after each
    step: when it says so, the call stops there (GaveWay), its images not made."""
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
            **({"callback_on_step_end": _stopping_when(give_way)} if give_way else {}),
        )
    return result.images[:called]


def _stopping_when(give_way: Callable[[], bool]):
    """A step-end callback that stops the call where `give_way` says so; not after its
    last step, when the images are all but made."""

    def at_step_end(pipeline, step: int, _timestep, tensors: dict) -> dict:
        if step + 1 < getattr(pipeline, "num_timesteps", step + 2) and give_way():
            raise GaveWay
        return tensors

    return at_step_end


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
    """The call's prompts: as the text encoders' outputs, from the kept ones, where sdq
    knows the pipeline's family (conditioning.py), else as text for it to encode."""
    prompts = [spec.prompt for spec in specs]
    negatives = [spec.negative_prompt for spec in specs]
    if loaded.prompts is None:
        return {"prompt": prompts, "negative_prompt": negatives}
    return call_conditioning(loaded.prompts, loaded.pipeline, prompts, negatives)


def _scheduler(spec: GenerationSpec):
    scheduler_class = getattr(diffusers_schedulers, spec.scheduler, None)
    if scheduler_class is None:
        raise PipelineError(f"unknown scheduler {spec.scheduler!r}")
    # A fresh scheduler per call: schedulers keep step state that must not leak across batches.
    return scheduler_class.from_config(spec.scheduler_config)
