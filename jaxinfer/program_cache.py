"""Compiled step programs on disk, found without tracing them.

JAX's persistent compilation cache keys a program by its lowered HLO, so a process traces and lowers
every program before that cache can answer: most of a warm start (a SmolLM2 server with draft heads and
four slots: warm-up 18-23 s through JAX's cache, 5-7 s loading from this one). This cache keys
a program by what decides it before tracing and keeps its serialized executable:

- the environment: this package's source files, the jax and jaxlib versions, JAX's configuration, the
  XLA / JAX / JAXINFER environment variables, the CPU's features and the devices;
- the engine's static description (model and kernel configuration, cache shape, mesh);
- the program's bucket key and its arguments' tree, shapes, dtypes and shardings.

Any difference is a miss, and a miss compiles. On XLA:CPU an executable that JAX's persistent cache
loaded serializes without its machine code (it fails when run), so only programs compiled afresh are
kept, and a process that keeps programs leaves JAX's cache off (runtime.build_runtime). After a change
of code or versions the first start therefore compiles everything once.

Entries are pickles of the executable, trusted like JAX's own cache files: keep the folder private.
Used for engines on one device in one process (a mesh's executables name their device assignment), by
the entry points that warm every bucket up: `serve` and `batch` (RuntimeOptions.program_cache).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable
from jax.sharding import Mesh

from jaxinfer.cpu_kernels.native_build import cpu_flags

log = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parent
_SOURCES = (_PACKAGE, _PACKAGE.parent / "pallas_kernels")
_ENV_PREFIXES = ("XLA_", "JAX_", "JAXINFER_", "TPU_", "CUDA_", "LIBTPU_")
_PERSISTENT_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_persistent_cache_hits = [0]  # this process's, counted by _count_hits


def _count_hits(event: str, **kwargs) -> None:
    if event == _PERSISTENT_CACHE_HIT:
        _persistent_cache_hits[0] += 1


jax.monitoring.register_event_listener(_count_hits)


@functools.lru_cache(maxsize=1)
def environment_digest() -> str:
    """A digest of everything outside an engine that can change a compiled program."""
    h = hashlib.sha256()
    for root in _SOURCES:
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h")):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    client = jax.devices()[0].client
    for part in (jax.__version__, jaxlib.__version__, sys.version, env, config, devices,
                 client.platform_version, sorted(cpu_flags())):  # fmt: skip
        h.update(repr(part).encode())
    return h.hexdigest()


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _signature(args: Sequence) -> str:
    """The arguments' tree and each leaf's shape, dtype, weak type and sharding."""
    leaves, tree = jax.tree.flatten(args)
    parts = [str(tree)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
        parts.append(f"{np.shape(x)}|{dtype}|{getattr(x, 'weak_type', False)}|{sharding}")
    return "\n".join(parts)


def serves(mesh: Mesh) -> bool:
    """Whether an engine over `mesh` in this process keeps its programs here: one device, one process."""
    return mesh.size == 1 and jax.process_count() == 1


class ProgramCache:
    """Serialized executables under `directory`, keyed by the environment, the engine's static
    description `context` and each program's key and arguments."""

    def __init__(
        self, directory: str | Path, context: str, devices: Sequence[jax.Device], max_bytes: int = 4 << 30
    ):
        """max_bytes: the folder's cap; storing past it removes the entries used longest ago (each
        change of code or versions leaves a whole set behind)."""
        self.directory = Path(directory)
        self._max_bytes = max_bytes
        self._context = context
        self._devices = list(devices)
        # Entries of this environment and engine share a prefix, so that warm-up can load them all.
        self._prefix = _digest(environment_digest(), context)[:24]
        self._preloaded: dict[str, tuple | Exception] = {}

    def _path(self, key: tuple, args: Sequence) -> Path:
        return self.directory / f"{self._prefix}-{_digest(repr(key), _signature(args))}.program"

    def _read(self, path: Path) -> tuple:
        """(the stored argument tree, the loaded program) of an entry."""
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        program = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=self._devices
        )
        with contextlib.suppress(OSError):  # another process may have just evicted it
            os.utime(path)  # used now: the last to go (_evict)
        return in_tree, program

    def preload(self) -> None:
        """Loads every entry of this environment and engine on all cores, for `load` to take: most of
        a warm start is loading (two threads on two cores: ~0.55x the time of one)."""

        def read(path: Path) -> tuple | Exception:
            try:
                return self._read(path)
            except Exception as e:
                return e

        paths = sorted(self.directory.glob(f"{self._prefix}-*.program"))
        with ThreadPoolExecutor(max(1, min(len(paths), os.cpu_count() or 1))) as pool:
            self._preloaded = dict(zip((p.name for p in paths), pool.map(read, paths)))

    def drop_preloaded(self) -> None:
        """Forgets preloaded programs that `load` did not take (another warm-up's buckets)."""
        self._preloaded = {}

    def load(self, key: tuple, args: Sequence) -> jax.stages.Compiled | None:
        """The program stored for `key` over arguments like `args`, or None."""
        path = self._path(key, args)
        entry = self._preloaded.pop(path.name, None)
        if entry is None and not path.exists():
            return None
        try:
            if isinstance(entry, Exception):
                raise entry
            in_tree, program = entry if entry is not None else self._read(path)
            if in_tree != jax.tree.structure((tuple(args), {})):
                raise ValueError("its argument tree differs")
            return program
        except Exception as e:  # a damaged or foreign entry: compile instead, and replace it
            log.warning("compiling %s: its cached program %s is unusable (%s)", key, path.name, e)
            return None

    def compiled(self, key: tuple, args: Sequence, compile: Callable[[], jax.stages.Compiled]):
        """`compile()`, kept for `key` unless JAX's persistent cache answered it."""
        hits = _persistent_cache_hits[0]
        program = compile()
        if _persistent_cache_hits[0] == hits:
            self._store(key, args, program)
        else:
            log.info("not keeping %s: JAX's persistent cache answered it (see the module's docstring)", key)
        return program

    def _store(self, key: tuple, args: Sequence, program: jax.stages.Compiled) -> None:
        """Writes `program` for `key`; a failure only logs (the program still serves)."""
        path = self._path(key, args)
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(program)
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(pickle.dumps((payload, in_tree, out_tree)))
            partial.replace(path)  # atomic: a concurrent reader sees the whole entry or none
            self._evict()
        except Exception as e:
            log.warning("could not cache the program %s: %s", key, e)

    def _evict(self) -> None:
        """Removes the entries used longest ago until the folder holds at most max_bytes."""
        entries = []
        for path in self.directory.glob("*.program"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another process evicted it
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self._max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
