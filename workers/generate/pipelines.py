"""Loading pipelines once per worker process and rendering batches. GPU-side: imports torch.

A worker process serves one device (sdq starts one process per GPU with
CUDA_VISIBLE_DEVICES set), loads a pipeline the first time a task needs it, after any
fork, and keeps the last few loaded for the tasks that follow, each with the text
encoders' outputs for its recent prompts: a run that crosses subjects with styles repeats
its prompts and negative prompts, and a call encodes only the ones it has not seen. A
spec's LoRAs are fused into its pipeline's weights as it loads (the pipeline with them is
one more loaded pipeline, as fast as the base); a compiled worker swaps them into one
compiled pipeline per model instead (loras.py). A compiled pipeline warms from the
kernels another process compiled for the same model and shapes (workers/compiled.py).
"""

import logging
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
from sdq.workers.compiled import artifacts_key, model_architecture, shared_through
from sdq.workers.generate.conditioning import PromptEmbeddings, call_conditioning, family_encoder
from sdq.workers.generate.loras import NotSwappable, fuse_loras, make_swappable, swap_in
from sdq.workers.generate.shared_prompts import EncoderPrompts, SharedPrompts, text_encoder_digest
from sdq.workers.gpu import device_name, release_device_memory, torch_dtype
from sdq.workers.tiny import build_pipeline
from sdq.workers.weights import ModelFiles, PipelineError, check_tiny_revision

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Loaded:
    """A pipeline as a worker keeps it: loaded once, with its prompts' embeddings (None: a
    pipeline of a family sdq does not encode for, given the texts); when compiled, the
    batch sizes its calls are padded to (the shapes it compiled for)."""

    pipeline: DiffusionPipeline
    prompts: PromptEmbeddings | None
    batches: tuple[int, ...] = ()
    warm_keys: tuple[str, ...] = ()  # the shapes it compiled at load, by the specs' warm key
    # A compiled pipeline that takes LoRAs by swapping (loras.py): the LoRA set it holds.
    lora_set: list[list[Any]] | None = None


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
        lora_swap_rank: int = 0,
        channels_last: bool = False,
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
        # A compiled worker's LoRAs go into one pipeline per model, swapped (loras.py).
        self.lora_swap_rank = lora_swap_rank if compile_mode else 0
        self.channels_last = channels_last
        self._loaded: OrderedDict[tuple[Any, ...], Loaded] = OrderedDict()
        self._checkers: dict[tuple[str, str, torch.dtype], SafetyChecker] = {}
        # LoRA sets (by model and files) found not to fit the swapping adapter: fused.
        self._unswappable: set[tuple[Any, ...]] = set()

    def get(self, spec: GenerationSpec) -> tuple[Loaded, float | None]:
        """The spec's pipeline, and the seconds it took to load it now, LoRAs swapped in
        included (None: it was loaded already)."""
        model = (spec.model_source, spec.model_revision, torch_dtype(spec.dtype))
        files = (*model, *(lora["sha256"] for lora in spec.loras))
        if spec.loras and self.lora_swap_rank and files not in self._unswappable:
            try:
                return self._swapped(spec, (*model, "swapping"))
            except NotSwappable as why:
                self._unswappable.add(files)
                logger.info("LoRAs %s fused into a pipeline of their own: %s", files[3:], why)
        key = (*model, *map(tuple, spec.lora_identity()))
        return self._cached(spec, key, swapping=False)

    def _swapped(self, spec: GenerationSpec, key: tuple[Any, ...]) -> tuple[Loaded, float | None]:
        """The model's swapping pipeline, holding the spec's LoRAs (swapped in now where it
        held others: no load, no compile)."""
        loaded, seconds = self._cached(spec, key, swapping=True)
        if loaded.lora_set == spec.lora_identity():
            return loaded, seconds
        started = perf_counter()
        try:
            swap_in(loaded.pipeline, spec, self._lora_files(spec), self.lora_swap_rank)
        except (NotSwappable, PipelineError):
            raise  # found before the adapter was touched
        except BaseException:
            # A swap that failed part way (diffusers then deletes the adapter) leaves the
            # pipeline holding no known set: let it go, and load it anew when next asked.
            del self._loaded[key]
            raise
        loaded.lora_set = spec.lora_identity()
        return loaded, (seconds or 0.0) + perf_counter() - started

    def _cached(
        self, spec: GenerationSpec, key: tuple[Any, ...], *, swapping: bool
    ) -> tuple[Loaded, float | None]:
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key], None
        while len(self._loaded) >= self.size:
            self._loaded.popitem(last=False)
            release_device_memory()
        started = perf_counter()
        pipeline = self._load(spec, swapping=swapping)
        loaded = Loaded(pipeline, self._embeddings(pipeline), self.compile_batches)
        self._warm(loaded, spec, swapping=swapping)
        self._loaded[key] = loaded
        return loaded, perf_counter() - started

    def _warm(self, loaded: Loaded, spec: GenerationSpec, *, swapping: bool) -> None:
        """Compiles the warm shapes, from the kernels another process compiled for the same
        pipeline where the store has them, and leaves what this one compiled there."""
        if not (loaded.batches and self.warm_shapes):
            return
        key = self._artifacts_key(loaded.pipeline, swapping=swapping)
        with shared_through(self.files.store, key) as figures:
            loaded.warm_keys = warm(loaded, spec, self.warm_shapes)
        logger.info("warm shapes compiled: %s", figures)

    def _artifacts_key(self, pipeline: DiffusionPipeline, *, swapping: bool) -> str:
        # A fused LoRA's weights change no kernel: only the swapping adapter does.
        decided_by = {
            "unet": model_architecture(pipeline.unet),
            "vae": model_architecture(pipeline.vae),
            "dtype": str(pipeline.dtype),
            "mode": self.compile_mode,
            "backend": self.compile_backend,
            "shapes": self.warm_shapes,
            "batches": self.compile_batches,
            "lora_swap_rank": self.lora_swap_rank if swapping else None,
            "channels_last": self.channels_last,
        }
        return artifacts_key("generate", decided_by, pipeline.device)

    def _lora_files(self, spec: GenerationSpec) -> list[Path]:
        return [self.files.lora_file(lora["source"], lora["sha256"]) for lora in spec.loras]

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

    def _load(self, spec: GenerationSpec, *, swapping: bool) -> DiffusionPipeline:
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
        if spec.loras and not swapping:
            fuse_loras(pipeline, spec, self._lora_files(spec))
        if self.channels_last and (torch.cuda.is_available() or self.compile_mode):
            # Convolutions in channels-last layout run on tensor cores without transposes.
            pipeline.unet.to(memory_format=torch.channels_last)
            pipeline.vae.to(memory_format=torch.channels_last)
        if swapping:
            make_swappable(pipeline, self.lora_swap_rank)
        if self.compile_mode:
            # The U-Net's Q, K and V fused into one projection would leave swapped LoRAs out.
            compile_pipeline(pipeline, self.compile_mode, backend=self.compile_backend,
                             fuse_unet_qkv=not swapping)  # fmt: skip
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


def compile_pipeline(
    pipeline: DiffusionPipeline, mode: str, *, backend: str = "inductor", fuse_unet_qkv: bool = True
) -> None:
    """The U-Net and the VAE's decoder (the module: the same graph whatever the slicing)
    compiled for static shapes, their attention's Q, K and V projections fused into one
    matmul each (diffusers' recipe for SD on torch 2). On a GPU, "max-autotune" and
    "reduce-overhead" replay each shape's CUDA graph, and cuDNN picks its fastest kernels
    for each shape once. Compiling is lazy: the first call of each shape compiles (warm)."""
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
    pipeline.fuse_qkv_projections(unet=fuse_unet_qkv, vae=True)
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
