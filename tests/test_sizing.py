"""len(loader) from the index and the settings alone, the same on every rank with no
collective call: a fault every rank meets alike leaves the same part out of the estimate
everywhere, and a read given up on transient faults (which another rank may not meet) is a
clear error, never a silently different length. Real S3 (moto) behind a fault proxy."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import fsspec
import pytest

import wdsvlm
from wdsvlm.format.builder import upgrade_dataset
from wdsvlm.loader.sizing import estimate_batches, measured_shards
from wdsvlm.pipeline.plan import Plan
from wdsvlm.storage.fs import ReadPolicy

from .conftest import EXAMPLE
from .faults import FaultProxy

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"max_length": 256, "batch_size": 2, "tile_size": 32, "max_image_side": 64}
QUICK = ReadPolicy(block_bytes=128 * 1024, attempts=3, backoff=0.01, max_backoff=0.05, timeout=1)


@pytest.fixture
def behind_a_proxy(s3_bucket, moto_server):
    """shards_example in a bucket with sidecars (index version 2), and storage options that
    reach it through a FaultProxy."""
    bucket, options = s3_bucket
    fs, path = fsspec.core.url_to_fs(f"{bucket}/ds", **options)
    for name in sorted(os.listdir(EXAMPLE)):
        if name.endswith(".tar") or name == "index.json":
            fs.put_file(os.path.join(EXAMPLE, name), f"{path}/{name}")
    upgrade_dataset(f"{bucket}/ds", options)
    proxy = FaultProxy(int(moto_server.rsplit(":", 1)[1]))
    through = {
        "client_kwargs": {"endpoint_url": proxy.endpoint},
        "config_kwargs": {"retries": {"max_attempts": 1}},  # only wdsvlm's own retries
    }
    yield f"{bucket}/ds", through, proxy
    proxy.close()


def test_sidecars_given_up_on_are_an_error_and_refused_ones_are_left_out(
    behind_a_proxy, caplog, tmp_path
):
    url, options, proxy = behind_a_proxy
    policy = replace(QUICK, node_dir=str(tmp_path / "node"))  # no copy of a sidecar yet
    plan = Plan(url, storage_options=options, read_policy=policy)  # the index, no sidecar yet
    proxy.cut = 1.0  # every answer breaks off: retried, then given up
    with pytest.raises(
        wdsvlm.StorageError,
        match=r"len\(loader\) cannot be estimated: the sidecar of shard shapes-000000\.tar "
        r"could not be read \(.*gave up.*\); a rank that read it would count another epoch "
        r"length.*pass batches_per_epoch=",
    ):
        measured_shards(plan.sources[0])
    proxy.faults_off()
    proxy.status = 403  # refused: every rank is refused alike
    with caplog.at_level(logging.WARNING, logger="wdsvlm.sizing"):
        assert measured_shards(plan.sources[0]) == []
    assert "estimated without shard shapes-000004.tar" in caplog.text


def test_samples_given_up_on_are_an_error_and_refused_ones_are_left_out(behind_a_proxy):
    url, options, proxy = behind_a_proxy
    loader = wdsvlm.Loader(url, TOKENIZER, storage_options=options, read_policy=QUICK, **SMALL)
    pack = loader.stream.pack
    parts = (loader.plan, loader.tokenize, pack, loader.settings, loader.worker_config)
    assert estimate_batches(*parts) == len(loader)  # read again: the same number
    proxy.cut = 1.0  # the sidecars are read already; the samples measured break off
    with pytest.raises(
        wdsvlm.StorageError,
        match=r"len\(loader\) cannot be estimated: a sample of s3://.*/ds/shapes-00000\d\.tar "
        r"could not be read \(.*gave up",
    ):
        estimate_batches(*parts)
    proxy.faults_off()
    proxy.status = 403  # refused alike everywhere: measured without them
    assert estimate_batches(*parts) > 0
