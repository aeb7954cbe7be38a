"""Subprocess worker for tests/python/test_transformers_engine_gpu.py and `vitrify bench coldstart`:
the transformers engine (vitrify.integrations.transformers) frozen and thawed through
vitrify.session in fresh processes, then serving new prompts.

    python engine_worker.py freeze ARCHIVE CONFIG_JSON [OPTS_JSON]
    python engine_worker.py thaw   ARCHIVE CONFIG_JSON [OPTS_JSON]
    python engine_worker.py cold   -       CONFIG_JSON [OPTS_JSON]   # build + serve, no archive

Both modes serve OPTS.prompts (default 16) new prompts (seed OPTS.prompt_seed, never seen at
FREEZE) for OPTS.steps decode steps and report the tokens and the SHA-256 of each step's logits.
THAW options: ``occupy`` (reserve the frozen range first, so the session must relocate),
``warmup_restore`` (false: re-run warmup). The last stdout line is JSON; ``process_s`` is the time
since the interpreter started (``VITRIFY_T0`` from the parent, else this module's import).
"""

from __future__ import annotations

import json
import os
import sys
import time

from worker_result import report

T0 = float(os.environ.get("VITRIFY_T0", time.time()))


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    cfg_d = json.loads(sys.argv[3])
    opts = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}

    def run() -> dict:
        from vitrify import session
        from vitrify.integrations import transformers as vtt

        cfg = vtt.EngineConfig.from_dict(cfg_d)
        eng = vtt.CausalLMEngine(cfg)
        out: dict = {"mode": mode}
        if mode in ("freeze", "cold"):
            s = session.FreezeSession(eng, path if mode == "freeze" else os.devnull + ".unused",
                                      region_bytes=opts.get("region_bytes", 12 << 30),
                                      overwrite=True)
            if mode == "freeze":
                out["session"] = s.run()
            else:  # the same phases, no archive: a cold start
                out["session"] = _cold(s)
        else:
            blocker = None
            if opts.get("occupy"):
                from vitrify import Region, archive

                frozen = archive.open_archive(path).region
                blocker = Region(frozen.size, base=frozen.base)
            s = session.ThawSession(eng, path, warmup_restore=opts.get("warmup_restore"))
            out["session"] = s.run()
            out["blocked"] = blocker is not None
        out["ready_s"] = time.time() - T0
        import torch

        from vitrify.integrations.transformers import prompts

        batch = prompts(opts.get("prompts", 16), opts.get("prompt_seed", 99), cfg.vocab)
        t = time.perf_counter()
        served = eng.serve(batch, opts.get("steps", 32))
        torch.cuda.synchronize()
        out["serve_s"] = time.perf_counter() - t
        out["first_token_s"] = out["ready_s"] + served.pop("first_token_s", 0.0)
        out.update(served)
        out["process_s"] = time.time() - T0
        return out

    return report(run)


def _cold(s) -> dict:
    """A FreezeSession's phases without writing an archive (the cold start to compare with)."""
    from vitrify.region import Region

    a, t = s.adapter, s.timings
    with t.step("reserve"):
        s.region = region = Region(s.region_bytes)
    for phase, call in (("build", lambda: a.build(region)), ("load_weights", a.load_weights),
                        ("alloc_state", a.alloc_state), ("warmup", a.warmup)):
        with t.step(phase), a.route(region, phase):
            call()
    with t.step("capture"), a.route(region, "capture"):
        a.capture(_TorchGraphs())
    return {"timings": t.as_dict(), "base": region.base}


class _TorchGraphs:
    """``capture(name, pool=...)`` as torch alone does it (what a server without vitrify runs)."""

    class _Capture:
        def __init__(self, pool):
            import torch

            self.graph = torch.cuda.CUDAGraph()
            self._ctx = torch.cuda.graph(self.graph, pool=pool)

        def __enter__(self):
            self._ctx.__enter__()
            return self

        def __exit__(self, *exc):
            return self._ctx.__exit__(*exc)

    def capture(self, name: str, pool=None):
        return self._Capture(pool)


if __name__ == "__main__":
    sys.exit(main())
