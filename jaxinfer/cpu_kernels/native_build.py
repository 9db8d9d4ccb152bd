"""Compiles the C++ sources of jaxinfer's CPU kernels into shared libraries, once per source and machine.

Each library lands in jaxinfer/cpu_kernels/_build (or, where that is read-only, in
$JAXINFER_CACHE_DIR/native, default ~/.cache/jaxinfer/native) under a name that hashes the source, the
headers beside it, the compiler flags and jaxlib's FFI header, so an edited source or a new jaxlib
builds afresh, and concurrent processes never see a half-written file (each is written aside, then
renamed). `NativeKernel` is one source built per instruction set, its FFI handlers registered on first
use and the variant to run chosen from the CPU's features."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax.ffi

log = logging.getLogger(__name__)

COMPILER_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")


def cache_dir() -> Path:
    """Beside the sources (an install-time build, which setup.sh runs), or under the cache root where
    the package directory is read-only."""
    beside = Path(__file__).parent / "_build"
    if os.access(beside if beside.exists() else beside.parent, os.W_OK):
        return beside
    return Path(os.environ.get("JAXINFER_CACHE_DIR", Path.home() / ".cache" / "jaxinfer")) / "native"


def build_library(source: Path, extra_flags: tuple[str, ...] = ()) -> Path | None:
    """The path of `source` compiled into a shared library, or None (logged) where that is impossible."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler (g++ or $CXX) on PATH: %s is not built", source.name)
        return None
    include = Path(jax.ffi.include_dir())
    flags = (*COMPILER_FLAGS, *extra_flags, f"-I{include}")
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # the kernels' shared headers
        digest.update(header.read_bytes())
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


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this machine's CPU (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


SIMD_FEATURES = ("sse4_2", "avx", "avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                 "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


def cpu_description() -> str:
    """CPU model, usable cores, the SIMD features the native kernels care about, the ISA whose kernel
    variants run (where they build: `python -m jaxinfer.cpu_kernels` says) and XLA's own ISA cap, if any
    (for benchmarks)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    present = [f for f in SIMD_FEATURES if f in cpu_flags()] or ["(none of the listed)"]
    isa = best_isa()
    kernels = f"native kernel ISA: {isa.name if isa else 'none (XLA serves)'}"
    # XLA's own code generation, capped by --xla_cpu_max_isa to run an AVX2 machine's code on a newer CPU.
    caps = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu_max_isa")]
    xla = f"; XLA {caps[-1].partition('=')[2]}" if caps else ""
    cores = len(os.sched_getaffinity(0))
    return f"CPU: {model}, {cores} cores; features: {' '.join(present)}; {kernels}{xla}"


@dataclasses.dataclass(frozen=True)
class Isa:
    """One instruction set a kernel source is compiled for. The same source builds once per ISA (the
    compiler's own macros, e.g. __AVX512VNNI__, choose the code path) and exports each handler under
    `<symbol><suffix>`, so every variant the CPU runs can be registered in one process."""

    name: str
    cpu_features: tuple[str, ...]  # /proc/cpuinfo flags the code needs
    compiler_flags: tuple[str, ...]

    @property
    def suffix(self) -> str:
        return f"_{self.name}"


AVX512_VNNI = Isa(
    "avx512_vnni",
    ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
)
# AVX2 with the VEX-encoded VNNI dot products (Intel's cores without AVX-512 since Alder Lake): the int8 and
# int4 products' AVX2 code with vpdpbusd on 256 bits in place of vpmaddubsw + vpmaddwd. Kernels without
# integer dot products build only FLOAT_ISAS.
AVX_VNNI = Isa("avx_vnni", ("avx2", "fma", "f16c", "avx_vnni"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"))
AVX2 = Isa("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"))
ISAS = (AVX512_VNNI, AVX_VNNI, AVX2)  # fastest first
FLOAT_ISAS = (AVX512_VNNI, AVX2)


def cpu_supports(isa: Isa) -> bool:
    return platform.machine() in ("x86_64", "AMD64") and set(isa.cpu_features) <= cpu_flags()


def best_isa(isas: tuple[Isa, ...] = ISAS) -> Isa | None:
    """The fastest of `isas` this CPU runs; $JAXINFER_CPU_ISA (one of ISAS' names) caps the choice at that
    ISA or a slower one (to run the AVX2 code on an AVX-512 machine). None on other CPUs or with
    JAXINFER_NATIVE_KERNELS=0."""
    if os.environ.get("JAXINFER_NATIVE_KERNELS", "1") == "0":
        return None
    cap = os.environ.get("JAXINFER_CPU_ISA")
    allowed = isas_from(cap, f"JAXINFER_CPU_ISA={cap!r}") if cap else ISAS
    return next((isa for isa in isas if isa in allowed and cpu_supports(isa)), None)


def isas_from(name: str, what: str) -> tuple[Isa, ...]:
    """The ISA called `name` and the slower ones in ISAS: what a CPU capped at `name` may run. A
    ValueError naming `what` (the setting that gave the name) where no ISA is called `name`."""
    names = [isa.name for isa in ISAS]
    if name not in names:
        raise ValueError(f"{what} is not one of {names}: unknown ISA")
    return ISAS[names.index(name) :]


def register_isa_kernels(source: Path, isa: Isa, symbols: tuple[str, ...]) -> bool:
    """Builds `source` for `isa` (compiled with -DJAXINFER_ISA_SUFFIX=<suffix>) and registers each
    handler `<symbol><suffix>` as an XLA:CPU custom call of that name. False where the CPU lacks the
    ISA, no compiler is found or JAXINFER_NATIVE_KERNELS=0."""
    if os.environ.get("JAXINFER_NATIVE_KERNELS", "1") == "0" or not cpu_supports(isa):
        return False
    library = build_library(source, (*isa.compiler_flags, f"-DJAXINFER_ISA_SUFFIX={isa.suffix}"))
    if library is None:
        return False
    handlers = ctypes.cdll.LoadLibrary(str(library))
    for symbol in symbols:
        target = symbol + isa.suffix
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handlers, target)), platform="cpu")
    return True


_KERNELS: list[NativeKernel] = []


def register_chosen_kernels() -> None:
    """Registers the chosen variant of every native kernel, as tracing a program that calls one does: a
    program loaded without tracing (program_cache) runs them by name."""
    for kernel in _KERNELS:
        kernel.available()


class NativeKernel:
    """One C++ source, built once per ISA it supports (fastest first) and registered on first use.

    `target(symbol)` names the custom call of the variant to run: the fastest this CPU supports (capped by
    $JAXINFER_CPU_ISA), or the one named by `isa` (tests run every variant the CPU can)."""

    def __init__(self, source: Path, symbols: tuple[str, ...], title: str, isas: tuple[Isa, ...] = ISAS):
        self.source, self.symbols, self.title, self.isas = source, symbols, title, isas
        self._built: dict[str, bool] = {}
        _KERNELS.append(self)

    def chosen_isa(self) -> Isa | None:
        return best_isa(self.isas)

    def registered(self, isa: Isa) -> bool:
        """Builds and registers `isa`'s variant once per process; False where that is impossible."""
        if isa.name not in self._built:
            self._built[isa.name] = register_isa_kernels(self.source, isa, self.symbols)
        return self._built[isa.name]

    def available(self, isa: str | None = None) -> bool:
        """Whether this process runs the chosen (or the named) variant: an x86-64 CPU with its ISA, a C++
        compiler, JAXINFER_NATIVE_KERNELS not 0."""
        chosen = self.chosen_isa() if isa is None else self._by_name(isa)
        return chosen is not None and cpu_supports(chosen) and self.registered(chosen)

    def target(self, symbol: str, isa: str | None = None) -> str:
        """The registered custom-call name of `symbol` in the chosen (or named) variant; a clear error
        where this process cannot run it."""
        chosen = self.chosen_isa() if isa is None else self._by_name(isa)
        if chosen is None:
            raise RuntimeError(
                f"{self.title} needs an x86-64 CPU with AVX2 or AVX-512 and a C++ compiler "
                "(python -m jaxinfer.cpu_kernels says what this machine runs)"
            )
        if not cpu_supports(chosen):
            raise RuntimeError(f"this CPU cannot run the {chosen.name} variant of {self.title}")
        if not self.registered(chosen):
            raise RuntimeError(
                f"the {chosen.name} variant of {self.title} did not build (no C++ compiler, or "
                "JAXINFER_NATIVE_KERNELS=0; see the log)"
            )
        return symbol + chosen.suffix

    def _by_name(self, name: str) -> Isa:
        """`name`'s variant, or where this kernel builds none for it (a float kernel asked for avx_vnni) the
        fastest one it builds below it, as a CPU capped at `name` would run."""
        below = [isa for isa in isas_from(name, f"ISA {name!r} for {self.title}") if isa in self.isas]
        if not below:
            raise ValueError(
                f"{self.title} has no variant for {name!r} or below; it builds {[i.name for i in self.isas]}"
            )
        return below[0]
