"""User code named on the command line (``pkg.module:fn``): reward functions, tools, environments."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

from rloo.errors import UserError


def load_callable(spec: str, *, flag: str, role: str) -> Callable[..., Any]:
    """Resolve ``pkg.module:name`` (or ``pkg.module.name``) to a callable; a one-line UserError naming ``flag``
    otherwise. ``role`` says what the callable is for ("the function that scores the completions")."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise UserError(f"{flag} {spec!r} is not an import path: write 'pkg.module:function'.")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise UserError(
            f"{flag} {spec}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
            "install it or add its directory to PYTHONPATH."
        ) from None
    fn = getattr(module, attr, None)
    if not sep and (inspect.ismodule(fn) or (fn is None and _is_module(spec))):
        raise UserError(f"{flag} {spec} names a module, not a function: write '{spec}:function' ({role}).")
    if fn is None:
        raise UserError(f"{flag} {spec}: module {module_name!r} has no attribute {attr!r}; check the name.")
    if not callable(fn):
        kind = type(fn).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise UserError(f"{flag} {spec}: {attr!r} is {article} {kind}, not a function.")
    return fn


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
