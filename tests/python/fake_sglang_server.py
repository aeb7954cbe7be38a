"""A stand-in for ``python -m sglang.launch_server`` in tests of the freeze run
(``vitrify.bench.sglang.freeze_e2e``): the log lines the harness watches for (SGLang's server
arguments, whether deterministic inference is on, and vitrify's plugin's), ``/health`` (503 until
ready), ``/get_server_info``, ``/flush_cache``, a streamed ``/generate`` whose output depends only
on the prompt and on the weight last sent (a batch of prompts: one whole answer each), and ``/update_weights_from_tensor`` (the tests send a
plain pickle of CPU tensors: the logprobs move by how far the tensor is from ones). It reads the
plugin's TOML (``VITRIFY_SGLANG_CONFIG``): mode "load" waits for ``standby_file`` when one is set
and logs a thaw; mode "save" logs "SAVE complete" once it has served ``save_after_requests``
requests."""

from __future__ import annotations

import base64
import datetime as dt
import http.server
import json
import os
import sys
import threading
import time

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

STATE = {"ready": False, "requests": 0, "shift": 0.0, "updates": 0}


def log(text: str, vitrify: bool = False) -> None:
    now = dt.datetime.now()
    if vitrify:  # vitrify's logging format (milliseconds)
        stamp = now.strftime("%Y-%m-%d %H:%M:%S,") + f"{now.microsecond // 1000:03d}"
        print(f"{stamp} vitrify.sglang INFO: {text}", flush=True)
    else:
        print(f"[{now:%Y-%m-%d %H:%M:%S}] {text}", flush=True)


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._send(200 if STATE["ready"] else 503, b"")
        elif self.path == "/get_server_info":
            self._send(200, json.dumps({"startup_time": {"scheduler_e2e": 1.5},
                                        "context_length": 512, "max_req_input_len": 500,
                                        "batches_served": STATE.get("batches", 0)}).encode())
        else:
            self._send(404, b"")

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else {}
        if self.path == "/flush_cache":
            return self._send(200, b"")
        if self.path == "/update_weights_from_tensor":
            import pickle

            import torch

            named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
            STATE["shift"] = sum(float((t.float() - 1).abs().sum()) for _, t in named)
            STATE["updates"] += 1
            return self._send(200, json.dumps({"success": True, "message": "ok"}).encode())
        ids = body["input_ids"]
        n = body["sampling_params"]["max_new_tokens"]
        if ids and isinstance(ids[0], list):  # a batch: one whole answer per prompt
            STATE["batches"] = STATE.get("batches", 0) + 1
            return self._send(200, json.dumps([{
                "output_ids": [(sum(p) + i) % 1000 for i in range(n)],
                "meta_info": {"output_token_logprobs": [[-0.5, 0]] * n}} for p in ids]).encode())
        out = [(sum(ids) + i) % 1000 for i in range(n)]
        chunk = {"output_ids": out, "meta_info": {
            "output_token_logprobs": [[-0.5 - i / 8 - STATE["shift"], t]
                                      for i, t in enumerate(out)],
            "prompt_tokens": len(ids), "cached_tokens": 0}}
        data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        self._send(200, data, "text/event-stream")
        STATE["requests"] += 1
        cfg = STATE.get("cfg") or {}
        # SGLang's own warm-up request is not sent here: one fewer than save_after_requests
        if cfg.get("mode") == "save" and STATE["requests"] == cfg.get("save_after_requests", 1) - 1:
            log(f"vitrify: SAVE complete: {cfg['archive']} (6 graphs, region 1 bytes, 0.1 s to "
                f"write, after {STATE['requests']} request(s))", vitrify=True)


def main() -> None:
    port = int(sys.argv[sys.argv.index("--port") + 1])
    log(f"server_args=ServerArgs(enable_deterministic_inference="
        f"{'--enable-deterministic-inference' in sys.argv}, port={port})")
    cfg = {}
    if os.environ.get("VITRIFY_SGLANG_CONFIG"):
        with open(os.environ["VITRIFY_SGLANG_CONFIG"], "rb") as f:
            cfg = tomllib.load(f)
        STATE["cfg"] = cfg
        log(f"vitrify SGLang plugin: mode '{cfg['mode']}', archive {cfg['archive']}, weight "
            f"updates off, 2 hook(s) registered (SGLang 0.5.17)", vitrify=True)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    time.sleep(0.3)  # "imports"
    if cfg:
        log(f"vitrify SGLang plugin: mode '{cfg['mode']}', archive {cfg['archive']}, weight "
            f"updates off, 9 hook(s) registered (SGLang 0.5.17)", vitrify=True)
    if cfg.get("standby_file"):
        log(f"vitrify: standby: imports done; waiting for {cfg['standby_file']} before the thaw",
            vitrify=True)
        time.sleep(0.5)  # reading the archive's spans (the harness's go waits for it)
        log("vitrify: standby: the spans the thaw restores are in the page cache (0.01 GiB in "
            "0.5 s); a go now thaws without the drive", vitrify=True)
        while not os.path.exists(cfg["standby_file"]):
            time.sleep(0.01)
    log("Init torch distributed begin.")
    if cfg.get("mode") == "load":
        log(f"vitrify: thawed {cfg['archive']} in 0.20 s (6 graphs)", vitrify=True)
    STATE["ready"] = True
    log("The server is fired up and ready to roll!")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
