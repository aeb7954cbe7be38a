"""The native readers of an archive's files refuse what the Python opener refuses (issue 33,
items 9-10): the archive layer checks each file just before the native code opens it by path,
so the native open itself must not follow a link or wait on a FIFO swapped in between. Each
reader is called directly on a symbolic link, a FIFO and a directory: one-line OSError naming
the path, at once (a reader that blocks is unblocked by opening the FIFO's write end, and the
test fails). A regular file still reads."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from vitrify import _native, snapshot

LIMIT_S = 10.0
GRAN = 64 * 1024


def _call(fn, fifo: str):
    """(exception or None, returned promptly): ``fn()`` on a thread, given LIMIT_S seconds."""
    out: dict = {}

    def run():
        try:
            fn()
        except BaseException as e:  # the test asserts on exactly what came back
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(LIMIT_S)
    prompt = not t.is_alive()
    for _ in range(100):  # a reader blocked in open(FIFO) returns once a writer comes
        if not t.is_alive():
            break
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        t.join(0.1)
    return out.get("error"), prompt


@pytest.fixture
def planted(tmp_path):
    """A real span file and, beside it, a link to it, a FIFO, a link to the FIFO, a directory."""
    src = snapshot.HostBackend(4 * GRAN, [(GRAN, 2 * GRAN)], GRAN)
    good = str(tmp_path / "weights.span")
    dumped = snapshot.dump_to_file(good, src.base, 0, 4 * GRAN, target=src, chunk_bytes=GRAN,
                                   granularity=GRAN, direct_io="off", progress=None)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)
    os.symlink(good, tmp_path / "link")
    os.symlink(fifo, tmp_path / "fifo-link")
    os.mkdir(tmp_path / "dir")
    odd = {
        "link": (str(tmp_path / "link"), OSError, errno.ELOOP, "a symbolic link"),
        "fifo-link": (str(tmp_path / "fifo-link"), OSError, errno.ELOOP, "a symbolic link"),
        "fifo": (fifo, OSError, errno.EINVAL, "a FIFO"),
        "dir": (str(tmp_path / "dir"), IsADirectoryError, errno.EISDIR, "a directory"),
    }
    return good, dumped, fifo, odd


def _readers(path: str, size: int):
    dst = snapshot.HostBackend(4 * GRAN, [], GRAN)
    return {
        "file_crc32c": (lambda: _native.file_crc32c(path), "file"),
        "span_file_info": (lambda: _native.span_file_info(path), "span file"),
        "span_verify_file(off)": (lambda: _native.span_verify_file(path, "off"), "span file"),
        "span_verify_file(auto)": (lambda: _native.span_verify_file(path, "auto"), "span file"),
        "span_restore_file": (lambda: _native.span_restore_file(dst, path, dst.base, 4 * GRAN,
                                                                "off", None), "span file"),
        "read_whole_files": (lambda: _native.read_whole_files([path], [size], 1), "file"),
    }


@pytest.mark.parametrize("which", ["link", "fifo-link", "fifo", "dir"])
def test_native_readers_refuse_links_fifos_and_directories_at_once_naming_the_path(planted, which):
    good, dumped, fifo, odd = planted
    path, cls, err, kind = odd[which]
    for name, (fn, what) in _readers(path, dumped["file_bytes"]).items():
        e, prompt = _call(fn, fifo)
        assert prompt, f"{name} on {which} blocked for {LIMIT_S} s"
        assert type(e) is cls, f"{name} on {which}: {e!r}"
        assert e.errno == err, f"{name} on {which}: {e!r}"
        msg = str(e)
        assert "\n" not in msg
        assert msg == (f"[Errno {err}] open(\"{path}\", read-only): {what} is {kind}; vitrify "
                       f"reads only regular files and never follows a link there: "
                       f"{os.strerror(err)}"), name


def test_the_regular_file_still_reads_and_the_callers_own_descriptor_reopens(planted):
    good, dumped, fifo, _ = planted
    assert _native.file_crc32c(good) == dumped["file_crc32c"]
    assert _native.span_file_info(good)["file_bytes"] == dumped["file_bytes"]
    _native.span_verify_file(good, "off")
    src_bytes = open(good, "rb").read()
    [(size, data, crc)] = _native.read_whole_files([good], [len(src_bytes)], 1)
    assert (size, data, crc) == (len(src_bytes), src_bytes, dumped["file_crc32c"])
    dst = snapshot.HostBackend(4 * GRAN, [], GRAN)
    st = _native.span_restore_file(dst, good, dst.base, 4 * GRAN, "off", None)
    assert st["bytes_written"] == 3 * GRAN
    # /proc/self/fd/<n> (what the archive layer passes for a file it holds open) reopens that
    # very file; the descriptor of a FIFO is refused at once all the same.
    fd = os.open(good, os.O_RDONLY)
    ffd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert _native.file_crc32c(f"/proc/self/fd/{fd}") == dumped["file_crc32c"]
        e, prompt = _call(lambda: _native.file_crc32c(f"/proc/self/fd/{ffd}"), fifo)
        assert prompt
        assert type(e) is OSError and e.errno == errno.EINVAL, repr(e)
        assert f'"/proc/self/fd/{ffd}"' in str(e) and "is a FIFO" in str(e)
    finally:
        os.close(fd)
        os.close(ffd)
