"""Compiles the C++ sources of jaxinfer's CPU kernels into shared libraries, once per source and machine.

Each library lands in $JAXINFER_CACHE_DIR/native (default ~/.cache/jaxinfer/native) under a name that
hashes the source, the compiler flags and jaxlib's FFI headers, so an edited source or a new jaxlib
builds afresh and concurrent processes never see a half-written file (written aside, then renamed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax.ffi

log = logging.getLogger(__name__)

COMPILER_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")


def cache_dir() -> Path:
    root = Path(os.environ.get("JAXINFER_CACHE_DIR", Path.home() / ".cache" / "jaxinfer"))
    return root / "native"


def build_library(source: Path, extra_flags: tuple[str, ...] = ()) -> Path | None:
    """The path of `source` compiled into a shared library, or None (logged) where that is impossible."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler (g++ or $CXX) on PATH: %s is not built", source.name)
        return None
    include = Path(jax.ffi.include_dir())
    flags = (*COMPILER_FLAGS, *extra_flags, f"-I{include}")
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join((compiler, *flags)).encode())
    digest.update((include / "xla" / "ffi" / "api" / "ffi.h").read_bytes())
    target = cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags, str(source), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            log.warning("building %s failed:\n%s", source.name, result.stderr[-2000:])
            return None
        os.replace(built, target)
    return target
