"""Static trees: the same k-config (or path list) every round. MCSD's baseline shape."""

from __future__ import annotations

from .base import TreePolicy


class StaticPolicy(TreePolicy):
    """Grow the full topology every round; a chain spec ("1,1,1,1") is vanilla speculative decoding."""

    name = "static"
