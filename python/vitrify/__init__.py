"""vitrify — freeze a warmed-up CUDA inference engine into an archive, thaw it in seconds.

Importing vitrify never touches the GPU driver; :func:`cuda_available` loads it on first call.
"""

from __future__ import annotations

from . import _native
from . import config as _config
from ._check import ArgumentTypeError
from ._native import CudaError, CudaOutOfMemoryError, CudaUnavailableError
from .region import Region, RegionAddressError

__version__ = _native.build_info()["version"]

# Before anything can load the driver: the core gets its settings from the one table.
_config.configure_native(_native)


def cuda_available() -> bool:
    """True when the CUDA driver loaded and cuInit succeeded on this machine."""
    return _native.cuda_available()


def cuda_unavailable_reason() -> str:
    """Why :func:`cuda_available` is False ("" when it is True)."""
    return _native.cuda_unavailable_reason()


def build_info() -> dict:
    """Version, git revision, build type, compiler and CUDA header version of this build."""
    return dict(_native.build_info())


__all__ = [
    "ArgumentTypeError",
    "CudaError",
    "CudaOutOfMemoryError",
    "CudaUnavailableError",
    "Region",
    "RegionAddressError",
    "__version__",
    "build_info",
    "cuda_available",
    "cuda_unavailable_reason",
]
