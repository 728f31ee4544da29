"""A CLIP model as curate names it: a transformers CLIPModel folder, an s3:// copy of one,
or a hub id (pinned to its commit), with the figures a head must fit. No torch here."""

import json
from dataclasses import dataclass

from sdq.models import tiny
from sdq.models.registry import ModelNotFound, hub_files, is_hub_id, stored_files

CONFIG_FILE = "config.json"


@dataclass(frozen=True, kw_only=True)
class ClipIdentity:
    name: str
    source: str  # /local/folder | s3://bucket/prefix | hub:<id>
    revision: str  # content hash or hub commit
    embedding_width: int  # the projection's width: what a head on the embedding takes


@dataclass(frozen=True)
class ScorerRef:
    """What scores images: a CLIP model at a revision, and any heads on its embeddings
    (stored by content, models/curate/specs.py's head_key)."""

    model_source: str
    model_revision: str
    aesthetic_head: str | None = None
    nsfw_head: str | None = None


def resolve_clip(ref: str) -> ClipIdentity:
    """`tiny`, a local folder, an s3:// URI, or a hub id like openai/clip-vit-large-patch14
    (pinned to its commit, so every shard is scored by the same weights)."""
    if ref == tiny.TINY_NAME:
        return ClipIdentity(name=ref, source=ref, revision=tiny.clip_revision(),
                            embedding_width=tiny.CLIP_PROJECTION_DIM)  # fmt: skip
    if (files := stored_files(ref)) is None and is_hub_id(ref):
        files = hub_files(ref)
    if files is None:
        raise ModelNotFound(
            f"unknown CLIP model {ref!r}: not 'tiny', a local folder, an s3:// URI or a hub id "
            "like openai/clip-vit-large-patch14"
        )
    raw = files.read(CONFIG_FILE)
    try:
        config = json.loads(raw) if raw else {}
    except ValueError:
        config = {}
    if config.get("model_type") != "clip" or "projection_dim" not in config:
        raise ModelNotFound(
            f"{files.source} is not a CLIP model: its {CONFIG_FILE} does not describe a "
            "transformers CLIPModel (model_type 'clip' with a projection_dim)"
        )
    return ClipIdentity(name=files.name, source=files.source, revision=files.revision,
                        embedding_width=config["projection_dim"])  # fmt: skip
