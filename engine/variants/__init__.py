"""Optimized kernel variants, one module per op (group_norm.py, attention.py, conv2d.py,
linear.py, ...). Each module registers its launchers with engine.kernels.register; ops.py
imports them all. Every variant is tested against the op's reference variant."""
