"""Tests for qsv_pyg.data: CIFAR loading/validation/download and batch augmentation."""
from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import pickle
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from qsv_pyg.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    BatchAugment,
    DataError,
    DeviceLoader,
    ImageDataset,
    batches,
    download_cifar,
    load_cifar,
    normalize,
    random_crop_flip,
    resolve_data_dir,
)

REPO = Path(__file__).resolve().parents[1]
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck"]


# --------------------------------------------------------------------------- helpers


def _dump(path: Path, obj, protocol: int = 4) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=protocol))


def write_cifar10(root: Path, per_batch: int = 6, seed: int = 0) -> dict[str, tuple]:
    """Tiny CIFAR-10 python layout under ``root``; returns ``split -> (data, labels)``."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    out: dict[str, list] = {"train": [], "test": []}
    files = [(f"data_batch_{i}", "train") for i in range(1, 6)] + [("test_batch", "test")]
    for k, (fname, split) in enumerate(files):
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, size=per_batch)]
        # The official files are protocol-2 pickles, the local copy protocol 4.
        _dump(folder / fname, {b"batch_label": fname.encode(), b"data": data,
                               b"labels": labels,
                               b"filenames": [b"img.png"] * per_batch},
              protocol=2 if k == 0 else 4)
        out[split].append((data, labels))
    _dump(folder / "batches.meta", {b"label_names": [c.encode() for c in CIFAR10_CLASSES],
                                    b"num_cases_per_batch": per_batch, b"num_vis": 3072})
    return {s: (np.concatenate([d for d, _ in v]), np.concatenate([l for _, l in v]))
            for s, v in out.items()}


def write_cifar100(root: Path, n_train: int = 12, n_test: int = 5) -> dict[str, tuple]:
    rng = np.random.default_rng(1)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        fine = [int(x) for x in rng.integers(0, 100, size=n)]
        _dump(folder / split, {b"data": data, b"fine_labels": fine,
                               b"coarse_labels": [f // 5 for f in fine],
                               b"filenames": [b"x.png"] * n})
        out[split] = (data, np.array(fine))
    _dump(folder / "meta", {b"fine_label_names": [f"class_{i}".encode() for i in range(100)],
                            b"coarse_label_names": [f"super_{i}".encode() for i in range(20)]})
    return out


def make_archive(src_root: Path, dest: Path, folder: str = "cifar-10-batches-py") -> str:
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(src_root / folder, arcname=folder)
    return hashlib.md5(dest.read_bytes()).hexdigest()


@pytest.fixture
def tiny10(tmp_path):
    root = tmp_path / "data"
    return root, write_cifar10(root)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep pytest output clean
        pass


@pytest.fixture
def http_dir(tmp_path, monkeypatch):
    """A local HTTP server on 127.0.0.1 serving ``tmp_path/srv``."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    serve = tmp_path / "srv"
    serve.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(serve))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield serve, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# --------------------------------------------------------------------------- loading


def test_load_tiny_cifar10(tiny10):
    root, expected = tiny10
    for split, n in (("train", 30), ("test", 6)):
        ds = load_cifar("cifar10", split, root)
        data, labels = expected[split]
        assert len(ds) == n
        assert ds.images.shape == (n, 3, 32, 32) and ds.images.dtype == torch.uint8
        assert ds.labels.shape == (n,) and ds.labels.dtype == torch.int64
        assert ds.classes == CIFAR10_CLASSES
        # Channel-major rows: the first 1024 bytes are the red plane.
        assert torch.equal(ds.images.reshape(n, -1), torch.from_numpy(data))
        assert torch.equal(ds.images[0, 0], torch.from_numpy(data[0, :1024].reshape(32, 32)))
        assert ds.labels.tolist() == labels.tolist()


def test_load_tiny_cifar100(tmp_path):
    expected = write_cifar100(tmp_path)
    ds = load_cifar("CIFAR-100", "train", tmp_path)
    data, fine = expected["train"]
    assert ds.images.shape == (12, 3, 32, 32) and ds.images.dtype == torch.uint8
    assert ds.labels.tolist() == fine.tolist() and ds.labels.dtype == torch.int64
    assert len(ds.classes) == 100 and ds.classes[7] == "class_7"
    assert torch.equal(ds.images.reshape(12, -1), torch.from_numpy(data))
    assert len(load_cifar("cifar100", "test", tmp_path)) == 5


def test_layout_folder_itself_and_old_numpy_pickles(tmp_path):
    root = tmp_path / "d"
    expected = write_cifar10(root, per_batch=3)
    folder = root / "cifar-10-batches-py"
    # Files written by numpy < 2 (the official ones) reference numpy.core.multiarray.
    raw = pickle.dumps({b"data": expected["test"][0], b"labels": [1, 2, 3]}, protocol=2)
    (folder / "test_batch").write_bytes(raw.replace(b"numpy._core.", b"numpy.core."))
    ds = load_cifar("cifar10", "test", folder)  # ROOT may be the layout folder itself
    assert ds.labels.tolist() == [1, 2, 3]


def test_real_cifar10_test_split():
    # $QSV_DATA_DIR, else the shared data folder beside the checkout (../shared/data).
    candidates = [os.environ.get("QSV_DATA_DIR"), REPO.parent / "shared" / "data"]
    root = next((Path(c) for c in candidates
                 if c and (Path(c) / "cifar-10-batches-py" / "test_batch").is_file()), None)
    if root is None:
        pytest.skip("real CIFAR-10 not available (set QSV_DATA_DIR)")
    ds = load_cifar("cifar10", "test", root)
    assert ds.images.shape == (10000, 3, 32, 32) and ds.images.dtype == torch.uint8
    assert int(ds.labels.min()) == 0 and int(ds.labels.max()) == 9
    assert ds.class_counts().tolist() == [1000] * 10
    assert ds.classes == CIFAR10_CLASSES


def test_subset_deterministic_and_balanced(tiny10):
    root, _ = tiny10
    labels = torch.arange(100) % 10
    ds = ImageDataset(torch.arange(100, dtype=torch.uint8).view(100, 1, 1, 1).expand(
        100, 3, 2, 2).contiguous(), labels, CIFAR10_CLASSES)
    a, b, c = ds.subset(20, seed=0), ds.subset(20, seed=0), ds.subset(20, seed=1)
    assert len(a) == 20 and a.class_counts().tolist() == [2] * 10
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    ids = a.images[:, 0, 0, 0]
    assert torch.equal(a.labels, ids.long() % 10)  # images and labels stay paired
    assert ds.subset(10**6) is ds
    with pytest.raises(ValueError):
        ds.subset(0)
    assert len(load_cifar("cifar10", "train", root).subset(7, seed=3)) == 7


# --------------------------------------------------------------------------- errors


def test_resolve_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QSV_DATA_DIR", str(tmp_path / "env"))
    assert resolve_data_dir(None) == tmp_path / "env"
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"  # argument wins
    monkeypatch.delenv("QSV_DATA_DIR")
    with pytest.raises(DataError, match=r"--data-dir.*QSV_DATA_DIR"):
        resolve_data_dir(None)


def test_env_var_used_by_load(tiny10, monkeypatch):
    root, _ = tiny10
    monkeypatch.setenv("QSV_DATA_DIR", str(root))
    assert len(load_cifar("cifar10", "test")) == 6


def test_missing_directory_message(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_cifar("cifar10", "test", tmp_path / "nowhere")
    msg = str(info.value)
    assert "cifar-10-batches-py" in msg and "batches.meta" in msg and "--download" in msg


def test_bad_arguments(tiny10):
    root, _ = tiny10
    with pytest.raises(ValueError, match="unknown dataset"):
        load_cifar("mnist", "train", root)
    with pytest.raises(ValueError, match="unknown split"):
        load_cifar("cifar10", "val", root)


@pytest.mark.parametrize("case, pattern", [
    ("corrupt", r"data_batch_2.*unpickling failed"),
    ("shape", r"data_batch_2.*\[N, 3072\].*uint8 array of shape \[6, 3000\]"),
    ("dtype", r"data_batch_2.*float32 array"),
    ("range", r"data_batch_2.*labels out of range.*10\]"),
    ("nlabels", r"data_batch_2.*list of length 5.*for 6 images"),
    ("missing_key", r"data_batch_2.*b'labels'.*missing"),
    ("not_dict", r"data_batch_2.*got list"),
    ("malicious", r"data_batch_2.*refusing to load global"),
    ("truncated", r"data_batch_2.*unpickling failed"),
])
def test_corrupt_batch_names_file(tiny10, case, pattern):
    root, _ = tiny10
    path = root / "cifar-10-batches-py" / "data_batch_2"
    good = {b"data": np.zeros((6, 3072), np.uint8), b"labels": [0] * 6}
    payloads = {
        "corrupt": b"this is not a pickle",
        "shape": pickle.dumps({**good, b"data": np.zeros((6, 3000), np.uint8)}),
        "dtype": pickle.dumps({**good, b"data": np.zeros((6, 3072), np.float32)}),
        "range": pickle.dumps({**good, b"labels": [0, 1, 2, 3, 4, 10]}),
        "nlabels": pickle.dumps({**good, b"labels": [0] * 5}),
        "missing_key": pickle.dumps({b"data": good[b"data"]}),
        "not_dict": pickle.dumps([1, 2, 3]),
        "malicious": pickle.dumps(_Evil()),
        "truncated": path.read_bytes()[:1000],
    }
    path.write_bytes(payloads[case])
    with pytest.raises(DataError, match=pattern):
        load_cifar("cifar10", "train", root)
    assert len(load_cifar("cifar10", "test", root)) == 6  # other splits still load


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())  # harmless, but any callable must be refused


def test_missing_batch_and_bad_meta(tiny10):
    root, _ = tiny10
    folder = root / "cifar-10-batches-py"
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        load_cifar("cifar10", "train", root)
    _dump(folder / "batches.meta", {b"label_names": [b"a", b"b"]})
    with pytest.raises(DataError, match=r"batches\.meta.*10 class names"):
        load_cifar("cifar10", "test", root)


# --------------------------------------------------------------------------- download


def test_download_http(tmp_path, http_dir):
    serve, base = http_dir
    write_cifar10(tmp_path / "src")
    md5 = make_archive(tmp_path / "src", serve / "c10.tar.gz")
    root = tmp_path / "root"
    layout = download_cifar("cifar10", root, url=f"{base}/c10.tar.gz", md5=md5, progress=False)
    assert layout == root / "cifar-10-batches-py"
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-batches-py"]  # no leftovers
    assert len(load_cifar("cifar10", "train", root)) == 30
    # A valid layout is not fetched again (the URL is unreachable now).
    assert download_cifar("cifar10", root, url=f"{base}/gone.tar.gz", md5=md5) == layout
    # load_cifar(download=True) fetches into an empty root.
    ds = load_cifar("cifar10", "test", tmp_path / "root2", download=True,
                    url=f"{base}/c10.tar.gz", md5=md5, progress=False)
    assert len(ds) == 6


def test_download_wrong_md5_leaves_nothing(tmp_path, http_dir):
    serve, base = http_dir
    write_cifar10(tmp_path / "src")
    md5 = make_archive(tmp_path / "src", serve / "c10.tar.gz")
    root = tmp_path / "root"
    with pytest.raises(DataError) as info:
        download_cifar("cifar10", root, url=f"{base}/c10.tar.gz", md5="0" * 32, progress=False)
    msg = str(info.value)
    assert "cifar-10-python.tar.gz" in msg and "0" * 32 in msg and md5 in msg
    assert list(root.iterdir()) == []


def test_download_file_url_and_local_path(tmp_path):
    write_cifar10(tmp_path / "src")
    archive = tmp_path / "c10.tar.gz"
    md5 = make_archive(tmp_path / "src", archive)
    layout = download_cifar("cifar10", tmp_path / "a", url=archive.as_uri(), md5=md5,
                            progress=False)
    assert len(load_cifar("cifar10", "test", layout.parent)) == 6
    download_cifar("cifar10", tmp_path / "b", url=str(archive), md5=md5)
    assert archive.is_file()  # a local archive is used in place, never deleted
    assert len(load_cifar("cifar10", "test", tmp_path / "b")) == 6


def test_download_repairs_corrupt_layout(tiny10, tmp_path):
    root, _ = tiny10
    write_cifar10(tmp_path / "src")
    archive = tmp_path / "c10.tar.gz"
    md5 = make_archive(tmp_path / "src", archive)
    (root / "cifar-10-batches-py" / "data_batch_4").write_bytes(b"garbage")
    ds = load_cifar("cifar10", "train", root, download=True, url=str(archive), md5=md5)
    assert len(ds) == 30


@pytest.mark.parametrize("member", ["../evil.txt", "/tmp/qsv_evil_abs.txt",
                                    "cifar-10-batches-py/../../evil.txt", "link", "hardlink",
                                    "device"])
def test_unsafe_archive_rejected(tmp_path, member):
    write_cifar10(tmp_path / "src", per_batch=2)
    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
        info = tarfile.TarInfo(member)
        if member in ("link", "hardlink"):
            info.type = tarfile.SYMTYPE if member == "link" else tarfile.LNKTYPE
            info.linkname = "/etc/passwd" if member == "link" else "cifar-10-batches-py/test_batch"
            tar.addfile(info)
        elif member == "device":
            info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            tar.addfile(info)
        else:
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    root = tmp_path / "root"
    with pytest.raises(DataError, match="refusing to extract"):
        download_cifar("cifar10", root, url=str(archive), md5=md5)
    assert list(root.iterdir()) == []  # staging removed, nothing installed
    assert not (tmp_path / "evil.txt").exists()
    assert not Path("/tmp/qsv_evil_abs.txt").exists()


def test_download_reads_every_file_once(tmp_path, monkeypatch):
    """Unpacking validates the layout by reading it; the requested split comes from that read."""
    write_cifar10(tmp_path / "src")
    archive = tmp_path / "c10.tar.gz"
    md5 = make_archive(tmp_path / "src", archive)
    reads: list = []
    real_open = open

    def counting_open(file, mode="r", *args, **kwargs):
        name = Path(str(file)).name
        if "r" in mode and name.startswith(("data_batch", "test_batch", "batches.meta")):
            reads.append(name)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    ds = load_cifar("cifar10", "train", tmp_path / "root", download=True, url=str(archive),
                    md5=md5, progress=False)
    monkeypatch.undo()
    assert len(ds) == 30
    assert sorted(reads) == sorted(["batches.meta", "test_batch"]
                                   + [f"data_batch_{i}" for i in range(1, 6)]), reads


def test_archive_without_valid_layout(tmp_path):
    write_cifar10(tmp_path / "src", per_batch=2)
    (tmp_path / "src" / "cifar-10-batches-py" / "test_batch").unlink()
    archive = tmp_path / "incomplete.tar.gz"
    md5 = make_archive(tmp_path / "src", archive)
    with pytest.raises(DataError, match=r"valid CIFAR-10 layout.*test_batch"):
        download_cifar("cifar10", tmp_path / "root", url=str(archive), md5=md5)
    assert list((tmp_path / "root").iterdir()) == []


# --------------------------------------------------------------------------- augmentation


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_crop_flip_shapes_and_reproducibility():
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=_gen(0))
    a = random_crop_flip(x, 4, _gen(1))
    assert a.shape == x.shape and a.dtype == torch.uint8
    assert torch.equal(a, random_crop_flip(x, 4, _gen(1)))
    assert not torch.equal(a, random_crop_flip(x, 4, _gen(2)))
    assert random_crop_flip(x, 0, _gen(1), flip=False) is x
    with pytest.raises(TypeError):
        random_crop_flip(x.float(), 4)


def _reference_crop_flip(img: torch.Tensor, dy: int, dx: int, flip: bool, p: int):
    padded = torch.nn.functional.pad(img, (p, p, p, p))
    crop = padded[:, dy:dy + img.shape[1], dx:dx + img.shape[2]]
    return crop.flip(-1) if flip else crop


def test_crop_flip_matches_padded_reference():
    # A known pattern: every pixel's value encodes its position (rows * 8 + cols + 1).
    h = w = 8
    n = 40
    base = (torch.arange(h)[:, None] * w + torch.arange(w) + 1).to(torch.uint8)
    x = base.expand(n, 3, h, w).contiguous()
    x[:, 1] += 100  # channels differ so a channel mix-up would show
    p = 2
    out = random_crop_flip(x, p, _gen(5))
    # Replay the draws (dy, dx, flip in this order) to get each image's parameters.
    g = _gen(5)
    dy = torch.randint(0, 2 * p + 1, (n,), generator=g)
    dx = torch.randint(0, 2 * p + 1, (n,), generator=g)
    fl = torch.randint(0, 2, (n,), generator=g).bool()
    for i in range(n):
        ref = _reference_crop_flip(x[i], int(dy[i]), int(dx[i]), bool(fl[i]), p)
        assert torch.equal(out[i], ref), i
    assert fl.any() and not fl.all() and (dy != p).any()  # the cases were exercised
    # Shifted content, from the pattern alone: output pixel (r, c) of an image cropped
    # at (dy, dx) shows source pixel (r + dy - p, c' + dx - p) with c' = c, or
    # c' = w - 1 - c when flipped, and 0 where that falls into the padding.
    r = torch.arange(h)[:, None]
    c = torch.arange(w)[None, :]
    for i in range(n):
        cc = (w - 1 - c) if fl[i] else c
        sr, sc = r + dy[i] - p, cc + dx[i] - p
        inside = (sr >= 0) & (sr < h) & (sc >= 0) & (sc < w)
        expected = torch.where(inside, sr * w + sc + 1, 0).to(torch.uint8)
        assert torch.equal(out[i, 0], expected), i
        assert torch.equal(out[i, 1], torch.where(inside, expected + 100, 0).to(torch.uint8))


def test_flip_only():
    x = torch.randint(0, 256, (32, 3, 4, 5), dtype=torch.uint8, generator=_gen(0))
    out = random_crop_flip(x, 0, _gen(3))
    flipped = (out == x.flip(-1)).flatten(1).all(1)
    same = (out == x).flatten(1).all(1)
    assert bool((flipped | same).all()) and flipped.any() and same.any()


def test_normalize_values():
    x = torch.tensor([0, 255], dtype=torch.uint8).view(1, 1, 1, 2).expand(2, 3, 1, 2)
    y = normalize(x, CIFAR10_MEAN, CIFAR10_STD)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 1, 2)
    for c in range(3):
        assert y[0, c, 0, 0].item() == pytest.approx(-CIFAR10_MEAN[c] / CIFAR10_STD[c], rel=1e-6)
        assert y[1, c, 0, 1].item() == pytest.approx((1 - CIFAR10_MEAN[c]) / CIFAR10_STD[c],
                                                     rel=1e-6)
    with pytest.raises(TypeError):
        normalize(y, CIFAR10_MEAN, CIFAR10_STD)  # already float: would be scaled twice
    with pytest.raises(ValueError):
        normalize(x, (0.5, 0.5), (1.0, 1.0))
    ev = BatchAugment.for_dataset("cifar10", train=False)
    assert not ev.is_random and torch.equal(ev(x), y)
    assert BatchAugment.for_dataset("cifar100", train=True).crop_padding == 4


# --------------------------------------------------------------------------- batching


def _index_dataset(n: int) -> ImageDataset:
    """Dataset whose image i is filled with the value i, so batches reveal indices."""
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, 4, 4)
    return ImageDataset(images.contiguous(), torch.arange(n) % 10, CIFAR10_CLASSES)


def _ids(x: torch.Tensor, gen=None) -> torch.Tensor:
    return x.float()  # identity "augmentation" keeps the index readable


def _epoch_ids(loader: DeviceLoader, epoch: int, start: int = 0) -> list[int]:
    return [int(v) for imgs, _ in loader.epoch(epoch, start) for v in imgs[:, 0, 0, 0]]


def test_batches_shapes_and_labels():
    ds = _index_dataset(50)
    out = list(batches(ds, 16, augment=BatchAugment.for_dataset("cifar10", True),
                       device="cpu", shuffle=True, seed=1))
    assert [b[0].shape[0] for b in out] == [16, 16, 16, 2]
    assert all(b[0].dtype == torch.float32 and b[0].shape[1:] == (3, 4, 4) for b in out)
    assert all(b[1].dtype == torch.int64 for b in out)
    loader = DeviceLoader(ds, 16, augment=_ids, shuffle=True, seed=1, drop_last=True)
    assert len(loader) == 3
    for imgs, labels in loader.epoch(0):  # labels stay paired with their images
        assert torch.equal(labels, imgs[:, 0, 0, 0].long() % 10)


def test_sharding_covers_each_sample_once():
    ds = _index_dataset(60)
    for epoch in (0, 1):
        shards = [_epoch_ids(DeviceLoader(ds, 7, augment=_ids, shuffle=True, seed=3,
                                          rank=r, world_size=2), epoch) for r in (0, 1)]
        assert len(shards[0]) == len(shards[1]) == 30
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(60))
    # Uneven sizes: equal disjoint shards, at most world_size - 1 samples left out.
    shards = [DeviceLoader(_index_dataset(61), 8, augment=_ids, rank=r, world_size=3)
              .indices(0) for r in range(3)]
    assert all(len(s) == 20 for s in shards) and len(set(torch.cat(shards).tolist())) == 60


def test_order_reproducible_per_seed_and_epoch():
    ds = _index_dataset(64)
    aug = BatchAugment(CIFAR10_MEAN, CIFAR10_STD, crop_padding=1, flip=True)
    make = functools.partial(DeviceLoader, ds, 8, augment=aug, shuffle=True)
    a, b = make(seed=0), make(seed=0)
    assert torch.equal(a.indices(2), b.indices(2))
    assert not torch.equal(a.indices(2), a.indices(3))
    assert not torch.equal(a.indices(2), make(seed=1).indices(2))
    first = list(a.epoch(2))
    second = list(b.epoch(2))
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
               for x, y in zip(first, second))
    # Resuming mid-epoch reproduces the remaining batches, augmentation included.
    resumed = list(b.epoch(2, start_batch=5))
    assert len(resumed) == 3
    assert all(torch.equal(x[0], y[0]) for x, y in zip(first[5:], resumed))
    unshuffled = DeviceLoader(ds, 8, augment=_ids)
    assert _epoch_ids(unshuffled, 0) == list(range(64)) == _epoch_ids(unshuffled, 9)


def test_loader_argument_checks():
    ds = _index_dataset(4)
    with pytest.raises(ValueError):
        DeviceLoader(ds, 0, augment=_ids)
    with pytest.raises(ValueError):
        DeviceLoader(ds, 2, augment=_ids, rank=2, world_size=2)
    with pytest.raises(ValueError):
        DeviceLoader(ds, 2, augment=_ids, world_size=5)
