"""Subprocess worker for tests/python/test_weight_transport.py: an engine (the small Llama of
test_weight_mapping, bf16, zeros) receiving weight updates over a Unix socket.

    python weight_worker.py SOCKET CONNECTIONS [OPTS_JSON]

Prints ``{"listening": SOCKET}``, then one JSON line per connection: ``ok``, the receiver's
``state``, its summary or the error, and the SHA-256 of every engine tensor's bytes.
OPTS: ``allowed_uids`` (default: this user); ``direct``: the engine's tensors live in one
shared memfd it exports (direct updates); ``force_kernels``: the direct path's sums run as Triton
kernels (under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from test_weight_mapping import engine_tensors
from vitrify.weights import direct as wd
from vitrify.weights import mapping as wm
from vitrify.weights import transport as wt


def main() -> int:
    path, count = sys.argv[1], int(sys.argv[2])
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    engine = {n: torch.zeros_like(t, dtype=torch.bfloat16)
              for n, t in engine_tensors(bias=True).items()}
    exporter = None
    if opts.get("direct"):
        shared = wt.HostWeights(engine)
        engine, exporter = shared.tensors, shared.export
    wd.FORCE_KERNELS = bool(opts.get("force_kernels"))
    rx = wt.Receiver(engine, wm.megatron_llama(heads=8, kv_heads=2, head_dim=8, qkv_bias=True),
                     allowed_uids=tuple(opts["allowed_uids"]) if "allowed_uids" in opts else None,
                     exporter=exporter)
    srv = wt.listen(path)
    print(json.dumps({"listening": path}), flush=True)
    for _ in range(count):
        conn, _ = srv.accept()
        out: dict = {}
        with conn:
            try:
                out = {"ok": True, "summary": rx.serve_one(conn)}
            except Exception as e:
                out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out["state"] = rx.state
        out["engine"] = {n: hashlib.sha256(t.view(torch.int16).numpy().tobytes()).hexdigest()
                         for n, t in engine.items()}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
