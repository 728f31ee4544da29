"""A curate job's specification: one image shard, scored by one CLIP model and the heads
given, and where its CLIP image embeddings go."""

import re
from dataclasses import asdict, dataclass
from typing import Any

from sdq.models.curate.clip import ScorerRef
from sdq.models.datasets import SPEC_VERSION
from sdq.models.specs import canonical_sha256

# A scoring head's tensors: a stack of linear layers keyed layers.<i>.weight and .bias.
HEAD_LAYER = re.compile(r"layers\.(\d+)\.(weight|bias)")


@dataclass(frozen=True, kw_only=True)
class CurateSpec:
    """Image shard `shard` of the dataset, as the file whose hash is `shard_sha256`: each
    kept sample's CLIP image embedding, its CLIP score against its caption, and the heads'
    scores of the embedding. Heads are stored by their content (`heads/<sha256>...`)."""

    dataset: str
    shard: int
    shard_sha256: str
    image_format: str  # the shard's image column
    model_name: str
    model_source: str
    model_revision: str
    aesthetic_head: str | None = None
    nsfw_head: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CurateSpec":
        return cls(**data)

    def hash(self) -> str:
        # Where the model was found does not change what it computes; its revision does.
        identity = self.to_dict()
        del identity["model_name"], identity["model_source"]
        return canonical_sha256({**identity, "version": SPEC_VERSION})

    @property
    def embeddings_key(self) -> str:
        return embeddings_key(self.dataset, self.model_revision, self.shard)

    @property
    def scorer(self) -> ScorerRef:
        return ScorerRef(self.model_source, self.model_revision, self.aesthetic_head,
                         self.nsfw_head)  # fmt: skip


def embeddings_key(dataset: str, model_revision: str, shard: int) -> str:
    """A shard's CLIP image embeddings, beside its images, one file per model."""
    return f"datasets/{dataset}/clip/{model_revision[:16]}/{shard:05d}.parquet"


def head_key(sha256: str, suffix: str) -> str:
    """A scoring head in the store, named by its content: the spec's hash covers it."""
    return f"heads/{sha256}{suffix}"


@dataclass(frozen=True, kw_only=True)
class DedupSpec:
    """Near-duplicates among the members of a filtered dataset, by the cosine of their CLIP
    image embeddings: over all of them in one job (`clusters` 0); or, at scale, the
    SemDeDup way: one job (`cluster` None) runs k-means into `clusters` groups and adds a
    job per group, which compares only the members of cluster `cluster`."""

    dataset: str
    # The filtered dataset as made this time: a dataset remade under its name is new work.
    dataset_id: int
    # Where the embeddings are: the dataset curate scored, under the CLIP model's revision.
    images_of: str
    model_revision: str
    threshold: float
    # The score that decides which sample of a group is kept (the highest).
    rank_by: str
    clusters: int = 0
    cluster: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DedupSpec":
        return cls(**data)

    def hash(self) -> str:
        return canonical_sha256({**self.to_dict(), "version": SPEC_VERSION})

    @property
    def clusters_them(self) -> bool:
        """Whether this is the job that makes the clusters (and their jobs)."""
        return self.clusters > 0 and self.cluster is None

    @property
    def output_key(self) -> str:
        """The job's record in the store: its near-duplicates, or the clusters' centroids."""
        if self.clusters_them:
            name = "centroids"
        else:
            name = "all" if self.cluster is None else f"{self.cluster:05d}"
        return f"{self._prefix}/{name}.parquet"

    def cluster_prefix(self, cluster: int) -> str:
        """Where the clustering job leaves cluster `cluster`'s embeddings, in parts."""
        return f"{self.clusters_prefix}{cluster:05d}/"

    @property
    def clusters_prefix(self) -> str:
        return f"{self._prefix}/clusters/"

    @property
    def _prefix(self) -> str:
        return f"datasets/{self.dataset}/dedup-{self.dataset_id}"
