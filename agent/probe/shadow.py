"""Instance attributes that shadow a class's method: read, set and removed without ever touching the instance's
`__dict__`.

Why: on CPython 3.11 and 3.12 an object keeps its attributes in an inline values array that `LOAD_ATTR` reads through
a specialized fast path; the first access to `obj.__dict__` (also `vars(obj)`, `getattr(obj, "__dict__")`,
`inspect.getattr_static`) turns that array into a real dict for good, and every later attribute load on that object
takes the slower dict-hint path: ~2x slower per load (measured here: 10 vs 21 ms for 600k loads). The adapters hook
vLLM's scheduler, KV cache manager, block pool and free queue, whose methods load their own attributes thousands of
times per engine step: reading `__dict__` once at install made vLLM's own scheduling ~120 us slower per step at batch
256 (benchmarks/vllm_host_cost.py), more than all the hooks' own work. `setattr`/`delattr` keep the fast path.
"""

from __future__ import annotations

from typing import Any

MISSING: Any = object()  # obj.name is the class's own (no instance attribute shadows it)


def own(obj: Any, name: str) -> Any:
    """The instance attribute `obj.name` where one shadows the class's, else MISSING (also where obj has no such
    attribute). A bound method of `obj` over the class's own function counts as the class's (restoring it with
    `delattr` gives the same calls)."""
    try:
        value = getattr(obj, name)
    except AttributeError:
        return MISSING
    in_class = getattr(type(obj), name, MISSING)
    if value is in_class:
        return MISSING
    func = getattr(value, "__func__", MISSING)
    if func is not MISSING and getattr(value, "__self__", None) is obj and func is getattr(in_class, "__func__", in_class):
        return MISSING
    return value


def restore(obj: Any, name: str, prior: Any) -> None:
    """Put `obj.name` back to `prior` (MISSING: the class's own, by removing the instance attribute)."""
    if prior is MISSING:
        try:
            delattr(obj, name)
        except AttributeError:
            pass
    else:
        setattr(obj, name, prior)
