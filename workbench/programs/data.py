"""Real data, nothing downloaded: byte-level language modelling on the Python standard library's own source files.

- Files: every `*.py` under the running interpreter's stdlib directory (sysconfig 'stdlib'), excluding
  site-packages, in sorted relative-path order; the corpus is capped at `max_bytes` per split (deterministic).
- Split by file: a file is validation when crc32(relative path) % 10 == 0 (about 10% of files), else training.
  The split depends only on the path, so it is the same on every machine with the same Python version.
- Tokens are bytes (vocabulary 256); files are joined with a NUL byte.
- Batches: window i of a batch is a random offset from numpy's PCG64 seeded by (seed, step): deterministic,
  any step can be regenerated. Validation batches use a fixed, separate seed stream.
- `shard_batch` places a host batch with the data-axis sharding (each device gets its slice of the batch rows).
- `Batches.train_sharded` / `val_sharded` build a global batch where each process reads only the rows its own
  devices hold (all window offsets are drawn, only the process's rows are gathered), then assemble the global
  array from the per-device pieces: the same batch, row for row, as one process reading everything.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError

VOCAB = 256
VAL_SEED = 1_000_003


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 bytes
    val: np.ndarray
    root: str
    n_train_files: int
    n_val_files: int

    def describe(self) -> dict:
        return {"source": f"Python standard library sources under {self.root}", "tokenizer": "bytes (vocab 256)",
                "split": "by file: crc32(relative path) % 10 == 0 -> validation",
                "train_bytes": int(self.train.size), "val_bytes": int(self.val.size),
                "train_files": self.n_train_files, "val_files": self.n_val_files}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_val(relpath: str) -> bool:
    return zlib.crc32(relpath.encode()) % 10 == 0


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int = 8_000_000) -> Corpus:
    """The stdlib corpus, each split capped at max_bytes (files taken in sorted order until the cap)."""
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise WorkbenchError(f"no Python sources found under {root}; the corpus needs the standard library sources")
    parts = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    counts = {"train": 0, "val": 0}
    for p in files:
        rel = p.relative_to(root).as_posix()
        split = "val" if is_val(rel) else "train"
        if sizes[split] >= max_bytes:
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        parts[split].append(data)
        sizes[split] += len(data) + 1
        counts[split] += 1
    arrays = {k: np.frombuffer(b"\0".join(v), dtype=np.uint8)[:max_bytes] for k, v in parts.items()}
    return Corpus(arrays["train"], arrays["val"], str(root), counts["train"], counts["val"])


def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int,
              rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """{'inputs': (B, T) int32, 'targets': (B, T) int32 (inputs shifted by one)} from random windows.

    rows: only these rows of the batch (R, T); the offsets of all B rows are still drawn, so row r is the same
    whichever rows are asked for."""
    if tokens.size < seq_len + 2:
        raise WorkbenchError(f"corpus split has {tokens.size} bytes, too few for seq_len={seq_len}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, tokens.size - seq_len - 1, size=batch_size)
    if rows is not None:
        starts = starts[np.asarray(rows, dtype=np.int64)]
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    win = tokens[idx].astype(np.int32)
    return {"inputs": win[:, :-1], "targets": win[:, 1:]}


class Batches:
    """Deterministic training and validation batches of one corpus."""

    def __init__(self, batch_size: int, seq_len: int, seed: int = 0, corpus: Corpus | None = None):
        self.corpus = corpus or load_corpus(int(os.environ.get("WORKBENCH_CORPUS_BYTES", 8_000_000)))
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

    def train(self, step: int) -> dict[str, np.ndarray]:
        return get_batch(self.corpus.train, self.batch_size, self.seq_len, self.seed, step)

    def val(self, i: int) -> dict[str, np.ndarray]:
        return get_batch(self.corpus.val, self.batch_size, self.seq_len, VAL_SEED, i)

    def train_sharded(self, step: int, sharding) -> dict:
        """Training batch `step` as global arrays with `sharding`; this process reads only its devices' rows."""
        return place_rows(lambda rows: get_batch(self.corpus.train, self.batch_size, self.seq_len, self.seed, step,
                                                 rows), self.batch_size, self.seq_len, sharding)

    def val_sharded(self, i: int, sharding) -> dict:
        return place_rows(lambda rows: get_batch(self.corpus.val, self.batch_size, self.seq_len, VAL_SEED, i, rows),
                          self.batch_size, self.seq_len, sharding)


def unigram_baseline(corpus: Corpus) -> dict[str, float]:
    """Cross-entropy (nats/byte) on validation of the training split's byte frequencies (add-one smoothed),
    and the training split's own unigram entropy."""
    counts = np.bincount(corpus.train, minlength=VOCAB).astype(np.float64) + 1.0
    p = counts / counts.sum()
    val_counts = np.bincount(corpus.val, minlength=VOCAB).astype(np.float64)
    ce = float(-(val_counts * np.log(p)).sum() / val_counts.sum())
    ent = float(-(p * np.log(p)).sum())
    return {"val_cross_entropy_nats": ce, "train_entropy_nats": ent, "uniform_nats": math.log(VOCAB)}


def shard_batch(batch: dict[str, np.ndarray], sharding) -> dict:
    """Place a host batch on the devices with `sharding` (rows split over the data axis)."""
    import jax

    return {k: jax.device_put(v, sharding) for k, v in batch.items()}


def place_rows(read_rows, batch_size: int, seq_len: int, sharding) -> dict:
    """Global (B, T) arrays with `sharding` from `read_rows(rows) -> {name: (R, T)}`, called once with the rows this
    process's devices hold. One process holding every device: one host batch placed as `shard_batch` does."""
    import jax

    shape = (batch_size, seq_len)
    if sharding.is_fully_addressable:
        return shard_batch(read_rows(np.arange(batch_size)), sharding)
    index = sharding.addressable_devices_indices_map(shape)  # device -> (row slice, column slice) of the global
    wanted = {d: np.arange(batch_size)[idx[0]] for d, idx in index.items()}
    rows = np.unique(np.concatenate(list(wanted.values())))
    local = read_rows(rows)
    where = {int(r): i for i, r in enumerate(rows)}
    out = {}
    for name, block in local.items():
        pieces = [jax.device_put(block[[where[int(r)] for r in wanted[d]]][:, index[d][1]], d) for d in index]
        out[name] = jax.make_array_from_single_device_arrays(shape, sharding, pieces)
    return out
