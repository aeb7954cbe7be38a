"""SGLang integration (no fork): activated by configuration only.

``vitrify.integrations.sglang.hicache`` — :class:`~vitrify.integrations.sglang.hicache.VitrifyStorage`, an
L3 storage backend for SGLang's hierarchical cache, loaded by SGLang's own factory with
``--hicache-storage-backend dynamic`` (a package: settings, geometry, v1, v2, backend). Nothing here imports SGLang at package import time.
"""
