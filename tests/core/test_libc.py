"""kafold/libc.py: a C function with its signature where the library has it, None where it does not."""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import pytest

from kafold import libc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the C library is looked up on Linux only")
def test_a_function_the_library_has_is_callable_with_its_signature() -> None:
    getpid = libc.function("getpid", ())
    assert getpid is not None
    assert getpid() == os.getpid()


def test_a_function_the_library_lacks_is_none() -> None:
    assert libc.function("kafold_no_such_function", (ctypes.c_int,)) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the C library is looked up on Linux only")
def test_errno_text_names_the_last_calls_error() -> None:
    close = libc.function("close", (ctypes.c_int,))
    assert close is not None
    assert close(-1) == -1  # EBADF
    assert libc.errno_text() == os.strerror(errno.EBADF)
