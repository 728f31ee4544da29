"""Loading pipelines once per worker process and rendering batches. GPU-side: imports torch.

A worker process serves one device (sdq starts one process per GPU with
CUDA_VISIBLE_DEVICES set), loads a pipeline the first time a task needs it, after any
fork, and keeps the last few loaded for the tasks that follow.
"""

import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
from diffusers import AutoPipelineForText2Image, DiffusionPipeline
from diffusers import schedulers as diffusers_schedulers
from diffusers.utils import logging as diffusers_logging
from PIL.Image import Image
from transformers.utils import logging as transformers_logging

from sdq.models import registry, tiny
from sdq.models.specs import GenerationSpec
from sdq.models.store import ObjectStore, S3Store
from sdq.workers.generate.work import PipelineError
from sdq.workers.gpu import device_name

# Loading bars are for notebooks; in a worker's log they are noise.
diffusers_logging.disable_progress_bar()
transformers_logging.disable_progress_bar()


class PipelineCache:
    """The pipelines this process has loaded, least recently used evicted first."""

    def __init__(self, *, store: ObjectStore, cache_dir: Path, size: int) -> None:
        self.store = store
        self.cache_dir = cache_dir
        self.size = size
        self._loaded: OrderedDict[tuple[str, str, str], DiffusionPipeline] = OrderedDict()

    def get(self, spec: GenerationSpec) -> DiffusionPipeline:
        key = (spec.model_source, spec.model_revision, spec.dtype)
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        while len(self._loaded) >= self.size:
            self._loaded.popitem(last=False)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        pipeline = self._load(spec)
        self._loaded[key] = pipeline
        return pipeline

    def _load(self, spec: GenerationSpec) -> DiffusionPipeline:
        dtype = getattr(torch, spec.dtype)
        if spec.model_source == tiny.TINY_NAME:
            pipeline = _build_tiny(spec)
        else:
            pipeline = AutoPipelineForText2Image.from_pretrained(
                **self._location(spec), dtype=dtype
            )
        if pipeline.dtype != dtype:
            pipeline = pipeline.to(dtype=dtype)
        pipeline = pipeline.to(device_name())
        pipeline.set_progress_bar_config(disable=True)
        if torch.cuda.is_available():
            # Convolutions in channels-last layout run on tensor cores without transposes.
            pipeline.unet.to(memory_format=torch.channels_last)
        return pipeline

    def _location(self, spec: GenerationSpec) -> dict[str, str]:
        source = spec.model_source
        if source.startswith(registry.HUB_SOURCE):
            return {
                "pretrained_model_or_path": source.removeprefix(registry.HUB_SOURCE),
                "revision": spec.model_revision,
            }
        if source.startswith("s3://"):
            folder = self._pull(S3Store.from_uri(source), "", spec.model_revision)
        elif source.startswith(registry.STORE_SOURCE):
            prefix = source.removeprefix(registry.STORE_SOURCE)
            folder = self._pull(self.store, f"{prefix}/", spec.model_revision)
        else:
            folder = Path(source)
            if not folder.is_dir():
                raise PipelineError(f"model folder {source} does not exist on this worker")
        return {"pretrained_model_or_path": str(folder)}

    def _pull(self, store: ObjectStore, prefix: str, revision: str) -> Path:
        """Copies a stored pipeline to local disk once per machine, keyed by its revision."""
        folder = self.cache_dir / revision
        if folder.is_dir():
            return folder
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=self.cache_dir, prefix=f".{revision}."))
        try:
            for key in store.list_keys(prefix):
                store.get_file(key, partial / key.removeprefix(prefix))
            # Another process on this machine may have finished first; both copies are equal.
            os.rename(partial, folder)
        except OSError:
            if not folder.is_dir():
                raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return folder


def _build_tiny(spec: GenerationSpec) -> DiffusionPipeline:
    from sdq.workers.generate.tiny import build_pipeline

    if spec.model_revision != tiny.content_hash():
        raise PipelineError(
            f"this worker's tiny model is revision {tiny.content_hash()[:12]}, "
            f"the job asks for {spec.model_revision[:12]}"
        )
    return build_pipeline()


def render(pipeline: DiffusionPipeline, specs: list[GenerationSpec]) -> list[Image]:
    """One pipeline call for specs that share a batch key; each image has its own generator,
    so an image is the same whatever it was batched with."""
    first = specs[0]
    key = first.batch_key()
    if any(spec.batch_key() != key for spec in specs[1:]):
        raise ValueError("render() needs specs with one batch key")
    pipeline.scheduler = _scheduler(first)
    # CPU generators give the same starting noise on every kind of GPU.
    generators = [torch.Generator("cpu").manual_seed(spec.seed) for spec in specs]
    with torch.inference_mode():
        result = pipeline(
            prompt=[spec.prompt for spec in specs],
            negative_prompt=[spec.negative_prompt for spec in specs],
            num_inference_steps=first.steps,
            guidance_scale=first.guidance,
            width=first.width,
            height=first.height,
            generator=generators,
            output_type="pil",
        )
    return result.images


def _scheduler(spec: GenerationSpec):
    scheduler_class = getattr(diffusers_schedulers, spec.scheduler, None)
    if scheduler_class is None:
        raise PipelineError(f"unknown scheduler {spec.scheduler!r}")
    # A fresh scheduler per call: schedulers keep step state that must not leak across batches.
    return scheduler_class.from_config(spec.scheduler_config)
