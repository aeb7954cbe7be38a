"""Binary byte units, defined once for the package (and its tests)."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
