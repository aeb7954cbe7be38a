"""Which graph of the `dims` cases (tests/python/graph_worker.py) corrupts memory when relocated
by 64 GiB, and which struct words did FREEZE relocate? (H200, 2026-12-01; relocation issue.)

    python scripts/experiments/reloc_dims_probe.py OUTDIR

Freezes the dims cases at 0x600000000000, lists every relocated struct word whose upper half
is 0x6000 (the candidates for an integer pair (x, 24576) read as an address), then thaws at
+64 GiB in fresh processes, one graph alone each time, and compares every output."""

import json
import subprocess
import sys
from pathlib import Path

import vitrify.graph as tg
from vitrify import _native

WORKER = Path(__file__).resolve().parents[2] / "tests/python/graph_worker.py"
out = Path(sys.argv[1])
base = 0x600000000000
d = out / "dims"
p = subprocess.run([sys.executable, str(WORKER), "freeze", "dims", str(d), hex(base)],
                   capture_output=True, text=True)
fr = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
assert fr["ok"], fr
root = d / "archive" / "rank0"
index = tg.read_index(root)
words = {}
for g in index["graphs"]:
    desc = tg.describe((root / g["file"]).read_bytes())
    rows = []
    for node, off, roff, kind in desc["relocations"]:
        n = desc["nodes"][node]
        if n["kind"] != "kernel":
            continue
        slot = next((s for s in n["slots"] if s[0] <= off < s[0] + s[1]), None)
        rows.append({"node": node, "kernel": n["name"][:90], "offset": off, "kind": kind,
                     "value": hex(base + roff), "slot": slot})
    words[g["name"]] = {"relocations": rows, "notes": desc["notes"][:40]}
thaws = {}
for g in index["graphs"]:
    p = subprocess.run([sys.executable, str(WORKER), "thaw", "dims", str(d), hex(base + (64 << 30)),
                        g["name"]], capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    thaws[g["name"]] = json.loads(lines[-1]) if lines else {"error": p.stderr[-2000:]}
(out / "reloc-dims-probe.json").write_text(json.dumps({"words": words, "thaws": thaws}, indent=1,
                                                       default=str))
for name, w in words.items():
    print(name, [(r["kernel"][:40], r["offset"], r["kind"], r["value"], r["slot"])
                 for r in w["relocations"]])
    t = thaws[name]
    print("   thaw alone +64GiB:", t.get("equal"), t.get("equal_after_back_to_back"), t.get("error", ""))
