"""pixrl's weight-transfer backend for vLLM (`--weight-transfer-config '{"backend":"pixrl"}'`),
which runs inside vLLM's workers: a policy version arrives over a process group (gloo on CPU,
NCCL on GPU; engines/weight_wire.py) through vLLM's own weight-update API
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`), instead of through files on a shared disk.

vLLM's built-in `nccl` backend needs vLLM on the sending side and a GPU; pixrl's trainer
environment cannot hold vLLM (Prefect's pins), and a CPU build has no NCCL. This backend needs
only torch on the sender.

- **Registered by a vLLM plugin.** `pixrl setup-vllm` installs pixrl into vLLM's environment
  without its dependencies, which adds the `vllm.general_plugins` entry point `register` below;
  vLLM calls it in every process, so the workers know the backend before their model loads.
- **One sender at a time.** A session (the sender's id) is taken at init and released at
  shutdown; another sender's init is refused while one is open and not older than its timeout
  (rollout workers sharing a server retry, or find their version already loaded).
- **Loading** is vLLM's layerwise reload, as its `nccl` backend does it: the checkpoint-format
  tensors go through the model's own `load_weights` (fusing q/k/v, gate/up), then the layers are
  finalised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import weight_wire

BACKEND = "pixrl"


def register() -> None:
    """The `vllm.general_plugins` entry point: make the backend known to this vLLM process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # called once per process, maybe more
        WeightTransferEngineFactory.register_engine(BACKEND, "pixrl.engines.vllm_receiver", "TorchGroupReceiver")


@dataclass
class InitInfo:
    session: str
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    backend: str = "gloo"
    timeout_s: float = 300.0


@dataclass
class UpdateInfo:
    session: str
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    chunk_bytes: int = 256 << 20


def _engine_base():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class TorchGroupReceiver(_engine_base()):
    """The worker's end: joins the sender's group, receives packed chunks, loads them."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.session: str | None = None
        self.opened = 0.0
        self.timeout_s = 0.0
        self.pg = None
        self._store = None

    def _rank(self, info: InitInfo) -> int:
        """This worker's rank in the sender's group (vLLM's own rule: across data-parallel replicas)."""
        pc = self.parallel_config
        return info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, info: InitInfo) -> None:
        if self.session is not None and self.session != info.session and time.time() - self.opened < self.timeout_s:
            raise RuntimeError(f"pixrl weight transfer: busy with session {self.session} (opened "
                               f"{time.time() - self.opened:.0f} s ago); retry once it has finished")
        self.shutdown()
        rank = self._rank(info)
        kv = weight_wire.store(info.master_address, info.master_port, info.world_size, False, info.timeout_s)
        kv.set(f"{info.session}/{weight_wire.ACCEPTED}/{rank}", "1")  # the sender rendezvouses only now
        if info.backend == "nccl":
            torch.cuda.set_device(self.device)
        self.pg = weight_wire.group(kv, info.session, rank, info.world_size, info.backend, info.timeout_s)
        self._store = kv
        self.session, self.opened, self.timeout_s = info.session, time.time(), info.timeout_s

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which a CPU build has no device for;
        # weight_wire.broadcast returns only once a chunk has landed
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: UpdateInfo) -> None:
        if self.pg is None or info.session != self.session:
            raise RuntimeError(f"pixrl weight transfer: update for session {info.session}, but "
                               f"{'no session is open' if self.pg is None else 'session ' + str(self.session) + ' is'}; "
                               f"call /init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            for idx in weight_wire.chunk_plan(info.dtype_names, info.shapes, info.chunk_bytes):
                shapes = [info.shapes[i] for i in idx]
                flat = torch.empty(sum(int(torch.Size(s).numel()) for s in shapes),
                                   dtype=weight_wire.dtype_named(info.dtype_names[idx[0]]), device=self.device)
                weight_wire.broadcast(self.pg, flat)
                self.model.load_weights([(info.names[i], t) for i, t in zip(idx, weight_wire.unpack(flat, shapes))])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.pg, self._store, self.session = None, None, None
