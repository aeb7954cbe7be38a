"""Crash torture of the tiered store (vitrify.tier.TieredStore; issue 33, DESIGN.md H8, D24).

A writer process puts pages (write-back and write-through, alternating per round), puts some
again with other bytes, deletes some, and records each acknowledgement in a file right after the
call returned; a reader process beside it (both tiers open read-only) refreshes and reads what
the file says. The writer is SIGKILLed at a random moment; the tiers are then opened again (which
writes the dirty pages back) and every recorded page is checked: an acknowledged put must read
back with its first bytes (0 lost, 0 wrong), an acknowledged delete must stay gone (0 stale), and
where both tiers hold a page they hold the same bytes (0 disagreeing). The reader must never see
wrong bytes or a page deleted before its refresh. The counts are printed (``pytest -s``).
Default: 8 rounds (about half a minute on 2 cores); ``-m long``: 60.
"""

from __future__ import annotations

import collections
import hashlib
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from vitrify.disk import DiskStore
from vitrify.tier import HostStore, TieredStore

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm on this machine")
BASE = os.environ.get("VITRIFY_TEST_DIR") or tempfile.gettempdir()
PAGE = 4000              # one 4 KiB slot each
HOST = 4096 + 48 * 4096  # 48 slots: the host tier evicts all the time

_COMMON = f"""
import hashlib, os, random, sys
from vitrify.disk import DiskStore
from vitrify.tier import HostStore, TieredStore
PAGE, HOST = {PAGE}, {HOST}
def content(i, v=0):
    seed = hashlib.sha256(f"{{i}}/{{v}}".encode()).digest()
    n = 100 + int.from_bytes(seed[:2], "little") % (PAGE - 100)
    return (seed * (n // 32 + 1))[:n]
def parse(text):
    live, deleted = {{}}, set()
    for line in text.splitlines():
        op, _, i = line.partition(" ")
        if not i.isdigit():
            continue
        if op == "P":
            live.setdefault(int(i), 0)
        elif op == "d":
            live.pop(int(i), None)  # being deleted: neither live nor deleted for a reader
        elif op == "D":
            live.pop(int(i), None)
            deleted.add(int(i))
    return live, deleted
"""

# The writer: argv h d disk_bytes acks mode first seed. Runs until SIGKILLed.
_WRITER = _COMMON + """
h, d, DISK, acks, mode, first, seed = sys.argv[1:8]
DISK = int(DISK)
rng = random.Random(int(seed))
t = TieredStore(HostStore(HOST, PAGE, dir=h, name="tt", cold_start="load"),
                DiskStore(d, DISK, PAGE, name="tt", cold_start="load"), write=mode,
                queue_pages=64)
with open(acks) as f:
    live, deleted = parse(f.read())
fd = os.open(acks, os.O_WRONLY | os.O_APPEND)
nxt = int(first)
print("ready", flush=True)
while True:
    r = rng.random()
    if r < 0.8 or not live:
        keys = list(range(nxt, nxt + rng.randint(1, 8)))
        nxt += len(keys)
        ok = t.batch_put([str(i) for i in keys], [content(i) for i in keys])
        for i, good in zip(keys, ok):
            if good:
                live[i] = 0
                os.write(fd, f"P {i}\\n".encode())
    elif r < 0.88:
        i = rng.choice(list(live))
        if t.put(str(i), content(i, 1)):  # other bytes: the first ones must stay
            os.write(fd, f"X {i}\\n".encode())
    elif r < 0.96:
        i = rng.choice(list(live))
        os.write(fd, f"d {i}\\n".encode())  # about to delete: either state is right until "D"
        t.delete(str(i))
        del live[i]
        os.write(fd, f"D {i}\\n".encode())
    elif live:
        i = rng.choice(list(live))
        got = t.get(str(i))
        if got != content(i):
            os.write(fd, f"W {i}\\n".encode())  # a wrong read in the writer itself
"""

# The reader: argv h d disk_bytes acks seed. Until stdin has a line: snapshot the
# acknowledgements, refresh both tiers, read a sample; then prints its counts.
_READER = _COMMON + """
import select, time
h, d, DISK, acks, seed = sys.argv[1:6]
DISK = int(DISK)
rng = random.Random(int(seed))
t = None
while t is None:
    try:
        t = TieredStore(HostStore(HOST, PAGE, dir=h, name="tt", mode="read"),
                        DiskStore(d, DISK, PAGE, name="tt", mode="read"))
    except (FileNotFoundError, ValueError):
        time.sleep(0.02)
counts = dict(reads=0, wrong=0, stale=0, misses=0)
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    with open(acks) as f:
        live, deleted = parse(f.read())
    t.host.refresh()
    t.disk.refresh()
    keys = rng.sample(sorted(live), min(20, len(live))) + rng.sample(sorted(deleted), min(5, len(deleted)))
    for i, got in zip(keys, t.batch_get([str(i) for i in keys])):
        counts["reads"] += 1
        if i in deleted:
            counts["stale"] += got is not None
        elif got is None:
            counts["misses"] += 1
        elif got != content(i):
            counts["wrong"] += 1
print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
"""


def content(i: int, v: int = 0) -> bytes:
    seed = hashlib.sha256(f"{i}/{v}".encode()).digest()
    n = 100 + int.from_bytes(seed[:2], "little") % (PAGE - 100)
    return (seed * (n // 32 + 1))[:n]


def parse(text: str) -> tuple[dict[int, int], set[int], int, int, set[int]]:
    """(live keys, deleted keys, duplicate puts, the writer's wrong reads, keys whose delete the
    kill interrupted: absent or with their first bytes, both right)."""
    live: dict[int, int] = {}
    deleted: set[int] = set()
    deleting: set[int] = set()
    dups = writer_wrong = 0
    for line in text.splitlines():
        op, _, i = line.partition(" ")
        if not i.isdigit():
            continue
        if op == "P":
            live.setdefault(int(i), 0)
        elif op == "d":
            live.pop(int(i), None)
            deleting.add(int(i))
        elif op == "D":
            live.pop(int(i), None)
            deleting.discard(int(i))
            deleted.add(int(i))
        elif op == "X":
            dups += 1
        elif op == "W":
            writer_wrong += 1
    return live, deleted, dups, writer_wrong, deleting


def start(code: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    ready, _, _ = select.select([p.stdout], [], [], 60)
    line = p.stdout.readline().strip() if ready else ""
    if line != "ready":
        p.kill()
        out, err = p.communicate(timeout=10)
        pytest.fail(f"a torture process did not start (said {line!r}): {err[-2000:]}")
    return p


def torture(rounds: int, seed: int, disk_slots: int) -> collections.Counter:
    """``disk_slots`` must hold every page the run puts (nothing acknowledged is evicted)."""
    disk_bytes = 4096 + disk_slots * 4096
    h = tempfile.mkdtemp(prefix="vitrify-torture-host-", dir=SHM)
    d = tempfile.mkdtemp(prefix="vitrify-torture-disk-", dir=BASE)
    acks = os.path.join(d, "acks")
    open(acks, "w").close()
    rng = random.Random(seed)
    c: collections.Counter = collections.Counter()
    done_bytes = 0
    try:
        nxt = 0
        for rnd in range(rounds):
            mode = ("back", "through")[rnd % 2]
            first = nxt
            writer = start(_WRITER, h, d, str(disk_bytes), acks, mode, str(first),
                           str(rng.randrange(1 << 30)))
            reader = start(_READER, h, d, str(disk_bytes), acks, str(rng.randrange(1 << 30)))
            time.sleep(rng.uniform(0.3, 1.5))
            writer.send_signal(signal.SIGKILL)
            writer.communicate(timeout=30)
            c["kills"] += 1
            out, err = reader.communicate(input="stop\n", timeout=60)
            assert reader.returncode == 0, err[-2000:]
            for field in out.split():
                k, _, v = field.partition("=")
                c[f"reader_{k}"] += int(v)
            with open(acks) as f:
                text = f.read()
            live, deleted, dups, writer_wrong, deleting = parse(text)
            # this round's keys and the older ones it touched, and a sample of the rest
            touched = {int(line.split()[1]) for line in text[done_bytes:].splitlines()
                       if line[2:].isdigit()}
            done_bytes = len(text)
            older = sorted(set(live) - touched)
            touched |= set(rng.sample(older, min(3000, len(older))))
            c["writer_wrong"] = writer_wrong
            # the restart: a writer opens both tiers again (its dirty pages go to the disk)
            host = HostStore(HOST, PAGE, dir=h, name="tt", cold_start="load")
            disk_store = DiskStore(d, disk_bytes, PAGE, name="tt", cold_start="load")
            with TieredStore(host, disk_store, write=mode) as t:
                c["requeued"] += t.stats().get("requeued", 0)
                keys = sorted(touched & (set(live) | deleted | deleting))
                got = t.batch_get([str(i) for i in keys])
                in_host = host.batch_get([str(i) for i in keys])
                on_disk = disk_store.batch_get([str(i) for i in keys])
                for i, g, a, b in zip(keys, got, in_host, on_disk):
                    bad = ""
                    if i in deleted and g is not None:
                        bad = "stale"
                    elif i in live and g is None:
                        bad = "lost"
                    elif g is not None and g != content(i):
                        bad = "wrong"
                    if a is not None and b is not None and a != b:
                        c["disagreeing"] += 1
                        bad = bad or "disagreeing"
                    if bad:
                        c[bad] += bad != "disagreeing"
                        print(f"round {rnd} ({mode}): key {i} {bad}: host "
                              f"{'-' if a is None else a == content(i)}, disk "
                              f"{'-' if b is None else b == content(i)}")
                c["interrupted_deletes"] += len(deleting)
                t.flush()
                c["checked"] += len(keys)
            c["acknowledged_puts"] = len(live) + len(deleted)
            c["deleted"] = len(deleted)
            c["duplicate_puts"] = dups
            nxt = max([first - 1] + [int(line.split()[1]) for line in text.splitlines()
                                     if line.startswith("P ")]) + 16
    finally:
        shutil.rmtree(h, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
    return c


def report(c: collections.Counter) -> None:
    print(f"\ntiered-store crash torture: {c['kills']} SIGKILLs (write-back and write-through), "
          f"{c['acknowledged_puts']} acknowledged puts, {c['duplicate_puts']} duplicate puts, "
          f"{c['deleted']} deletes, {c['checked']} checks after restarts, {c['requeued']} dirty "
          f"pages re-queued: {c['wrong']} wrong payloads, {c['stale']} stale, {c['lost']} "
          f"acknowledged losses, {c['disagreeing']} disagreeing tiers; writer's own reads: "
          f"{c['writer_wrong']} wrong; readers beside: {c['reader_reads']} reads, "
          f"{c['reader_wrong']} wrong, {c['reader_stale']} stale, {c['reader_misses']} misses")


def check(c: collections.Counter) -> None:
    assert c["wrong"] == 0 and c["stale"] == 0 and c["lost"] == 0, dict(c)
    assert c["disagreeing"] == 0 and c["writer_wrong"] == 0, dict(c)
    assert c["reader_wrong"] == 0 and c["reader_stale"] == 0, dict(c)
    assert c["acknowledged_puts"] > 100 and c["deleted"] > 5 and c["reader_reads"] > 100, dict(c)


def test_tiered_store_crash_torture():
    c = torture(rounds=8, seed=33, disk_slots=80000)
    report(c)
    check(c)


@pytest.mark.long
def test_tiered_store_crash_torture_long():
    c = torture(rounds=60, seed=3333, disk_slots=600000)
    report(c)
    check(c)
    assert c["requeued"] > 0, dict(c)
