"""JSON-safe values for readers and the read API: NaN/inf -> null, dataclasses -> objects."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, is_dataclass
from typing import Any


def json_safe(v: Any) -> Any:
    """JSON-safe values: NaN/inf -> None, dataclasses -> dicts."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if is_dataclass(v) and not isinstance(v, type):
        return json_safe(asdict(v))
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    return str(v)


def to_json(v: Any) -> bytes:
    return json.dumps(json_safe(v), separators=(",", ":")).encode()
