"""vitrify.jit on CPU: JIT caches redirected at FREEZE, packed into an archive, unpacked verified
and atomically at THAW, and every compile after the thaw named (J1-J5 in vitrify/jit.py)."""

from __future__ import annotations

import os

import pytest

from vitrify import jit
from vitrify.archive import ArchiveCorrupt, ArchiveWriter, Fingerprint, Region, open_archive

FP = Fingerprint(gpu="NVIDIA H200", sm="9.0", driver="580.159.04", cuda="13.0", torch="2.11.0")
REGION = Region(base=0x7F0000000000, size=1 << 30, granularity=2 << 20)


def fill(dirs: dict) -> None:
    """What Triton and SGLang's tvm-ffi JIT leave in their caches after a warm start."""
    t = dirs["triton"]
    for h, files in {"AB12": {"_fwd_kernel.cubin": b"\x7fELF" + b"k" * 3000,
                              "_fwd_kernel.json": b'{"name": "_fwd_kernel"}',
                              "__grp___fwd_kernel.json": b"{}"},
                     "CD34": {"rmsnorm.cubin": b"\x7fELF" + b"r" * 500}}.items():
        os.makedirs(os.path.join(t, h))
        for f, data in files.items():
            with open(os.path.join(t, h, f), "wb") as fh:
                fh.write(data)
    os.makedirs(os.path.join(t, "tmp.pid_77_123"))  # an in-flight write: skipped
    with open(os.path.join(t, "tmp.pid_77_123", "x.cubin"), "wb") as fh:
        fh.write(b"partial")
    b = os.path.join(dirs["tvm-ffi"], "sgl_kernel_jit_kvcache_9f")
    os.makedirs(b)
    for f, data in {"sgl_kernel_jit_kvcache_9f.so": b"\x7fELF" + b"s" * 2000,
                    "main.o": b"obj", "build.ninja": b"rule", ".ninja_log": b"log"}.items():
        with open(os.path.join(b, f), "wb") as fh:
            fh.write(data)


def freeze(tmp_path, env) -> tuple[str, dict]:
    dirs = jit.redirect(tmp_path / "work", env)
    fill(dirs)
    path = str(tmp_path / "engine.vitrify")
    with ArchiveWriter(path, FP, REGION) as w:
        index = jit.pack(w, dirs)
    return path, index


def test_redirect_points_every_cache_at_an_empty_directory_of_its_own(tmp_path):
    env: dict = {"TRITON_CACHE_DIR": "/home/u/.triton/cache"}
    dirs = jit.redirect(tmp_path / "w", env)
    assert set(dirs) == {"triton", "tvm-ffi"}
    assert env["TRITON_CACHE_DIR"] == dirs["triton"] == str(tmp_path / "w" / "triton")
    assert env["TVM_FFI_CACHE_DIR"] == dirs["tvm-ffi"]
    assert oct(os.stat(dirs["triton"]).st_mode & 0o777) == "0o700"
    foreign = tmp_path / "foreign" / "tvm-ffi"
    foreign.mkdir(parents=True)
    (foreign / "someone.so").write_bytes(b"x")  # not a directory vitrify made
    env2: dict = {}
    with pytest.raises(jit.JitCacheError, match="not empty and not vitrify's"):
        jit.redirect(tmp_path / "foreign", env2)
    assert env2 == {} and (foreign / "someone.so").exists()  # nothing set, nothing removed


def test_pack_keeps_the_builds_and_skips_leftovers(tmp_path):
    path, index = freeze(tmp_path, {})
    caches = index["caches"]
    assert caches["triton"]["files"] == ["AB12/__grp___fwd_kernel.json", "AB12/_fwd_kernel.cubin",
                                         "AB12/_fwd_kernel.json", "CD34/rmsnorm.cubin"]
    assert caches["tvm-ffi"]["files"] == ["sgl_kernel_jit_kvcache_9f/sgl_kernel_jit_kvcache_9f.so"]
    assert caches["tvm-ffi"]["bytes"] == 2004
    a = open_archive(path, checksums=True)
    assert jit.read_index(a) == index
    assert a.has_file("jit/triton/CD34/rmsnorm.cubin")
    assert not any("tmp." in rel or rel.endswith(".o") for rel in a.files)


def test_unpack_restores_every_file_and_points_the_environment_there(tmp_path):
    path, index = freeze(tmp_path, {})
    env: dict = {}
    dirs = jit.unpack(open_archive(path), tmp_path / "thaw", env)
    assert env == {"TRITON_CACHE_DIR": dirs["triton"], "TVM_FFI_CACHE_DIR": dirs["tvm-ffi"]}
    with open(os.path.join(dirs["triton"], "AB12", "_fwd_kernel.cubin"), "rb") as f:
        assert f.read() == b"\x7fELF" + b"k" * 3000
    assert jit.compiled_since(dirs, index) == {"triton": [], "tvm-ffi": []}
    # a compile after the thaw (a new kernel, a rebuilt module) is named
    os.makedirs(os.path.join(dirs["triton"], "EF56"))
    with open(os.path.join(dirs["triton"], "EF56", "new.cubin"), "wb") as f:
        f.write(b"new")
    assert jit.compiled_since(dirs, index) == {"triton": ["EF56/new.cubin"], "tvm-ffi": []}


def test_a_second_unpack_of_the_same_archive_reuses_the_directory(tmp_path):
    path, _ = freeze(tmp_path, {})
    dest = tmp_path / "thaw"
    jit.unpack(open_archive(path), dest, {})
    probe = dest / "triton" / "probe"
    probe.write_bytes(b"left by the first thaw")
    jit.unpack(open_archive(path), dest, {})
    assert probe.exists()  # reused, not rewritten
    (dest / ".vitrify-jit").write_text("0" * 64)  # another archive's content
    jit.unpack(open_archive(path), dest, {})
    assert not probe.exists() and (dest / "triton" / "CD34" / "rmsnorm.cubin").exists()


def test_a_damaged_cache_file_is_refused_and_nothing_is_unpacked(tmp_path):
    path, _ = freeze(tmp_path, {})
    victim = os.path.join(path, "jit", "triton", "AB12", "_fwd_kernel.cubin")
    with open(victim, "r+b") as f:
        f.seek(10)
        f.write(b"X")
    env: dict = {}
    with pytest.raises(ArchiveCorrupt, match="checksum mismatch"):
        jit.unpack(open_archive(path), tmp_path / "thaw", env)
    assert env == {} and not (tmp_path / "thaw").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith("thaw.tmp-")]


def test_an_archive_without_caches_sets_nothing(tmp_path):
    path = str(tmp_path / "plain.vitrify")
    with ArchiveWriter(path, FP, REGION) as w:
        w.write_json("rank0/state.json", {})
    env: dict = {}
    assert jit.unpack(open_archive(path), tmp_path / "thaw", env) == {} and env == {}
    assert jit.read_index(open_archive(path)) is None


def test_a_symlink_in_a_cache_is_refused_naming_it(tmp_path):
    dirs = jit.redirect(tmp_path / "w", {})
    os.symlink("/etc/passwd", os.path.join(dirs["triton"], "link.cubin"))
    with pytest.raises(jit.JitCacheError, match="link.cubin is not a regular file"):
        jit.listing(dirs)
    os.unlink(os.path.join(dirs["triton"], "link.cubin"))
    os.symlink("/etc", os.path.join(dirs["triton"], "d"))
    with pytest.raises(jit.JitCacheError, match="is a symlink"):
        jit.listing(dirs)


def test_an_index_listing_a_file_the_manifest_lacks_is_corrupt(tmp_path):
    path = str(tmp_path / "bad.vitrify")
    with ArchiveWriter(path, FP, REGION) as w:
        w.write_json(jit.INDEX, {"format": 1, "caches": {"triton": {
            "variable": "TRITON_CACHE_DIR", "files": ["x/y.cubin"], "bytes": 0}}})
    with pytest.raises(ArchiveCorrupt, match=r"jit/index.json: caches\['triton'\].files\[0\]: "
                                             r"lists triton/x/y.cubin, which the manifest lacks"):
        jit.read_index(open_archive(path))
    path2 = str(tmp_path / "bad2.vitrify")
    with ArchiveWriter(path2, FP, REGION) as w:
        w.write_json(jit.INDEX, {"format": 1, "caches": {"inductor": {
            "variable": "X", "files": [], "bytes": 0}}})
    with pytest.raises(ArchiveCorrupt, match=r"jit/index.json: caches\['inductor'\]: must be "
                                             r"one of 'triton', 'tvm-ffi', got str 'inductor'"):
        jit.read_index(open_archive(path2))


def test_the_work_directory_is_vitrifys_and_cleared_by_the_next_freeze(tmp_path):
    dirs = jit.redirect(tmp_path / "w", {})
    fill(dirs)
    again = jit.redirect(tmp_path / "w", {})  # the next FREEZE of the same archive
    assert again == dirs and jit.listing(again) == {"triton": {}, "tvm-ffi": {}}


def test_unpack_refuses_a_parent_other_users_can_write(tmp_path):
    path, _ = freeze(tmp_path, {})
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(jit.JitCacheError, match="writable by no one else"):
        jit.unpack(open_archive(path), shared / "thaw", {})
    assert not (shared / "thaw").exists()


def test_processes_unpacking_one_archive_take_turns(tmp_path):
    """Eight threads unpack the same archive into one place: all end with the same complete
    directory and none fails (the lock in the parent; the marker makes the later ones reuse)."""
    import concurrent.futures

    path, index = freeze(tmp_path, {})
    dest = tmp_path / "thaw"

    def one(_):
        d = jit.unpack(open_archive(path), dest, {})
        return jit.compiled_since(d, index)

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(8)))
    assert all(r == {"triton": [], "tvm-ffi": []} for r in results)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("thaw.tmp-")]
