"""Layer normalisation with one invocation per row ("row"): no workgroup memory, no barriers.
The reference gives each row a workgroup of 256 invocations and reduces through workgroup
memory, which suits GPUs; software adapters (lavapipe, SwiftShader) run a workgroup's
invocations in turn and pay for each of its barriers, and there this form is the fast one."""

from __future__ import annotations

import math

from ..gpu import Tensor
from ..kernels import Variant, register


@register("layer_norm", "row", doc="one invocation per row, WG rows per workgroup, no barriers",
          constants={"WG": (32, 64, 128)})
def layer_norm_row(ops, v: Variant, consts: dict, x: Tensor, gamma: Tensor, beta: Tensor, eps: float) -> Tensor:
    d = x.shape[-1]
    rows = x.numel // d
    wg = consts.get("WG", 64)
    y = ops.rt.empty(x.shape, ops.dtype)
    groups = math.ceil(rows / wg)
    gx = min(groups, ops.rt.caps.max_workgroups)
    ops.rt.dispatch(
        ops.pipeline(v, **({"WG": wg} if "WG" in consts else {})),
        "layer_norm",
        (rows, d, float(eps)),
        [x, gamma, beta, y],
        (gx, math.ceil(groups / gx), 1),
    )
    return y
