"""SGLang integration (no fork): activated by configuration only.

- The plugin (``plugin.register``, SGLang's ``sglang.srt.plugins`` entry point): FREEZE/THAW of
  an unmodified SGLang server, switched on by ``VITRIFY_SGLANG_CONFIG`` (PLUGIN.md; one module
  per job: ``state``, ``versions/``, ``plugin``, ``server_args``, ``graphs``, ``attention``,
  ``startup``, ``freeze``, ``weights``, ``config``, and ``launch`` for ``vitrify sglang``).
- ``vitrify.integrations.sglang.hicache``: ``VitrifyStorage``, an L3 storage backend for
  SGLang's hierarchical cache, loaded by SGLang's own factory with
  ``--hicache-storage-backend dynamic`` (DESIGN.md).

Nothing here imports SGLang at package import time.
"""
