"""Semantic dedup at scale: sdq's clustered path (faiss k-means, then near-duplicates within
each cluster, as `sdq dataset filter --dedup` runs it a job per cluster) against exact brute
force over all pairs, on N random unit embeddings with planted near-duplicates.

The brute force is written as a script would, with numpy alone and nothing of sdq: every
sample against every better-ranked one, a block of rows at a time, a sample is out when its
best cosine with a better one reaches the threshold. Both apply that one rule, so the brute
force's answer is the truth the clustered path is scored against: its recall (of the
near-duplicates brute force finds, the share it finds) and its precision. Times are each
path's own compute over embeddings in memory; the jobs' reads and writes are left out of
both. Prints one JSON object.

    python benchmarks/dedup.py [--samples 200000] [--width 64] [--groups 2000]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdq.producer.curate.filter import SAMPLES_PER_CLUSTER  # noqa: E402
from sdq.workers.curate.dedup import Kmeans, near_duplicates, reach  # noqa: E402

THRESHOLD = 0.95
BLOCK = 1024


def planted(samples: int, width: int, groups: int, seed: int = 0):
    """Random embeddings, and `groups` of 2 or 3 near-copies (cosine about 0.99)."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((samples, width)).astype(np.float32)
    rows = rng.choice(samples, groups * 3, replace=False)
    for group in range(groups):
        original, *copies = rows[group * 3 : group * 3 + 2 + group % 2]
        noise = rng.standard_normal((len(copies), width)).astype(np.float32)
        vectors[copies] = vectors[original] + 0.1 * noise * np.linalg.norm(
            vectors[original]
        ) / np.sqrt(width)
    ranks = rng.uniform(size=samples)
    return vectors.astype(np.float16), ranks


def brute_force(vectors: np.ndarray, ranks: np.ndarray) -> set[int]:
    """Every pair: a sample is out when a better-ranked one is at the threshold or more."""
    order = np.argsort(-ranks, kind="stable")
    unit = vectors[order].astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    out = set()
    for start in range(1, len(unit), BLOCK):
        stop = min(start + BLOCK, len(unit))
        similar = unit[start:stop] @ unit[:stop].T
        similar[np.arange(stop)[None, :] >= np.arange(start, stop)[:, None]] = -1
        out.update(order[start + np.flatnonzero(similar.max(axis=1) >= THRESHOLD)].tolist())
    return out


def clustered(vectors: np.ndarray, ranks: np.ndarray, clusters: int) -> tuple[set[int], float]:
    """sdq's path: k-means on a sample (as the clustering job trains it), every sample to
    its nearest centroid and, near the edge, to the next ones as a guest; then each
    cluster's own members judged against its members and guests (a job each)."""
    rng = np.random.default_rng(1)
    sample = vectors[rng.choice(len(vectors), min(len(vectors), clusters * 256), replace=False)]
    kmeans = Kmeans(sample, clusters, seed=1)
    rows, labels, home = kmeans.clusters_of(vectors, reach(THRESHOLD))
    keys = np.array([f"{row:09d}" for row in range(len(vectors))])
    out = set()
    for cluster in range(clusters):
        of_cluster = labels == cluster
        members = rows[of_cluster]
        found = near_duplicates(list(keys[members]), vectors[members], ranks[members],
                                THRESHOLD, judged=home[of_cluster])  # fmt: skip
        out.update(int(key) for key in found)
    return out, (len(rows) - len(vectors)) / len(vectors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--groups", type=int, default=2_000)
    args = parser.parse_args()
    vectors, ranks = planted(args.samples, args.width, args.groups)
    clusters = -(-args.samples // SAMPLES_PER_CLUSTER)

    started = time.perf_counter()
    truth = brute_force(vectors, ranks)
    brute_seconds = time.perf_counter() - started
    started = time.perf_counter()
    found, guests = clustered(vectors, ranks, clusters)
    clustered_seconds = time.perf_counter() - started
    both = len(found & truth)
    print(json.dumps({
        "samples": args.samples,
        "width": args.width,
        "planted_groups": args.groups,
        "threshold": THRESHOLD,
        "clusters": clusters,
        "guests_per_sample": round(guests, 3),
        "near_duplicates": len(truth),
        "brute_force_seconds": round(brute_seconds, 2),
        "clustered_seconds": round(clustered_seconds, 2),
        "clustered_vs_brute_force_speedup": round(brute_seconds / clustered_seconds, 2),
        "recall": round(both / len(truth), 4) if truth else None,
        "precision": round(both / len(found), 4) if found else None,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
