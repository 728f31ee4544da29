"""Planning jobs from rows: style crossing, defaults, seeds, batching; spec hashing."""

from dataclasses import replace

from sdq.models.generate.generations import SharedSettings
from sdq.models.generate.specs import batches, image_key
from sdq.models.registry import tiny_identity
from sdq.producer.generate.plan import Defaults, plan_jobs
from sdq.producer.prompts import PromptRow

MODEL = tiny_identity()


def list_plan(*args, **kwargs) -> list:
    return list(plan_jobs(*args, **kwargs))


def test_every_row_is_crossed_with_every_style_and_a_row_style_wins() -> None:
    rows = [PromptRow(line=2, prompt="a fox"), PromptRow(line=3, prompt="a owl", style="ink")]
    planned = list_plan(
        rows,
        model=MODEL,
        defaults=Defaults(seed=5),
        styles=["oil", "pixel art"],
        template="{prompt} by {style}",
    )
    assert [(job.spec.prompt, job.style, job.source_line) for job in planned] == [
        ("a fox by oil", "oil", 2),
        ("a fox by pixel art", "pixel art", 2),
        ("a owl by ink", "ink", 3),
    ]
    # One seed for the whole grid: styles are compared on the same noise.
    assert {job.spec.seed for job in planned} == {5}


def test_defaults_fill_what_a_row_leaves_out() -> None:
    row = PromptRow(line=2, prompt="x", steps=9, guidance=0.0, width=128, n=3, seed=10)
    planned = list_plan([row], model=MODEL, defaults=Defaults(steps=30, guidance=7.0, height=96))
    specs = [job.spec for job in planned]
    assert [spec.seed for spec in specs] == [10, 11, 12]
    assert {(spec.steps, spec.guidance, spec.width, spec.height) for spec in specs} == {
        (9, 0.0, 128, 96)
    }
    assert {spec.dtype for spec in specs} == {"float32"}
    native = list_plan([PromptRow(line=2, prompt="x")], model=MODEL, defaults=Defaults())
    assert (native[0].spec.width, native[0].spec.height) == (64, 64)


def test_seeds_are_drawn_once_per_image_when_none_is_given() -> None:
    planned = list_plan([PromptRow(line=2, prompt="x", n=50)], model=MODEL, defaults=Defaults())
    seeds = [job.spec.seed for job in planned]
    assert len(set(seeds)) > 45
    assert all(0 <= seed < 2**32 for seed in seeds)


def test_spec_hash_follows_the_revision_not_the_name() -> None:
    spec = list_plan([PromptRow(line=2, prompt="x", seed=1)], model=MODEL, defaults=Defaults())[
        0
    ].spec
    assert replace(spec, model_name="other", model_source="/elsewhere").hash() == spec.hash()
    changed = [
        replace(spec, model_revision="0" * 64),
        replace(spec, seed=2),
        replace(spec, steps=26),
        replace(spec, guidance=7.0),
        replace(spec, width=128),
        replace(spec, prompt="y"),
        replace(spec, negative_prompt="z"),
        replace(spec, dtype="float16"),
        replace(spec, scheduler="DDIMScheduler"),
        replace(spec, scheduler_config={**spec.scheduler_config, "steps_offset": 0}),
    ]
    assert len({other.hash() for other in changed} | {spec.hash()}) == len(changed) + 1
    assert image_key(spec.hash()) == f"images/{spec.hash()}.png"


def test_shared_settings_hash_each_spec_as_the_spec_itself_does() -> None:
    # The per-image values that canonical JSON escapes or spells in its own way.
    prompts = [
        "plain",
        'a "quoted" \\ back\nslash',
        "caf\u00e9 \u732b \U0001f98a",
        "\x00\x1f\u2028",
        "",
    ]
    negatives = ["", 'blurry, "low" quality', "\t"]
    seeds = [0, 1, 2**32 - 1]
    base = list_plan([PromptRow(line=2, prompt="x", seed=1)], model=MODEL, defaults=Defaults())[
        0
    ].spec
    settings_variants = [
        base,
        replace(base, steps=9, guidance=0.0, width=128, height=96, dtype="float16"),
        replace(base, model_revision="f" * 64, scheduler="DDIMScheduler"),
    ]
    specs = [
        replace(variant, prompt=prompt, negative_prompt=negative, seed=seed)
        for variant in settings_variants
        for prompt in prompts
        for negative in negatives
        for seed in seeds
    ]
    settings = SharedSettings()
    assert [settings.key_and_hash(spec) for spec in specs] == [
        (spec.batch_key(), spec.hash()) for spec in specs
    ]
    assert len({spec.hash() for spec in specs}) == len(specs)


def test_batches_share_one_pipeline_call_setting() -> None:
    pairs = [(1, "a"), (2, "b"), (3, "a"), (4, "a"), (5, "b")]
    assert batches(pairs, 2) == [[1, 3], [4], [2, 5]]


def test_the_precision_is_left_to_the_rendering_device_unless_asked() -> None:
    folder_model = replace(MODEL, default_dtype="auto")  # what a diffusers folder resolves to
    row = PromptRow(line=2, prompt="x", seed=1)
    [auto] = list_plan([row], model=folder_model, defaults=Defaults())
    [asked] = list_plan([row], model=folder_model, defaults=Defaults(dtype="bfloat16"))
    assert (auto.spec.dtype, asked.spec.dtype) == ("auto", "bfloat16")
    assert auto.spec.hash() != asked.spec.hash()
