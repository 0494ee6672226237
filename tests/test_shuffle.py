"""Shuffle buffer: bounded in samples and bytes, every sample out once, seeded."""

from __future__ import annotations

from wdsvlm.pipeline.shuffle import Shuffle, sample_nbytes


def big_samples(n, size=1_000_000, epoch=0, worker=0):
    return [
        {"__key__": f"{i:04d}", "__pass__": epoch, "__worker__": worker, "0.jpg": bytes(size)}
        for i in range(n)
    ]


def keys(samples):
    return [s["__key__"] for s in samples]


def test_byte_bound_holds_with_large_images():
    run = Shuffle(buffer_size=1000, buffer_bytes=3_500_000, seed=0)(iter(big_samples(50)))
    out = list(run)
    assert sorted(keys(out)) == keys(big_samples(50))
    assert run.peak_bytes <= 3_500_000
    assert run.peak_bytes == 3_000_000  # three 1 MB samples fit, a fourth would not


def test_sample_bound_holds_and_order_is_mixed():
    stage = Shuffle(buffer_size=10, buffer_bytes=10**12, seed=0)
    out = keys(stage(iter(big_samples(200, size=10))))
    assert sorted(out) == keys(big_samples(200))
    assert out != sorted(out)
    # a buffer of 10 can only move a sample forward by less than 10 places
    assert all(int(k) < i + 10 for i, k in enumerate(out))


def test_a_sample_larger_than_the_byte_bound_passes_alone():
    run = Shuffle(buffer_size=10, buffer_bytes=100, seed=0)(iter(big_samples(5, size=1000)))
    out = list(run)
    assert len(out) == 5 and run.peak_bytes == 1000


def test_order_follows_seed_epoch_and_worker():
    def run(seed, epoch, worker):
        return keys(Shuffle(20, seed=seed)(iter(big_samples(100, 10, epoch, worker))))

    assert run(1, 0, 0) == run(1, 0, 0)
    assert (
        len({tuple(run(1, 0, 0)), tuple(run(2, 0, 0)), tuple(run(1, 1, 0)), tuple(run(1, 0, 1))})
        == 4
    )


def test_sample_nbytes_counts_payloads_only():
    import numpy as np

    assert sample_nbytes({"__key__": "k" * 50, "json": b"12345", "a": np.zeros(10, np.uint8)}) == 15
