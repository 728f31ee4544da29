"""SDXL pipelines and LoRA weights at render time: a tiny SDXL pipeline built in code (two
text encoders, pooled embeddings, time ids) and tiny random LoRAs in diffusers' format,
each rendered by sdq and compared with diffusers' own pipeline called as its users call it."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from torch._dynamo.utils import counters
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from sdq.models import tiny
from sdq.models.generate.specs import GenerationSpec
from sdq.models.loras import resolve_lora
from sdq.models.registry import resolve_model, tiny_identity
from sdq.models.store import LocalStore
from sdq.producer.generate.plan import Defaults, plan_jobs
from sdq.producer.prompts import PromptRow
from sdq.workers.generate.pipelines import PipelineCache, render
from sdq.workers.generate.shared_prompts import PREFIX, SharedPrompts, text_encoder_digest
from sdq.workers.tiny import build_pipeline, build_tokenizer, build_vae, fill_weights
from sdq.workers.weights import ModelFiles, PipelineError
from tests.conftest import BUCKET, write
from tests.test_rendering import close, diffusers_renders, images_by_seed, pixels, run_json

# Its tests share a module-wide fixture: in one test process when run in parallel.
pytestmark = pytest.mark.xdist_group("test_sdxl_lora")

POOLED = 16  # the second text encoder's projection: the pooled embedding's width
TIME_IDS = 8  # each of SDXL's six time ids (sizes, crop) embedded this wide


def text_encoder(kind: type, seed: int):
    vocab = tiny.tokenizer_vocab()
    end = vocab["<|endoftext|>"]
    config = CLIPTextConfig(vocab_size=len(vocab), bos_token_id=vocab["<|startoftext|>"],
                            eos_token_id=end, pad_token_id=end,
                            **{**tiny.TEXT_ENCODER_CONFIG, "projection_dim": POOLED})  # fmt: skip
    encoder = kind(config)
    fill_weights(encoder, seed=seed)
    return encoder


def build_sdxl() -> StableDiffusionXLPipeline:
    """SDXL's structure at toy size: the U-Net attends to both encoders' hidden states side
    by side and adds the pooled embedding and the time ids to its timestep embedding."""
    width = tiny.TEXT_ENCODER_CONFIG["hidden_size"]
    unet = UNet2DConditionModel(**{**tiny.UNET_CONFIG, "cross_attention_dim": 2 * width,
                                   "addition_embed_type": "text_time",
                                   "addition_time_embed_dim": TIME_IDS,
                                   "projection_class_embeddings_input_dim": 6 * TIME_IDS + POOLED,
                                   "use_linear_projection": True})  # fmt: skip
    fill_weights(unet, seed=11)
    return StableDiffusionXLPipeline(
        vae=build_vae(),
        text_encoder=text_encoder(CLIPTextModel, seed=12),
        text_encoder_2=text_encoder(CLIPTextModelWithProjection, seed=13),
        tokenizer=build_tokenizer(),
        tokenizer_2=build_tokenizer(),
        unet=unet,
        scheduler=EulerDiscreteScheduler.from_config(tiny.SCHEDULER_CONFIG),
        force_zeros_for_empty_prompt=True,
    )


@pytest.fixture(scope="module")
def sdxl_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-sdxl"
    build_sdxl().save_pretrained(folder)
    return folder


def save_lora(pipeline, folder: Path, *, seed: int, alpha: int = 4,
              targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")) -> Path:  # fmt: skip
    """Random LoRA weights of rank 4 for the U-Net's attention, saved as diffusers' LoRA
    training script saves its (peft's layers, diffusers' file; an alpha other than the rank
    in the file's adapter config, as peft's trainers write it). U-Net only: transformers 5
    loads a text encoder's LoRA only with peft >= 0.22, which the package index here lacks."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=4, lora_alpha=alpha, init_lora_weights=False, target_modules=list(targets)
    )
    pipeline.unet.add_adapter(config)
    layers = get_peft_model_state_dict(pipeline.unet)
    metadata = config.to_dict() if alpha != 4 else None
    type(pipeline).save_lora_weights(folder, unet_lora_layers=layers,
                                     unet_lora_adapter_metadata=metadata)  # fmt: skip
    return folder / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory) -> Path:
    return save_lora(build_pipeline(), tmp_path_factory.mktemp("lora"), seed=5)


def cache(tmp_path: Path, size: int = 1, **options) -> PipelineCache:
    files = ModelFiles(LocalStore(tmp_path / "store"), tmp_path / "cache")
    return PipelineCache(files=files, size=size, **options)


def planned(model, *prompts: str, **defaults) -> list[GenerationSpec]:
    rows = [PromptRow(line=n + 2, prompt=prompt) for n, prompt in enumerate(prompts)]
    options = {"seed": 3, "steps": 3, "dtype": "float32", **defaults}
    return [job.spec for job in plan_jobs(rows, model=model, defaults=Defaults(**options))]


def test_an_sdxl_pipeline_renders_as_diffusers_does_its_texts_encoded_once(
    sdxl_folder, redis_port, tmp_path
) -> None:
    """Both encoders' hidden states and the pooled embedding come from the kept (and the
    shared) embeddings, the empty negative prompt as zeros as SDXL has it without one, and
    the images are the ones diffusers' SDXL pipeline makes from the texts."""
    model = resolve_model(str(sdxl_folder), store=None, session=None)
    assert model.default_size == tiny.UNET_CONFIG["sample_size"] * 8
    calls = [planned(model, "a cat", "a boat", "a cat"), planned(model, "a boat", "a dog")]
    url = f"redis://127.0.0.1:{redis_port}/5"
    redis.Redis.from_url(url).flushdb()

    rendered = []
    for _ in range(2):  # two workers sharing one Redis
        loaded, _ = cache(tmp_path, shared_prompts=SharedPrompts(url, 100)).get(calls[0][0])
        assert isinstance(loaded.pipeline, StableDiffusionXLPipeline)
        rendered.append([image for call in calls for image in render(loaded, call)])
        encoded = loaded.prompts.encoded
        assert encoded == (4 if len(rendered) == 1 else 0)  # cat, boat, the empty text, dog
    for kept in loaded.prompts._kept.values():
        assert set(kept) == {"prompt_embeds", "pooled_prompt_embeds"}
        assert kept["prompt_embeds"].shape[-1] == 2 * tiny.TEXT_ENCODER_CONFIG["hidden_size"]
        assert kept["pooled_prompt_embeds"].shape == (POOLED,)
    first, second = rendered
    assert all(np.array_equal(pixels(a), pixels(b)) for a, b in zip(first, second, strict=True))

    reference = StableDiffusionXLPipeline.from_pretrained(sdxl_folder)
    for call, made in zip(calls, (first[:3], first[3:]), strict=True):
        close(made, diffusers_renders(reference, call))

    # The spec's hash covers both text encoders: another second encoder, another model.
    changed = tmp_path / "tiny-sdxl-other"
    shutil.copytree(sdxl_folder, changed)
    other = StableDiffusionXLPipeline.from_pretrained(changed)
    fill_weights(other.text_encoder_2, seed=99)
    other.text_encoder_2.save_pretrained(changed / "text_encoder_2")
    other_model = resolve_model(str(changed), store=None, session=None)
    assert other_model.revision != model.revision
    assert other_model.encoders_hash != model.encoders_hash
    assert planned(other_model, "a cat")[0].hash() != planned(model, "a cat")[0].hash()
    assert text_encoder_digest(other) != text_encoder_digest(reference)


def test_an_sdxl_model_renders_through_sdq_run(sdq, sdxl_folder, s3_client, redis_url, tmp_path):
    prompts = write(tmp_path / "p.csv", "prompt,seed\nxl: a red castle,1\nxl: a red castle,2\n")
    shared = {"SDQ_PROMPT_CACHE_URL": f"{redis_url.rsplit('/', 1)[0]}/6"}
    redis.Redis.from_url(shared["SDQ_PROMPT_CACHE_URL"]).flushdb()
    code, status = run_json(sdq, str(prompts), "--steps", "2", "--model", str(sdxl_folder),
                            env=shared)  # fmt: skip
    assert code == 0 and status["counts"] == {"succeeded": 2}, status
    images = images_by_seed(status, s3_client)
    assert {image.shape for image in images.values()} == {(64, 64, 3)}
    assert not np.array_equal(images[1], images[2])
    # The run's two texts (its prompt, the empty negative one) were encoded and shared.
    shared_keys = redis.Redis.from_url(shared["SDQ_PROMPT_CACHE_URL"]).keys(f"{PREFIX}*:*")
    assert len(shared_keys) == 2


def test_a_lora_is_fused_at_its_scale_as_diffusers_applies_it(lora_file, tmp_path) -> None:
    """sdq fuses a LoRA into the weights; diffusers' pipeline with the LoRA loaded and
    scaled per call (unfused) makes the same images. Another scale or none, other images;
    the pipeline with a LoRA is one of its own, beside the base."""
    pipelines = cache(tmp_path, size=2, prompt_cache_size=8)
    lora = {"name": "detail", "source": str(lora_file), "scale": 0.7,
            "sha256": resolve_lora(str(lora_file), session=None)["sha256"]}  # fmt: skip
    base = planned(tiny_identity(), "a lighthouse", "a harbour")
    with_lora = [replace(spec, loras=[lora]) for spec in base]
    loaded, _ = pipelines.get(with_lora[0])
    made = render(loaded, with_lora)

    reference = build_pipeline()
    reference.load_lora_weights(str(lora_file.parent), weight_name=lora_file.name)
    close(made, diffusers_renders(reference, with_lora, cross_attention_kwargs={"scale": 0.7}))

    plain, _ = pipelines.get(base[0])
    assert plain is not loaded
    without = [pixels(image) for image in render(plain, base)]
    assert not any(np.array_equal(pixels(a), b) for a, b in zip(made, without, strict=True))
    stronger = [replace(spec, loras=[{**lora, "scale": 1.0}]) for spec in base]
    assert stronger[0].hash() != with_lora[0].hash() != base[0].hash()
    assert stronger[0].batch_key() != with_lora[0].batch_key()
    # Where the file was found is not the image's: only its content and scale are.
    moved = [replace(spec, loras=[{**lora, "name": "x", "source": "/elsewhere"}]) for spec in base]
    assert moved[0].hash() == with_lora[0].hash()
    assert pipelines.get(with_lora[1]) == (loaded, None)  # kept, fused once


def lora_of(path: Path, scale: float) -> dict:
    return {"name": path.parent.name, "source": str(path), "scale": scale,
            "sha256": resolve_lora(str(path), session=None)["sha256"]}  # fmt: skip


def with_diffusers_loras(loras: list[dict]):
    """diffusers' own pipeline with the LoRAs loaded as adapters at their scales, unfused."""
    reference = build_pipeline()
    names = [f"adapter_{n}" for n in range(len(loras))]
    for name, lora in zip(names, loras, strict=True):
        path = Path(lora["source"])
        reference.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
    reference.set_adapters(names, adapter_weights=[lora["scale"] for lora in loras])
    return reference


def test_a_compiled_worker_swaps_lora_sets_into_one_pipeline_compiling_nothing_again(
    sdxl_folder, tmp_path
) -> None:
    """Compiled (the eager backend: dynamo traces and guards as it does with inductor),
    LoRAs of the same rank in turn (one with an alpha of its own, one of fewer layers),
    then two of them together, are swapped into one pipeline of the model, loaded and
    compiled once: no graph is made after its warm-up, and each call renders what diffusers
    renders with those LoRAs at their scales. Another model's LoRA is refused by name and
    leaves the pipeline as it was; a set whose ranks add up past the adapter's is fused into
    a pipeline of its own."""
    made = [
        save_lora(build_pipeline(), tmp_path / "lora-0", seed=20),
        save_lora(build_pipeline(), tmp_path / "lora-1", seed=21, alpha=8),
        save_lora(build_pipeline(), tmp_path / "lora-2", seed=22, targets=("to_q", "to_k")),
    ]
    loras = [lora_of(path, scale) for path, scale in zip(made, (0.7, 1.0, 1.3), strict=True)]
    pipelines = cache(tmp_path, size=2, compile_mode="default", compile_backend="eager",
                      compile_batches=(2,), warm_shapes=((64, 64),), lora_swap_rank=8)  # fmt: skip
    base = planned(tiny_identity(), "a lighthouse", "a harbour")
    first = replace(base[0], loras=loras[:1])
    swapping, loading = pipelines.get(first)
    assert loading is not None and swapping.warm_keys == (first.warm_key(),)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0

    for chosen in ([loras[0]], [loras[1]], [loras[2]], [loras[0], loras[2]]):
        specs = [replace(spec, loras=chosen) for spec in base]
        loaded, swap_seconds = pipelines.get(specs[0])
        assert loaded is swapping and (swap_seconds is None) == (chosen == loras[:1])
        close(render(loaded, specs), diffusers_renders(with_diffusers_loras(chosen), specs))
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
    # One warm key for every LoRA set of the model: its swapping pipeline.
    assert len({replace(base[0], loras=chosen).warm_key() for chosen in ([loras[0]], loras)}) == 1

    sdxl_lora = lora_of(save_lora(build_sdxl(), tmp_path / "xl-lora", seed=6), 1.0)
    with pytest.raises(PipelineError, match="cannot apply to model"):
        pipelines.get(replace(base[0], loras=[sdxl_lora]))
    again = [replace(spec, loras=[loras[1]]) for spec in base]
    assert pipelines.get(again[0])[0] is swapping
    close(render(swapping, again), diffusers_renders(with_diffusers_loras([loras[1]]), again))

    every = [replace(spec, loras=loras) for spec in base]  # ranks 3 x 4 = 12, past 8
    fused, loading = pipelines.get(every[0])
    assert fused is not swapping and loading is not None and fused.lora_set is None
    close(render(fused, every), diffusers_renders(with_diffusers_loras(loras), every))


def test_a_lora_for_another_model_fails_its_jobs_by_name(sdxl_folder, tmp_path) -> None:
    sdxl_lora = save_lora(build_sdxl(), tmp_path / "xl-lora", seed=6)
    lora = {"name": "xl-detail", "source": str(sdxl_lora), "scale": 1.0,
            "sha256": resolve_lora(str(sdxl_lora), session=None)["sha256"]}  # fmt: skip
    [spec] = planned(tiny_identity(), "a lighthouse")
    with pytest.raises(PipelineError, match=r"LoRA xl-detail .*model tiny"):
        cache(tmp_path).get(replace(spec, loras=[lora]))


def test_loras_by_file_uri_and_pushed_name_are_one_spec(
    sdq, lora_file, s3_client, tmp_path
) -> None:
    """`--lora` takes a file, an s3:// URI or a pushed name, with a scale: one content at
    one scale is one spec, served from the first render; a file that holds no LoRA, a
    pipeline given as a LoRA and a LoRA given as a model are refused by name."""
    prompts = write(tmp_path / "p.csv", "prompt,seed\nlora: a lighthouse,4\n")
    model = ["--steps", "2", "--dtype", "float32"]
    code, by_file = run_json(sdq, str(prompts), *model, "--lora", f"{lora_file}:0.7")
    assert code == 0 and by_file["counts"] == {"succeeded": 1} and by_file["cached"] == 0
    job = json.loads(sdq("show", str(by_file["jobs"][0]["id"]), "--json").stdout)
    [recorded] = job["spec"]["loras"]
    assert recorded["scale"] == 0.7 and recorded["source"] == str(lora_file.resolve())

    pushed = sdq("model", "push", str(lora_file), "detail", "--json")
    assert pushed.exit_code == 0, pushed.output
    assert json.loads(pushed.stdout)["revision"] == recorded["sha256"]
    s3_client.upload_file(str(lora_file), BUCKET, "uploaded/detail.safetensors")
    for ref in ("detail:0.7", f"s3://{BUCKET}/uploaded/detail.safetensors:0.7"):
        code, again = run_json(sdq, str(prompts), *model, "--lora", ref)
        assert code == 0 and again["cached"] == 1, (ref, again)
    code, stronger = run_json(sdq, str(prompts), *model, "--lora", "detail")
    assert code == 0 and stronger["cached"] == 0, stronger
    plain_image = images_by_seed(stronger, s3_client)[4]
    assert not np.array_equal(plain_image, images_by_seed(by_file, s3_client)[4])
    models = {(m["name"], m["format"]) for m in json.loads(sdq("model", "list", "--json").stdout)}
    assert ("detail", "lora") in models

    not_lora = write(tmp_path / "plain.safetensors", "not a safetensors file at all")
    refused = sdq("run", str(prompts), *model, "--lora", str(not_lora))
    assert refused.exit_code == 2 and f"{not_lora} is not a safetensors file" in refused.output
    assert sdq("model", "push", str(not_lora), "bad").exit_code != 0
    as_model = sdq("run", str(prompts), "--model", "detail")
    assert as_model.exit_code == 2 and "'detail' is a LoRA" in as_model.output
    build_pipeline().save_pretrained(tmp_path / "pipeline")
    assert sdq("model", "push", str(tmp_path / "pipeline"), "a-pipeline").exit_code == 0
    as_lora = sdq("run", str(prompts), "--lora", "a-pipeline")
    assert as_lora.exit_code == 2 and "'a-pipeline' is a pipeline" in as_lora.output
    no_scale = sdq("run", str(prompts), *model, "--lora", "detail:strong")
    said = "'detail' with a scale is detail:NUMBER, and 'strong' is none"
    assert no_scale.exit_code == 2 and said in " ".join(no_scale.output.split()), no_scale.output
