"""WGSL sources, one folder per op and one file per variant (see engine/kernels.py)."""
