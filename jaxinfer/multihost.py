"""Serving one model from several processes (hosts): jax.distributed plus a lockstep control channel.

JAX on several hosts is multi-controller: every process runs the same Python program and dispatches the
same compiled programs in the same order, each feeding its own devices; the collectives inside the
programs connect them. A scheduler, however, runs once, on process 0, which owns the front end (gRPC,
CLI output). So:

  process 0:  LockstepEngine(engine) wraps the local JaxEngine. Every engine call (prefill chunks, a
              decode batch, warmup) is first sent to every follower over a TCP control channel, then run
              locally.
  others:     follow(engine) receives those calls and replays them, in order, on their own JaxEngine
              until process 0 sends shutdown.

Each call carries everything that picks its program (positions, page tables: the scheduler owns them),
so followers replay the calls alone and never wait for results. Messages are small length-prefixed
JSON; the channel listens on the coordinator's port + 1 by default.

Typical use (every process, same arguments except the process id):

    cluster = multihost.initialize("10.0.0.1:1234", num_processes=2, process_id=i)
    runtime = build_runtime(options)          # mesh over jax.devices(): every process's devices
    multihost.run(cluster, runtime.engine, serve_forever)   # serve_forever(engine) only on process 0
    multihost.shutdown()
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import numpy as np

from jaxinfer import engine as api
from jaxinfer.request import SamplingParams
from jaxinfer.speculation.step_costs import StepCosts

log = logging.getLogger(__name__)

T = TypeVar("T")
_HEADER = struct.Struct("!I")  # message length, network byte order
_MAX_MESSAGE = 64 << 20


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This process's place among the processes serving one model."""

    process_id: int
    num_processes: int
    control_host: str  # process 0's address as the followers reach it
    control_port: int

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address=} must be HOST:PORT, e.g. 10.0.0.1:1234")
    return host.strip("[]"), int(port)


def initialize(
    coordinator: str,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    control_port: int | None = None,
    timeout_s: float = 300.0,
) -> Cluster:
    """Joins the JAX cluster (call before any other JAX work) and returns this process's Cluster.

    coordinator: process 0's HOST:PORT, the same on every process. num_processes and process_id may be
    None where JAX detects them itself (TPU pod slices, SLURM, Open MPI). On CPU the collectives between
    processes run over gloo. control_port: where process 0 listens for followers (default: coordinator
    port + 1).
    """
    host, port = _split_address(coordinator)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"{num_processes=} must be >= 1")
    if process_id is not None and not (0 <= process_id < (num_processes or process_id + 1)):
        raise ValueError(f"{process_id=} must be in [0, {num_processes=})")
    if timeout_s <= 0:
        raise ValueError(f"{timeout_s=} must be > 0")
    # Only read by the CPU client; the default ("none") cannot run a computation spanning processes.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=int(timeout_s),
    )
    cluster = Cluster(
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        control_host=host,
        control_port=control_port if control_port is not None else port + 1,
    )
    log.info(
        "process %d of %d: %d local devices, %d in all",
        cluster.process_id, cluster.num_processes, jax.local_device_count(), jax.device_count(),
    )  # fmt: skip
    return cluster


def shutdown() -> None:
    """Leaves the JAX cluster (a barrier with the other processes)."""
    jax.distributed.shutdown()


def default_mesh_shape() -> dict[str, int]:
    """Tensor parallel inside each host (fast links), data parallel across hosts: {"data": processes,
    "tensor": local devices}. The slot count must then divide by the number of processes."""
    return {"data": jax.process_count(), "tensor": jax.local_device_count()}


def check_mesh_spans_processes(mesh: jax.sharding.Mesh, num_processes: int) -> None:
    """Every process must own devices of the mesh, or it would replay programs it takes no part in."""
    owners = {d.process_index for d in mesh.devices.flat}
    if len(owners) != num_processes:
        raise ValueError(
            f"the mesh {dict(mesh.shape)} covers processes {sorted(owners)} of {num_processes}: "
            "give it every device (jax.device_count() in all)"
        )


# -- The control channel ---------------------------------------------------------------------------------


def _send(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def _recv(sock: socket.socket) -> dict | None:
    """The next message, or None when the peer closed the connection."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > _MAX_MESSAGE:
        raise ConnectionError(f"control message of {size} bytes exceeds {_MAX_MESSAGE}")
    data = _recv_exact(sock, size)
    if data is None:
        return None
    return json.loads(data)


def _accept_followers(cluster: Cluster, timeout_s: float) -> list[socket.socket]:
    server = socket.create_server(("", cluster.control_port), reuse_port=False)
    server.settimeout(timeout_s)
    followers: dict[int, socket.socket] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(followers) < cluster.num_processes - 1:
            server.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                conn, _ = server.accept()
            except TimeoutError as e:
                raise TimeoutError(
                    f"only {len(followers)} of {cluster.num_processes - 1} followers connected to port "
                    f"{cluster.control_port} within {timeout_s}s"
                ) from e
            conn.settimeout(timeout_s)
            hello = _recv(conn)
            process_id = hello.get("process_id", 0) if hello and hello.get("op") == "hello" else 0
            if not 0 < process_id < cluster.num_processes or process_id in followers:
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            followers[process_id] = conn
    except BaseException:
        for conn in followers.values():
            conn.close()
        raise
    finally:
        server.close()
    return [followers[i] for i in sorted(followers)]


def _connect_to_leader(cluster: Cluster, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((cluster.control_host, cluster.control_port), timeout=5.0)
            break
        except OSError as e:  # process 0 may not listen yet
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"process 0's control channel {cluster.control_host}:{cluster.control_port} did not "
                    f"answer within {timeout_s}s"
                ) from e
            time.sleep(0.2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send(sock, {"op": "hello", "process_id": cluster.process_id})
    sock.settimeout(None)  # an idle server sends nothing for as long as it likes
    return sock


def _chunk_to_json(chunk: api.PrefillChunk) -> dict:
    return {
        "slot": chunk.slot,
        "token_ids": [int(t) for t in chunk.token_ids],
        "start": chunk.start,
        "sampling": chunk.sampling.to_json(),
        "page_ids": [int(p) for p in chunk.page_ids],
        "is_last": chunk.is_last,
        "prompt_token_ids": [int(t) for t in chunk.prompt_token_ids],
        "num_generated": chunk.num_generated,
        "token_mask": None if chunk.token_mask is None else chunk.token_mask.tolist(),
        "drafting": chunk.drafting,
    }


def _chunk_from_json(d: dict) -> api.PrefillChunk:
    return api.PrefillChunk(
        slot=d["slot"],
        token_ids=d["token_ids"],
        start=d["start"],
        sampling=SamplingParams.from_json(d["sampling"]),
        page_ids=d["page_ids"],
        is_last=d["is_last"],
        prompt_token_ids=d["prompt_token_ids"],
        num_generated=d["num_generated"],
        token_mask=_array(d["token_mask"]),
        drafting=d["drafting"],
    )


def _batch_to_json(batch: api.DecodeBatch) -> dict:
    return {
        "positions": batch.positions.tolist(),
        "page_table": batch.page_table.tolist(),
        "token_mask": None if batch.token_mask is None else batch.token_mask.tolist(),
        "drafts": None if batch.drafts is None else batch.drafts.tolist(),
        "drafting": None if batch.drafting is None else batch.drafting.tolist(),
    }


def _batch_from_json(d: dict) -> api.DecodeBatch:
    return api.DecodeBatch(
        positions=np.asarray(d["positions"], np.int32),
        page_table=np.asarray(d["page_table"], np.int32),
        token_mask=_array(d["token_mask"]),
        drafts=_array(d["drafts"]),
        drafting=None if d["drafting"] is None else np.asarray(d["drafting"], bool),
    )


def _array(rows: list | None) -> np.ndarray | None:
    return None if rows is None else np.asarray(rows, np.int32)


# -- Process 0 ----------------------------------------------------------------------------------------------


class LockstepEngine(api.Engine):
    """The Engine process 0's scheduler drives: each call goes to every follower, then to the local engine.

    Engine calls must come from one thread (the orchestrator's device thread does so). Create it with
    `lead()`; `close()` tells the followers to stop.
    """

    def __init__(self, engine: api.Engine, followers: Sequence[socket.socket]):
        self.engine = engine
        self._followers = list(followers)
        self._closed = False

    @property
    def num_slots(self) -> int:
        return self.engine.num_slots

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def max_prefill_chunk(self) -> int:
        return self.engine.max_prefill_chunk

    @property
    def page_size(self) -> int:
        return self.engine.page_size

    @property
    def num_pages(self) -> int:
        return self.engine.num_pages

    @property
    def max_draft_tokens(self) -> int:
        return self.engine.max_draft_tokens

    @property
    def draft_heads_depth(self) -> int:
        return self.engine.draft_heads_depth

    @property
    def step_costs(self) -> StepCosts | None:
        return self.engine.step_costs

    def _broadcast(self, message: dict) -> None:
        if self._closed:
            raise RuntimeError("the lockstep engine is closed")
        for sock in self._followers:
            _send(sock, message)

    def prefill(self, chunks: Sequence[api.PrefillChunk]) -> api.PendingStep:
        # Sent before running: a call that raises here raises identically on every follower.
        self._broadcast({"op": "prefill", "chunks": [_chunk_to_json(c) for c in chunks]})
        return self.engine.prefill(chunks)

    def decode(self, batch: api.DecodeBatch) -> api.PendingStep:
        self._broadcast({"op": "decode", "batch": _batch_to_json(batch)})
        return self.engine.decode(batch)

    def warmup(self) -> float:
        self._broadcast({"op": "warmup"})
        return self.engine.warmup()

    def close(self) -> None:
        """Sends shutdown to every follower and closes the channel (idempotent)."""
        if self._closed:
            return
        for sock in self._followers:
            try:
                _send(sock, {"op": "shutdown"})
            except OSError as e:
                log.warning("could not send shutdown to a follower: %s", e)
            sock.close()
        self._closed = True

    def __enter__(self) -> LockstepEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def lead(engine: api.Engine, cluster: Cluster, *, timeout_s: float = 300.0) -> LockstepEngine:
    """On process 0: waits for every follower to connect and returns the engine to serve with."""
    if not cluster.is_leader:
        raise ValueError(f"lead() runs on process 0, this is process {cluster.process_id}")
    mesh = getattr(engine, "mesh", None)
    if mesh is not None:
        check_mesh_spans_processes(mesh, cluster.num_processes)
    return LockstepEngine(engine, _accept_followers(cluster, timeout_s))


# -- The other processes ------------------------------------------------------------------------------------


def follow(engine: api.Engine, cluster: Cluster, *, timeout_s: float = 300.0) -> int:
    """On processes != 0: replays process 0's engine calls until it sends shutdown.

    Returns the number of calls replayed. Raises ConnectionError if process 0 goes away without shutdown.
    `timeout_s` bounds only the wait for process 0's channel to open; serving may idle for any time.
    """
    if cluster.is_leader:
        raise ValueError("follow() runs on processes other than 0")
    mesh = getattr(engine, "mesh", None)
    if mesh is not None:
        check_mesh_spans_processes(mesh, cluster.num_processes)
    sock = _connect_to_leader(cluster, timeout_s)
    calls = 0
    try:
        while True:
            message = _recv(sock)
            if message is None:
                raise ConnectionError("process 0 closed the control channel without a shutdown")
            op = message["op"]
            if op == "shutdown":
                return calls
            calls += 1
            try:
                if op == "prefill":
                    engine.prefill([_chunk_from_json(c) for c in message["chunks"]])
                elif op == "decode":
                    engine.decode(_batch_from_json(message["batch"]))
                elif op == "warmup":
                    engine.warmup()
                else:
                    raise ValueError(f"unknown control message {op!r}")
            except ValueError as e:
                # Process 0 made the same call with the same arguments, so it failed the same way there.
                log.warning("replayed %s failed as on process 0: %s", op, e)
    finally:
        sock.close()


def run(
    cluster: Cluster,
    engine: api.Engine,
    leader_main: Callable[[api.Engine], T],
    *,
    timeout_s: float = 300.0,
) -> T | None:
    """Process 0 runs `leader_main(lockstep_engine)` and then stops the followers (even if it raised);
    the other processes follow until then. Returns leader_main's value on process 0, None elsewhere."""
    if cluster.is_leader:
        with lead(engine, cluster, timeout_s=timeout_s) as lockstep:
            return leader_main(lockstep)
    follow(engine, cluster, timeout_s=timeout_s)
    return None
