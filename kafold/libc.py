"""The C library's functions the daemon calls through ctypes (`madvise`, `malloc_trim`), or None where it has none."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from typing import Any


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def function(name: str, argtypes: tuple[Any, ...], restype: Any = ctypes.c_int) -> Any | None:
    """The C library's function `name` with its signature, or None off Linux or where the library lacks it (musl has no
    `malloc_trim`)."""
    libc = _libc()
    try:
        fn = getattr(libc, name) if libc is not None else None
    except AttributeError:
        return None
    if fn is None:
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def errno_text() -> str:
    """The text of the errno the last call through `function` left."""
    return os.strerror(ctypes.get_errno())
