"""The dedup work: near-duplicates among a filtered dataset's members, by the cosine of
their CLIP image embeddings (read from the shards curate stored), left out of it with the
sample each duplicates. Plain code, no Celery, no torch.

The rule is SemDeDup's: in order of score, best first, a sample whose cosine with a better
one reaches the threshold is left out as a near-duplicate of the most similar better one,
so each group keeps its best sample. Up to some tens of thousands of members it runs in
one job, a block of similarities at a time. Beyond that, the way SemDeDup and NeMo Curator
scale it: one job trains k-means (faiss) on a sample of the embeddings, streams every
member to its nearest centroid (each cluster's embeddings written in parts as they fill),
and adds a job per cluster, which judges only its own members; no process ever holds all
the embeddings. Unlike SemDeDup, a member near a cluster's edge also joins the next
clusters as a guest, compared with but not judged there, so a near-duplicate across the
edge is still found (see `reach`).
"""

import hashlib
import io
import random
from collections.abc import Callable, Iterator, Sequence
from time import perf_counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.curate.filtering import leave_out
from sdq.models.curate.specs import DedupSpec, embeddings_key
from sdq.models.curate.tables import SAMPLE_QUALITY
from sdq.models.datasets import SampleStatus
from sdq.models.datasets.tables import Sample, Shard
from sdq.models.jobs.delivery import Work
from sdq.models.jobs.kinds import CURATE
from sdq.models.jobs.lifecycle import Output
from sdq.models.jobs.outbox import add_jobs
from sdq.models.store import PARQUET, MissingObject, ObjectStore
from sdq.models.tables import Job, Run
from sdq.workers.shards.embeddings import embedding_shard_bytes, read_embeddings

# Rows of similarities computed at once: a block is this many x the members, in float32.
BLOCK_ROWS = 512
# k-means trains on at most this many points per centroid (faiss's own default cap).
POINTS_PER_CENTROID = 256
KMEANS_ITERATIONS = 20
# A cluster's embeddings are written in parts of this many rows while members stream in.
PART_ROWS = 65_536
# A sample also joins up to this many clusters beyond its own, as a guest (see reach).
GUESTS = 2
HOME = "home"  # the parts' column: a member of the cluster (else a guest)
KEYS_PER_QUERY = 5_000


class MissingEmbeddings(Exception):
    """The embeddings curate stored for a shard are gone: `sdq curate` the parent again."""


def near_duplicates(
    keys: Sequence[str],
    embeddings: np.ndarray,
    ranks: np.ndarray,
    threshold: float,
    judged: np.ndarray | None = None,
) -> dict[str, tuple[str, float]]:
    """Each near-duplicate's key -> (the better sample it duplicates, their cosine). With
    `judged`, only those rows are judged; the others are compared with, not judged."""
    order = np.lexsort((np.asarray(keys), -np.nan_to_num(ranks, nan=-np.inf)))  # best first
    vectors = _unit(embeddings[order])
    positions = np.arange(len(order)) if judged is None else np.flatnonzero(judged[order])
    positions = positions[positions > 0]  # the best sample has no better one
    found: dict[str, tuple[str, float]] = {}
    for start in range(0, len(positions), BLOCK_ROWS):
        rows = positions[start : start + BLOCK_ROWS]
        similar = vectors[rows] @ vectors[: rows[-1] + 1].T
        # Only better samples count: those before each row in the order.
        similar[np.arange(rows[-1] + 1)[None, :] >= rows[:, None]] = -np.inf
        nearest = similar.argmax(axis=1)
        cosines = similar[np.arange(len(rows)), nearest]
        for index in np.flatnonzero(cosines >= threshold):
            better = keys[order[nearest[index]]]
            found[keys[order[rows[index]]]] = (better, float(cosines[index]))
    return found


class Kmeans:
    """Spherical k-means by faiss, seeded: the same members make the same clusters."""

    def __init__(self, sample: np.ndarray, clusters: int, seed: int) -> None:
        import faiss

        self.model = faiss.Kmeans(
            sample.shape[1], clusters, niter=KMEANS_ITERATIONS, seed=seed, spherical=True,
            max_points_per_centroid=POINTS_PER_CENTROID,
            # Its only use is a warning on stderr, past any log level, for fewer than 39
            # points a cluster: a small dataset's dedup is what its user asked for.
            min_points_per_centroid=1,
        )  # fmt: skip
        self.model.train(_unit(sample))

    def clusters_of(
        self, embeddings: np.ndarray, reach: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's nearest centroid, its home, and up to GUESTS next nearest within
        `reach` further away, where it is a guest: (rows, clusters, is home) as arrays."""
        distances, labels = self.model.index.search(_unit(embeddings), 1 + GUESTS)
        distances = np.sqrt(np.maximum(distances, 0))
        near = (distances <= distances[:, :1] + reach) & (labels >= 0)
        rows, nth = np.nonzero(near)
        return rows, labels[rows, nth], nth == 0

    @property
    def centroids(self) -> np.ndarray:
        return self.model.centroids


def reach(threshold: float) -> float:
    """How much further than its own centroid a sample's near-duplicate's can be: two unit
    vectors at cosine t or more are sqrt(2 (1 - t)) apart at most, so by the triangle
    inequality a sample's near-duplicate is at most twice that further from the sample's
    centroid than from its own. Within it (and the GUESTS cap) a near-duplicate across a
    cluster's edge is still compared."""
    return 2 * np.sqrt(2 * (1 - threshold))


class ClusterParts:
    """Each cluster's members and guests, written to the store in parts as they fill."""

    def __init__(self, store: ObjectStore, spec: DedupSpec) -> None:
        self.store, self.spec = store, spec
        self.waiting: dict[int, list[tuple[list[str], np.ndarray, np.ndarray]]] = {}
        self.written: dict[int, int] = {}  # cluster -> parts written
        self.homes: set[int] = set()  # clusters with members of their own

    def add(
        self, assigned: tuple[np.ndarray, np.ndarray, np.ndarray], keys: list[str],
        embeddings: np.ndarray,
    ) -> None:  # fmt: skip
        rows, clusters, home = assigned
        for cluster in np.unique(clusters).tolist():
            of_cluster = np.flatnonzero(clusters == cluster)
            batch = ([keys[row] for row in rows[of_cluster]], embeddings[rows[of_cluster]],
                     home[of_cluster])  # fmt: skip
            self.waiting.setdefault(cluster, []).append(batch)
            if home[of_cluster].any():
                self.homes.add(cluster)
            if sum(len(batch[0]) for batch in self.waiting[cluster]) >= PART_ROWS:
                self._write(cluster)

    def close(self) -> list[int]:
        """Writes what is left; the clusters that have members of their own."""
        for cluster in list(self.waiting):
            self._write(cluster)
        return sorted(self.homes)

    def _write(self, cluster: int) -> None:
        batches = self.waiting.pop(cluster)
        keys = [key for part_keys, _, _ in batches for key in part_keys]
        embeddings = np.concatenate([vectors for _, vectors, _ in batches])
        home = pa.array(np.concatenate([flags for _, _, flags in batches]))
        part = self.written.get(cluster, 0)
        data = embedding_shard_bytes(keys, embeddings, {"cluster": cluster, "part": part},
                                     columns={HOME: home})  # fmt: skip
        key = f"{self.spec.cluster_prefix(cluster)}{part:05d}.parquet"
        self.store.put_bytes(key, data, content_type=PARQUET)
        self.written[cluster] = part + 1


class DedupWork(Work):
    permanent_errors = (MissingEmbeddings,)

    def __init__(
        self,
        *,
        store: ObjectStore,
        sessions: sessionmaker[Session],
        send_added: Callable[[int], None],
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.send_added = send_added

    def run(self, jobs: Sequence[Job]) -> Iterator[Output]:
        for job in jobs:
            spec = DedupSpec.from_dict(job.spec)
            started = perf_counter()
            if spec.clusters_them:
                data, units = self._cluster(job.run_id, spec)
            else:
                data, units = self._leave_out_duplicates(spec)
            uri = self.store.uri(spec.output_key)  # each stored its record itself
            yield Output(job.id, uri, hashlib.sha256(data).hexdigest(),
                         work_seconds=perf_counter() - started, units=units)  # fmt: skip

    def _leave_out_duplicates(self, spec: DedupSpec) -> tuple[bytes, int]:
        """All members (one job), or one cluster's: their near-duplicates left out."""
        # 1. The members' embeddings and the score that ranks them.
        if spec.cluster is None:
            (keys, embeddings), judged = self._members_embeddings(spec), None
        else:
            keys, embeddings, judged = self._cluster_embeddings(spec)
        ranks = self._ranks(spec, keys)
        # 2. Their near-duplicates, left out with the sample each duplicates.
        found = near_duplicates(keys, embeddings, ranks, spec.threshold, judged)
        with self.sessions.begin() as session:
            reasons = {key: f"near-duplicate of {better} (cosine {cosine:.2f})"
                       for key, (better, cosine) in found.items()}  # fmt: skip
            leave_out(session, spec.dataset_id, reasons)
        data = _found_bytes(found)
        self.store.put_bytes(spec.output_key, data, content_type=PARQUET)
        return data, len(keys)

    def _cluster(self, run_id: int, spec: DedupSpec) -> tuple[bytes, int]:
        """k-means over the members, their embeddings by cluster, and a job per cluster.
        A retry after the cluster jobs were added leaves their parts as they are."""
        with self.sessions() as session:
            added = _cluster_jobs_added(session, run_id)
        if added:
            return self.store.get_bytes(spec.output_key), 0
        for stale in list(self.store.list_keys(spec.clusters_prefix)):
            self.store.delete(stale)  # an earlier attempt's parts
        members = self._members(spec)
        # 1. k-means, trained on a seeded sample of whole shards.
        shards = sorted(members)
        random.Random(spec.dataset_id).shuffle(shards)
        sample, wanted = [], spec.clusters * POINTS_PER_CENTROID
        for number in shards:
            sample.append(self._embeddings(spec, number, members[number])[1])
            if sum(map(len, sample)) >= wanted:
                break
        kmeans = Kmeans(np.concatenate(sample), spec.clusters, seed=spec.dataset_id)
        # 2. Every member to its nearest centroid, and near the edge to the next, a shard at
        # a time.
        parts = ClusterParts(self.store, spec)
        for number in sorted(members):
            keys, embeddings = self._embeddings(spec, number, members[number])
            parts.add(kmeans.clusters_of(embeddings, reach(spec.threshold)), keys, embeddings)
        clusters = parts.close()
        # 3. The centroids stored, then a job per cluster with members, added once.
        centroids = _centroids_bytes(kmeans.centroids)
        self.store.put_bytes(spec.output_key, centroids, content_type=PARQUET)
        with self.sessions.begin() as session:
            _add_cluster_jobs(session, run_id, spec, clusters)
        self.send_added(run_id)
        return centroids, sum(map(len, members.values()))

    def _members(self, spec: DedupSpec) -> dict[int, list[str]]:
        """The dataset's members by shard number."""
        with self.sessions() as session:
            rows = session.execute(
                select(Shard.number, Sample.key)
                .join(Shard, Shard.id == Sample.shard_id)
                .where(Sample.dataset_id == spec.dataset_id, Sample.status == SampleStatus.success)
                .order_by(Shard.number, Sample.key)
            ).all()
        members: dict[int, list[str]] = {}
        for number, key in rows:
            members.setdefault(number, []).append(key)
        return members

    def _members_embeddings(self, spec: DedupSpec) -> tuple[list[str], np.ndarray]:
        read = [
            self._embeddings(spec, number, keys) for number, keys in self._members(spec).items()
        ]
        return _joined(read)

    def _cluster_embeddings(self, spec: DedupSpec) -> tuple[list[str], np.ndarray, np.ndarray]:
        """The cluster's members and guests, and which are its members."""
        read, home = [], []
        for part in sorted(self.store.list_keys(spec.cluster_prefix(spec.cluster))):
            data = self.store.get_bytes(part)
            read.append(read_embeddings(data))
            home.append(pq.read_table(pa.BufferReader(data), columns=[HOME])[HOME].to_numpy())
        return *_joined(read), np.concatenate(home)

    def _embeddings(
        self, spec: DedupSpec, number: int, keys: list[str]
    ) -> tuple[list[str], np.ndarray]:
        """Shard `number`'s embeddings of the members named, as curate stored them."""
        key = embeddings_key(spec.images_of, spec.model_revision, number)
        try:
            stored_keys, embeddings = read_embeddings(self.store.get_bytes(key))
        except MissingObject as error:
            raise MissingEmbeddings(f"{error}: `sdq curate {spec.images_of}` stores them") from None
        wanted = set(keys)
        rows = [row for row, stored in enumerate(stored_keys) if stored in wanted]
        return [stored_keys[row] for row in rows], embeddings[rows]

    def _ranks(self, spec: DedupSpec, keys: list[str]) -> np.ndarray:
        """Each member's score that decides which of a group is kept (NaN: none)."""
        score = SAMPLE_QUALITY.c[spec.rank_by]
        found: dict[str, float] = {}
        with self.sessions() as session:
            for start in range(0, len(keys), KEYS_PER_QUERY):
                chunk = keys[start : start + KEYS_PER_QUERY]
                found.update(session.execute(
                    select(SAMPLE_QUALITY.c.key, score)
                    .where(SAMPLE_QUALITY.c.dataset == spec.dataset,
                           SAMPLE_QUALITY.c.key.in_(chunk))
                ).all())  # fmt: skip
        return np.array([np.nan if found.get(key) is None else found[key] for key in keys])


def _cluster_jobs_added(session: Session, run_id: int) -> bool:
    """Whether the clustering job's run holds its cluster jobs (any job besides it)."""
    return session.scalar(select(func.count()).where(Job.run_id == run_id)) > 1


def _add_cluster_jobs(session: Session, run_id: int, spec: DedupSpec, clusters: list[int]) -> None:
    run = session.get_one(Run, run_id, with_for_update=True)  # one adder at a time
    if _cluster_jobs_added(session, run_id):
        return
    specs = [DedupSpec(**{**spec.to_dict(), "cluster": cluster}) for cluster in clusters]
    add_jobs(session, run, CURATE, specs)


def _joined(read: list[tuple[list[str], np.ndarray]]) -> tuple[list[str], np.ndarray]:
    keys = [key for shard_keys, _ in read for key in shard_keys]
    return keys, np.concatenate([embeddings for _, embeddings in read])


def _unit(embeddings: np.ndarray) -> np.ndarray:
    vectors = np.ascontiguousarray(embeddings, dtype=np.float32)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def _found_bytes(found: dict[str, tuple[str, float]]) -> bytes:
    """The job's record: each near-duplicate, the sample it duplicates, their cosine."""
    table = pa.table({
        "key": pa.array(list(found), pa.string()),
        "duplicate_of": pa.array([better for better, _ in found.values()], pa.string()),
        "cosine": pa.array([cosine for _, cosine in found.values()], pa.float32()),
    })  # fmt: skip
    return _parquet(table)


def _centroids_bytes(centroids: np.ndarray) -> bytes:
    return _parquet(pa.table({"centroid": list(np.asarray(centroids, dtype=np.float32))}))


def _parquet(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()
