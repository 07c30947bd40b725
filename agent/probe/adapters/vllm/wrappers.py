"""The registry of every instance wrapper the vLLM adapter installed in this process, so that a benchmark can take
them off and put them back (pause.py). Imports only `shadow` (instance attributes set and read without touching
`__dict__`: see there why). Not on the hot path: `hook` runs once per wrapper, at install.
"""

from __future__ import annotations

from typing import Any, Callable

from ...shadow import MISSING, own
ROLES = ("engine", "worker", "frontend")
# (object, attribute, wrapper, what the attribute held before: MISSING where it was the class's method, role)
WRAPPERS: list[tuple[Any, str, Any, Any, str]] = []
# called after the engine role's wrappers went back on (the KV accounting re-syncs from a walk)
ON_RESUME: list[Callable[[], None]] = []


def hook(obj: Any, name: str, wrapper: Any, role: str = "engine") -> None:
    """Set `wrapper` as the instance attribute `obj.name` (every wrapper of the adapter goes in here) and note it
    in WRAPPERS with its `role` (ROLES)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    WRAPPERS.append((obj, name, wrapper, own(obj, name), role))
    setattr(obj, name, wrapper)
