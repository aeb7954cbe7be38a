"""vitrify in a real SGLang server, end to end, on a GPU machine (SGLang from the offline bundle
of ``scripts/sglang-bundle/``).

=================  ==========================================================================
module             what
=================  ==========================================================================
``harness``        the one harness every run uses: bundle, model directory, server command and
                   environment, the server process (own process group, /health, log file,
                   stopped by its group id), log lines, HTTP calls, comparisons (deterministic
                   inference per launch), the dated result file
``models``         the model shapes (Qwen3 tiny / 8b / 8b-mqa, Llama-3.2-1B): configs, HF
                   parameter names and shapes, KV geometry
``checkpoint``     the seeded N(0, 0.02) checkpoint with unit norms (safetensors, sharded)
``oracle``         the oracle's power: the last-token pair, the planted faults (a KV page with
                   another page's bytes, a weight one ulp off), the ``oracle_power`` object
``freeze_e2e``     plain -> SAVE -> LOAD (+ standby, read-ahead, page cache) through the plugin
``hicache_e2e``    vitrify's HiCache L3 backend against SGLang's file backend, with a restart
``weights_e2e``    vitrify's weight update into a thawed server
``serve``          start one server from the bundle, query it, stop it
=================  ==========================================================================

Each run is ``python3 -m vitrify.bench.sglang.<module> --help`` (``benchmarks/sglang_*_e2e.py``
and ``scripts/sglang-bundle/serve.py`` run them from a checkout); ``--dry-run`` prints the
server command lines.
"""
