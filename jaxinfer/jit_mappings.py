"""Compiled programs against Linux's limit on memory mappings per process.

XLA:CPU links every kernel of a compiled program as an object of its own, and each object takes three
memory mappings (code, read-only data, writable data) that the kernel cannot merge. A decode or prefill
program of a 30-layer model is ~270 kernels, ~800 mappings. Linux allows a process `vm.max_map_count`
mappings (65,530 by default), so ~80 such programs exhaust it, and LLVM then aborts the whole process
in the middle of a compilation ("Unable to allocate section memory"). A server's warm-up compiles every
bucket it can hit (`--max-running 64 --max-len 2048`: ~85 programs), so it projects the
mappings from the programs it has compiled and stops with an error that says what to change, before
the process dies minutes into its start.
"""

from __future__ import annotations

# Leave room for what the process maps after warm-up: request buffers, threads' stacks, the servers.
_HEADROOM = 0.1


class MappingLimitError(RuntimeError):
    """Compiling the remaining programs would exceed the process's memory-mapping limit."""


def mapping_count() -> int | None:
    """Memory mappings this process holds now; None where the system does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def mapping_limit() -> int | None:
    """The kernel's per-process limit on memory mappings (vm.max_map_count); None where unknown."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class MappingBudget:
    """Checks, program by program, that compiling `num_programs` programs stays within the limit.

    check(done) after each compiled program projects the remaining programs at the mean mappings a program
    has taken so far (the first also pays one-time mappings: thread pools, buffers), and raises
    MappingLimitError when the projection passes the limit (less headroom).
    """

    def __init__(self, num_programs: int):
        self.num_programs = num_programs
        self.limit = mapping_limit()
        self._start = mapping_count() if self.limit is not None else None
        self.per_program = 0

    def check(self, done: int) -> None:
        if self._start is None:
            return
        now = mapping_count()
        if now is None:
            return
        self.per_program = -(-(now - self._start) // done)
        remaining = self.num_programs - done
        projected = now + remaining * self.per_program
        if remaining > 0 and projected > (1 - _HEADROOM) * self.limit:
            raise MappingLimitError(
                f"compiling all {self.num_programs} programs would take about {projected:,} memory mappings "
                f"(~{self.per_program:,} a program on XLA:CPU, {now:,} held after {done}), past this "
                f"system's limit of {self.limit:,} (vm.max_map_count) less {_HEADROOM:.0%} headroom; the "
                "process would abort mid-compilation. Raise the limit (`sysctl -w vm.max_map_count=262144`, "
                "as root) or compile fewer programs: a lower --max-running (row buckets) or --max-len "
                "(page buckets)"
            )
