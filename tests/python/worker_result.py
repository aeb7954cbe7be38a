"""The result protocol of the GPU test workers (graph_worker.py, decoder_worker.py,
session_worker.py): vitrify's own (``vitrify._worker.report``)."""

from vitrify._worker import report

__all__ = ["report"]
