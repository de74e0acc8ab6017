"""Moving a policy version's tensors to a vLLM server over a process group (the sender's end of
engines/vllm_receiver.py; `sampling.cot_vllm_weights=broadcast`).

One move is one session of vLLM's weight-update API, opened and closed by this process:

1. this process hosts a TCPStore and asks the server to join (`/init_weight_transfer_engine`);
   it rendezvouses only once every worker has accepted the session, so a refusal (another
   sender's session is open, or the server has no pixrl backend) returns at once instead of
   leaving this side waiting;
2. `/start_weight_update`, then `/update_weights` announcing names, dtypes and shapes while this
   process broadcasts the packed chunks (gloo when the tensors are on the CPU, NCCL on CUDA);
3. `/finish_weight_update` with the version's name, which `/weight_info` then reports — a sender
   that finds its version already there (another rollout worker moved it) sends nothing;
4. `/shutdown_weight_transfer_engine`, whatever happened.
"""

from __future__ import annotations

import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import torch

from . import weight_wire


def address_towards(url: str) -> str:
    """This machine's address on the route to the server at `url` (what the server dials back)."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the interface
        return s.getsockname()[0]


class WeightPush:
    """`push(tensors, version)` moves the tensors into the server at `url`. `call(path, payload,
    what)` posts to the server and raises `error` on a refusal; `get(path)` reads from it."""

    def __init__(self, url: str, call, get, error: type[Exception], address: str = "",
                 timeout_s: float = 300.0, chunk_bytes: int = 256 << 20, busy_wait_s: float = 600.0):
        self.url, self.call, self.get, self.error = url, call, get, error
        self.address = address or address_towards(url)
        self.timeout_s, self.chunk_bytes, self.busy_wait_s = timeout_s, chunk_bytes, busy_wait_s

    def server_version(self) -> str | None:
        return self.get("/weight_info").get("weight_version")

    def push(self, tensors: dict[str, torch.Tensor], version: str) -> bool:
        """Move `tensors` in as `version`; False when the server already held it."""
        deadline = time.time() + self.busy_wait_s
        while True:
            if self.server_version() == version:
                return False
            try:
                self._session(tensors, version)
                return True
            except _Busy as exc:
                if time.time() > deadline:
                    raise self.error(f"the vLLM server {self.url} stayed busy moving another sender's weights for "
                                     f"{self.busy_wait_s:.0f} s ({exc})") from None
                time.sleep(0.5)

    def _session(self, tensors: dict[str, torch.Tensor], version: str) -> None:
        names = list(tensors)
        world = 1 + int(self.get("/get_world_size")["world_size"])
        backend = "nccl" if next(iter(tensors.values())).is_cuda else "gloo"
        session = uuid.uuid4().hex
        kv = weight_wire.store(self.address, 0, world, True, self.timeout_s)
        init = {"session": session, "master_address": self.address, "master_port": kv.port, "world_size": world,
                "backend": backend, "timeout_s": self.timeout_s}
        pool = ThreadPoolExecutor(1)  # the server answers an init or an update only once the broadcast is done
        try:
            joined = pool.submit(self.call, "/init_weight_transfer_engine", {"init_info": init}, "joining a weight move")
            self._await_acceptance(kv, session, world, joined)
            pg = weight_wire.group(kv, session, 0, world, backend, self.timeout_s)
            joined.result()
            self.call("/start_weight_update", {}, "starting a weight update")
            info = {"session": session, "names": names, "dtype_names": [str(t.dtype).split(".")[-1] for t in
                                                                        tensors.values()],
                    "shapes": [list(t.shape) for t in tensors.values()], "chunk_bytes": self.chunk_bytes}
            received = pool.submit(self.call, "/update_weights", {"update_info": info}, f"receiving version {version}")
            for idx in weight_wire.chunk_plan(info["dtype_names"], info["shapes"], self.chunk_bytes):
                if received.done():
                    received.result()  # refused before taking every chunk: raise now, not at the timeout
                chunk = [tensors[names[i]] for i in idx]
                weight_wire.broadcast(pg, weight_wire.pack(chunk, chunk[0].device))
            received.result()
            self.call("/finish_weight_update", {"weight_version": version}, f"loading version {version}")
        finally:
            try:
                self.call("/shutdown_weight_transfer_engine", {}, "closing the weight move")
            except Exception:  # noqa: BLE001 — the move's own error (raised above) is the one to report
                pass
            pool.shutdown(wait=False)

    def _await_acceptance(self, kv, session: str, world: int, joined) -> None:
        keys = [f"{session}/{weight_wire.ACCEPTED}/{r}" for r in range(1, world)]
        deadline = time.time() + self.timeout_s
        while not kv.check(keys):
            if joined.done():
                exc = joined.exception()
                if exc is not None and "busy with session" in str(exc):
                    raise _Busy(str(exc))
                if exc is not None:
                    hint = ("; start it with `pixrl serve-vllm-text` (which enables pixrl's weight-transfer backend) "
                            "or set sampling.cot_vllm_weights=files"
                            if "weight_transfer_config" in str(exc) or "pixrl" not in str(exc) else "")
                    raise self.error(f"{exc}{hint}") from None
            if time.time() > deadline:
                raise self.error(f"the vLLM server {self.url} did not join the weight move within {self.timeout_s:.0f} "
                                 f"s: it must reach this process at {self.address}:{kv.port} (set "
                                 f"sampling.cot_vllm_address to an address it can reach)")
            time.sleep(0.02)


class _Busy(Exception):
    """Another sender's session is open on the server."""
