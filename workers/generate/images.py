"""PNG encoding with the spec embedded, so an image file explains itself."""

import hashlib
import io
import json

from PIL.Image import Image
from PIL.PngImagePlugin import PngInfo

from sdq.models.generate.specs import SAMPLER_NAMES, GenerationSpec


def parameters_text(spec: GenerationSpec) -> str:
    """The `parameters` chunk as AUTOMATIC1111-style tools write and read it."""
    settings = ", ".join(
        [
            f"Steps: {spec.steps}",
            f"Sampler: {SAMPLER_NAMES.get(spec.scheduler, spec.scheduler)}",
            f"CFG scale: {spec.guidance:g}",
            f"Seed: {spec.seed}",
            f"Size: {spec.width}x{spec.height}",
            f"Model hash: {spec.model_revision[:10]}",
            f"Model: {spec.model_name}",
        ]
    )
    lines = [spec.prompt]
    if spec.negative_prompt:
        lines.append(f"Negative prompt: {spec.negative_prompt}")
    lines.append(settings)
    return "\n".join(lines)


def encode_png(image: Image, spec: GenerationSpec, spec_hash: str) -> bytes:
    info = PngInfo()
    info.add_itxt("parameters", parameters_text(spec))
    info.add_itxt("sdq-spec", json.dumps(spec.to_dict(), sort_keys=True, ensure_ascii=False))
    info.add_text("sdq-spec-hash", spec_hash)
    buffer = io.BytesIO()
    # Level 6 is zlib's default: deterministic, so the same pixels give the same bytes.
    image.save(buffer, format="PNG", pnginfo=info, compress_level=6)
    return buffer.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
