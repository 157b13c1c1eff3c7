"""Faults of the CIFAR data loader: pickle bombs (issue 14, item 14), empty and
protocol-2 batch pickles (issue 23, item 11), failed downloads and corrupt local
copies (issue 14, item 15). Download size caps and the progress bar: test_download.py.
"""
from __future__ import annotations

import hashlib
import logging
import pickle
import socket
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from qsv_pyg.data import DataError, download_cifar, load_cifar
from qsv_pyg.data.download import fetch

from tiny_cifar import write_tiny_cifar10  # noqa: E402


class NumpyAsked(BaseException):
    """Raised by the guard below; a BaseException so no ``except Exception`` hides it."""


# --------------------------------------------------------------------------- 14. pickle bomb


def shared_nested_labels(depth: int = 30) -> list:
    """``[x, x]`` nested ``depth`` deep: a few hundred bytes pickled, 2**depth ints as numpy."""
    x = [0]
    for _ in range(depth):
        x = [x, x]
    return x


def test_pickle_of_shared_nested_lists_is_refused_before_numpy_sees_it(tmp_path, monkeypatch):
    write_tiny_cifar10(tmp_path, n_train=10, n_test=2)
    batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    labels = shared_nested_labels()
    batch.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": labels}))
    assert batch.stat().st_size < 7000  # the 2 x 3072 image bytes and ~700 bytes of labels
    real_asarray = np.asarray

    def guarded(value, *args, **kwargs):  # numpy would allocate 2**31 int64 here (16 GiB)
        if isinstance(value, list) and value and isinstance(value[0], list):
            raise NumpyAsked("numpy asked to convert nested lists")
        return real_asarray(value, *args, **kwargs)

    monkeypatch.setattr(np, "asarray", guarded)
    with pytest.raises(DataError, match=r"test_batch.*expand to more than .* items"):
        load_cifar("cifar10", "test", tmp_path)


def test_ordinary_files_are_within_the_bound(tmp_path):
    """The bound must not refuse real files: labels as a list, filenames sharing one bytes."""
    write_tiny_cifar10(tmp_path, n_train=500, n_test=100)
    assert len(load_cifar("cifar10", "train", tmp_path)) == 500


# ------------------------------------------ empty and protocol-2 pickles (issue 23, item 11)


def rewrite_test_batch(root: Path, n: int, protocol: int) -> Path:
    path = root / "cifar-10-batches-py" / "test_batch"
    rng = np.random.default_rng(1)
    batch = {b"batch_label": b"testing batch 1 of 1",
             b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
             b"labels": [int(i % 10) for i in range(n)],
             b"filenames": [f"img{i}.png".encode() for i in range(n)]}
    path.write_bytes(pickle.dumps(batch, protocol=protocol))
    return path


@pytest.mark.parametrize("protocol", [2, 4])
def test_empty_batch_is_reported_as_empty_not_corrupt(tmp_path, protocol):
    write_tiny_cifar10(tmp_path, n_train=10, n_test=4)
    rewrite_test_batch(tmp_path, 0, protocol)
    with pytest.raises(DataError) as info:
        load_cifar("cifar10", "test", tmp_path)
    message = str(info.value)
    assert "test_batch: the batch file is empty: 0 images" in message
    assert "corrupt" not in message and "truncated" not in message


@pytest.mark.parametrize("n", [1, 7])
def test_protocol_2_batch_reads_like_protocol_4(tmp_path, n):
    loaded = {}
    for protocol in (2, 4):
        root = tmp_path / f"p{protocol}"
        write_tiny_cifar10(root, n_train=10, n_test=4)
        rewrite_test_batch(root, n, protocol)
        loaded[protocol] = load_cifar("cifar10", "test", root)
    assert len(loaded[2]) == len(loaded[4]) == n
    assert (loaded[2].images == loaded[4].images).all()
    assert (loaded[2].labels == loaded[4].labels).all()


def test_protocol_2_bytes_call_with_arguments_is_still_refused(tmp_path):
    """Allowing ``bytes()`` for empty buffers must not let a tiny file allocate memory."""
    write_tiny_cifar10(tmp_path, n_train=10, n_test=4)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    # protocol 2: bytes(10**9) as GLOBAL + BININT + TUPLE1 + REDUCE
    path.write_bytes(b"\x80\x02c__builtin__\nbytes\nJ\x00\xca\x9a\x3b\x85R.")
    with pytest.raises(DataError, match="refusing to call builtins.bytes"):
        load_cifar("cifar10", "test", tmp_path)


# --------------------------------------------------------------------------- 15. download


def test_download_error_names_the_flag_that_takes_a_url(tmp_path):
    with pytest.raises(OSError) as info:
        download_cifar("cifar10", tmp_path, url="http://127.0.0.1:9/cifar.tar.gz",
                       md5="0" * 32, progress=False)
    message = str(info.value)
    assert "could not download http://127.0.0.1:9/cifar.tar.gz" in message
    assert "--download-url" in message and "as url" not in message
    assert not any(tmp_path.iterdir())  # no partial download left


def test_a_stalled_download_times_out(tmp_path):
    # A server that accepts the connection and never answers.
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}/cifar.tar.gz"
        start = time.monotonic()
        with pytest.raises(OSError, match="could not download"):
            fetch(url, tmp_path / "cifar.tar.gz", "0" * 32, progress=False, timeout=0.5)
        assert time.monotonic() - start < 30
    assert socket.getdefaulttimeout() is None  # the process-wide default is restored
    assert not any(tmp_path.iterdir())


def make_archive(tmp_path: Path) -> tuple[Path, str]:
    src = tmp_path / "src"
    write_tiny_cifar10(src, n_train=10, n_test=4)
    archive = tmp_path / "c10.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return archive, hashlib.md5(archive.read_bytes()).hexdigest()


@pytest.mark.parametrize("entry", ["load_cifar", "download_cifar"])
def test_corrupt_local_copy_is_reported_at_warning_level(tmp_path, caplog, entry):
    archive, md5 = make_archive(tmp_path)
    root = tmp_path / "root"
    write_tiny_cifar10(root, n_train=10, n_test=4)
    (root / "cifar-10-batches-py" / "test_batch").write_bytes(b"garbage")
    with caplog.at_level(logging.INFO, logger="qsv_pyg.data"):
        if entry == "load_cifar":
            assert len(load_cifar("cifar10", "test", root, download=True, url=str(archive),
                                  md5=md5, progress=False)) == 4
        else:
            download_cifar("cifar10", root, url=str(archive), md5=md5, progress=False)
    reasons = [r for r in caplog.records if "test_batch" in r.getMessage()]
    assert reasons and all(r.levelno >= logging.WARNING for r in reasons), caplog.records
