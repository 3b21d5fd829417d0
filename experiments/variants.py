"""A study's variants on the command line: `NAME:key=value,key=value`, dotted params keys and YAML values
(`NAME:` alone: the workspace's params unchanged). Shared by the studies that compare param variants."""

from __future__ import annotations

from typing import Any


def parse_variant(spec: str, prefix: str | tuple[str, ...] = "") -> tuple[str, dict[str, Any]]:
    """`NAME:key=value,...` -> (NAME, {key: value}); every key must start with `prefix` (or one of them: a
    ValueError that names the item otherwise)."""
    from components.config_file import override_value

    name, colon, rest = spec.partition(":")
    if not name or not colon:
        raise ValueError(f"--variant {spec!r}: expected NAME:key=value,... (NAME: alone for no override)")
    overrides: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.startswith(prefix):
            allowed = " or ".join(f"{p}*" for p in ((prefix,) if isinstance(prefix, str) else prefix))
            raise ValueError(f"--variant {spec!r}: {item!r} is not <key>=<value>" + (f" with a key {allowed}" if prefix else ""))
        overrides[key] = override_value(value)
    return name, overrides
