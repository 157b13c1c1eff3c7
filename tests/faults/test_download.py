"""``--download``: a size cap and the progress bar (issue 23, item 12).

A server that sends without end (or announces more than the official archive)
is stopped at a cap instead of filling the data root, leaving no partial file;
``--no-progress`` hides the download bar. The servers listen on 127.0.0.1 only
and send a bounded amount. (Timeouts and bad URLs: test_data.py.)
"""
from __future__ import annotations

import http.server
import threading
import time

import pytest

from qsv_pyg.data import DataError, download_cifar
from qsv_pyg.data import cifar
from qsv_pyg.data.download import fetch
from qsv_pyg.training.cli import main

from .conftest import one_line_error, train_args


class _Server:
    """A loopback HTTP server; ``mode`` chooses what GET answers."""

    def __init__(self, mode: str, size: int = 0, bound: int = 64 << 20):
        outer = self
        self.sent = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                if mode == "announces-too-much":
                    self.send_header("Content-Length", str(10**12))
                elif mode == "small":
                    self.send_header("Content-Length", str(size))
                self.end_headers()
                total = size if mode == "small" else bound  # "endless", up to a bound
                chunk = b"\0" * (64 << 10)
                try:
                    while outer.sent < total:
                        n = min(len(chunk), total - outer.sent)
                        self.wfile.write(chunk[:n])
                        outer.sent += n
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/cifar-10-python.tar.gz"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_endless_download_stops_at_the_cap(tmp_path):
    with _Server("endless") as server:
        start = time.monotonic()
        with pytest.raises(DataError, match=r"stopped: it sent more than 1,048,576 bytes"):
            fetch(server.url, tmp_path / "a.tar.gz", "0" * 32, progress=False, timeout=10,
                  max_bytes=1 << 20)
        assert time.monotonic() - start < 60
    assert server.sent < 32 << 20  # it did not read the bound
    assert not any(tmp_path.iterdir())  # no partial file


def test_download_cifar_caps_a_repacked_archive_at_the_documented_margin(tmp_path,
                                                                         monkeypatch):
    spec = cifar._SPECS["cifar10"]
    assert spec.download_cap(spec.md5) == 170_498_071  # the official archive: its size
    assert spec.download_cap("0" * 32) == int(cifar.DOWNLOAD_SIZE_MARGIN * 170_498_071)
    monkeypatch.setattr(cifar, "DOWNLOAD_SIZE_MARGIN", 0.002)  # ~340 kB: a quick test
    with _Server("endless") as server:
        with pytest.raises(DataError, match="stopped"):
            download_cifar("cifar10", tmp_path, url=server.url, md5="0" * 32, progress=False)
    assert server.sent < 32 << 20
    assert not any(tmp_path.iterdir())


def test_download_announcing_more_than_the_official_archive_exits_2(tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.delenv("QSV_DATA_DIR", raising=False)
    (tmp_path / "data").mkdir()
    with _Server("announces-too-much", bound=8 << 20) as server:
        assert main(train_args(tmp_path / "data", tmp_path / "run", "--download-url",
                               server.url)) == 2
    one_line_error(capsys, "announced 1,000,000,000,000 bytes",
                   "more than the 170,498,071 bytes accepted for cifar-10-python.tar.gz")
    assert not any((tmp_path / "data").iterdir())


@pytest.mark.parametrize("flag", ["--no-progress", "--progress"])
def test_no_progress_hides_the_download_bar(tmp_path, capsys, monkeypatch, flag):
    monkeypatch.delenv("QSV_DATA_DIR", raising=False)
    (tmp_path / "data").mkdir()
    with _Server("small", size=300_000) as server:
        argv = train_args(tmp_path / "data", tmp_path / "run", "--download-url", server.url)
        assert main([*argv, flag]) == 2  # not the official archive: md5 mismatch
    err = capsys.readouterr().err
    assert "checksum mismatch" in err
    assert ("%|" in err) == (flag == "--progress"), err  # tqdm's bar
