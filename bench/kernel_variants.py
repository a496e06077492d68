"""Launch variants for the device benches: integer constants of `ds4lab.model.kernels` (how
many warps a block, shares of a head's keys, copies of a table) changed for one run.

A variant is "NAME=VALUE,NAME=VALUE", or "base" for the code as it is. Importing this sets
nothing (`device_time_ab.py` sets MLX's graph limits for itself; `kernel_times.py` must not).
"""

from __future__ import annotations

from ds4lab.model import kernels


def parse_variant(text: str) -> dict[str, int]:
    """{constant: value} of "NAME=VALUE,NAME=VALUE" ("base": none), each NAME one of
    `kernels`' integer constants."""
    if text == "base":
        return {}
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if not isinstance(getattr(kernels, name, None), int) or not value.lstrip("-").isdigit():
            raise SystemExit(f"{item!r} is not NAME=INT for an int constant of ds4lab.model.kernels")
        out[name] = int(value)
    return out
