"""A download job's specification: which rows of which list make which shard, and how."""

from dataclasses import asdict, dataclass
from typing import Any

from sdq.models.datasets import SPEC_VERSION, ImageOptions, ListColumns, shard_key
from sdq.models.specs import canonical_sha256


@dataclass(frozen=True, kw_only=True)
class SliceSpec:
    """One download job: rows [first_row, first_row + row_count) of one list, made into
    shard `shard` of the dataset."""

    dataset: str
    shard: int
    source_uri: str
    source_id: str  # what the list held when planned: its content hash or size and time
    first_row: int
    row_count: int
    key_digits: int  # digits of a row's index within its shard, in sample keys
    columns: ListColumns
    image: ImageOptions
    # `--retry-failed`: only these rows are fetched again; the rest are kept as the shard
    # file with this hash has them.
    retry_keys: tuple[str, ...] = ()
    previous_sha256: str | None = None
    # The retry run that asks: a retry that failed as the one before it leaves the shard
    # byte for byte as it was, and without this the next one would have that one's spec
    # and be served its output instead of fetching.
    retry_run: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SliceSpec":
        columns = data["columns"]
        nested = ("columns", "image", "retry_keys")
        return cls(
            **{key: value for key, value in data.items() if key not in nested},
            columns=ListColumns(**{**columns, "save": tuple(columns["save"])}),
            image=ImageOptions(**data["image"]),
            retry_keys=tuple(data.get("retry_keys", ())),
        )

    def hash(self) -> str:
        # `retry_run` came later and counts only when set: specs made before it keep their
        # hashes, and so their outputs.
        identity = self.to_dict()
        if self.retry_run is None:
            del identity["retry_run"]
        return canonical_sha256({**identity, "version": SPEC_VERSION})

    def sample_key(self, index: int) -> str:
        """img2dataset's keys: the shard number, then the row's index within the shard."""
        return f"{self.shard:05d}{index:0{self.key_digits}d}"

    @property
    def shard_key(self) -> str:
        return shard_key(self.dataset, self.shard)
