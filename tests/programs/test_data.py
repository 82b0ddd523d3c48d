"""The stdlib byte corpus: deterministic split by file, deterministic batches, sharding over the data axis."""
import numpy as np
import pytest

from workbench.errors import WorkbenchError
from workbench.programs.data import Batches, get_batch, is_val, load_corpus, shard_batch, unigram_baseline

SMALL = 400_000


def test_split_is_by_file_and_deterministic():
    c = load_corpus(SMALL)
    assert c.train.size == SMALL and c.val.size > 0
    assert c.n_train_files > 0 and c.n_val_files > 0
    assert is_val("json/decoder.py") == is_val("json/decoder.py")
    c2 = load_corpus.__wrapped__(SMALL)  # re-read from disk
    np.testing.assert_array_equal(c.train, c2.train)
    np.testing.assert_array_equal(c.val, c2.val)
    # about 10% of files go to validation (crc32 % 10)
    names = [f"mod{i}/x.py" for i in range(2000)]
    frac = sum(map(is_val, names)) / len(names)
    assert 0.07 < frac < 0.13


def test_batches_are_deterministic_shifted_windows():
    c = load_corpus(SMALL)
    b = Batches(4, 32, seed=3, corpus=c)
    x, y = b.train(7), b.train(7)
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert x["inputs"].shape == (4, 32) and x["inputs"].dtype == np.int32
    np.testing.assert_array_equal(x["inputs"][:, 1:], x["targets"][:, :-1])
    assert not np.array_equal(b.train(8)["inputs"], x["inputs"])
    assert not np.array_equal(b.val(7)["inputs"], x["inputs"])
    # every window is a contiguous slice of the training split
    row = x["inputs"][0].astype(np.uint8).tobytes()
    assert row in c.train.tobytes()
    with pytest.raises(WorkbenchError, match="too few"):
        get_batch(c.train[:10], 2, 32, 0, 0)


def test_unigram_baseline_is_between_zero_and_uniform():
    base = unigram_baseline(load_corpus(SMALL))
    assert 2.0 < base["val_cross_entropy_nats"] < base["uniform_nats"]
    # reference: plain loop over the byte counts
    c = load_corpus(SMALL)
    counts = [1.0] * 256
    for byte in c.train[:SMALL].tolist():
        counts[byte] += 1
    total = sum(counts)
    ent = -sum(n / total * np.log(n / total) for n in counts)
    assert abs(ent - base["train_entropy_nats"]) < 1e-9


def test_shard_batch_splits_rows_over_data():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from partitioning.mesh import make_mesh

    mesh = make_mesh("data=8")
    b = Batches(8, 16, corpus=load_corpus(SMALL)).train(0)
    s = shard_batch(b, NamedSharding(mesh, PartitionSpec("data")))
    assert len(s["inputs"].addressable_shards) == 8
    assert s["inputs"].addressable_shards[0].data.shape == (1, 16)
    np.testing.assert_array_equal(np.asarray(s["inputs"]), b["inputs"])
    assert jax.tree.structure(s) == jax.tree.structure(b)
