"""Reaching the Ray cluster a run computes on (`ray.address`), before any work.

'' starts a local Ray for this process (its logical CPUs: what the workers reserve, at least the
machine's cores, so a 2-core laptop still hosts 2 rollout + 1 reward + 2 trainer workers);
'auto' joins the cluster this node belongs to; 'HOST:PORT' a cluster's GCS; 'ray://HOST:PORT'
the Ray client. An address that answers nothing fails within `ray.connect_timeout_s`, naming it —
Ray's own connect would retry for minutes first.
"""

from __future__ import annotations

import os
import socket

from ..config.schema import ExperimentConfig, RayConfig, WorkerResources
from ..errors import ExpectedError

FORWARDED_ENV = ("PIXRL_", "HF_", "TRANSFORMERS_", "DIFFUSERS_", "OMP_NUM_THREADS")  # what workers inherit


class RayUnavailable(ExpectedError, RuntimeError):
    """The Ray engine cannot start: Ray is not installed, or the cluster is not reachable."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("run.engine=ray needs Ray: pip install 'pixrl[ray]'") from None
    return ray


def _host_port(address: str) -> tuple[str, int] | None:
    rest = address.removeprefix("ray://")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host, int(port)


def check_address(r: RayConfig) -> None:
    """Fail fast, naming the address and the fix, when a configured cluster does not answer."""
    import_ray()
    address = r.address
    if address in ("", "auto", "local"):
        return
    hp = _host_port(address)
    if hp is None:
        raise RayUnavailable(f"ray.address={address!r} is not an address: use '' (a local Ray), 'auto', "
                             f"'HOST:PORT' (the head's GCS, `ray start --head` prints it) or 'ray://HOST:10001'")
    try:
        socket.create_connection(hp, timeout=r.connect_timeout_s).close()
    except OSError as exc:
        raise RayUnavailable(f"ray.address={address!r}: nothing answers at {hp[0]}:{hp[1]} ({exc}); start the head "
                             f"with `ray start --head` there, or set ray.address='' for a local Ray") from None


def worker_runtime_env(r: RayConfig) -> dict:
    """ray.runtime_env, with this process's pixrl/HF settings among its env_vars (read when a
    worker is created, so a restarted worker sees what its first start saw)."""
    forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
    return {**r.runtime_env, "env_vars": {**forwarded, **r.runtime_env.get("env_vars", {})}}


def connect(cfg: ExperimentConfig) -> bool:
    """Join or start the cluster; True if this call started a local Ray (the engine stops it)."""
    ray = import_ray()
    r = cfg.ray
    if ray.is_initialized():
        return False
    check_address(r)
    if r.address in ("", "local"):
        asked = r.rollout_workers * r.rollout.num_cpus + r.reward_workers * r.reward.num_cpus \
            + r.trainer_workers * r.trainer.num_cpus
        cpus = r.num_cpus or max(int(asked + 0.999), os.cpu_count() or 1)
        gpus = _local_gpus()
        ray.init(num_cpus=cpus, num_gpus=gpus, object_store_memory=r.object_store_mb * 1024 * 1024,
                 include_dashboard=False, log_to_driver=False, namespace="pixrl")
        return True
    try:
        ray.init(address=r.address, log_to_driver=False, namespace="pixrl")
    except (ConnectionError, RuntimeError) as exc:
        raise RayUnavailable(f"ray.address={r.address!r}: could not join the cluster ({exc}); check "
                             f"`ray status` on the head, or set ray.address='' for a local Ray") from None
    return False


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no CUDA runtime: a CPU machine
        return 0


def actor_options(res: WorkerResources, r: RayConfig, restarts: int | None = None) -> dict:
    """ray.remote options of one worker of a kind."""
    return {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus, "resources": dict(res.resources),
            "max_restarts": r.max_restarts if restarts is None else restarts, "max_task_retries": 0,
            "runtime_env": worker_runtime_env(r)}


def worker_threads(res: WorkerResources, cfg: ExperimentConfig) -> int:
    """Intra-op threads of a worker: run.threads, else the CPUs it reserved (at least 1)."""
    return cfg.run.threads or max(1, int(res.num_cpus))
