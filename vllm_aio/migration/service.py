"""The migration control of one instance, serving on its unix socket: started next to the scheduler half.

Kept apart from ``control.py`` (the operations) so that the operations can be
driven directly in tests, and from the connector, which only starts and stops
this when ``"migration": true``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_aio.backends.base import Backend
from vllm_aio.config import AioConfig
from vllm_aio.log import get_logger
from vllm_aio.migration.channel import ControlServer, socket_path
from vllm_aio.migration.control import MigrationControl
from vllm_aio.migration.flushes import FlushRequests
from vllm_aio.migration.prefix import PrefixHasher
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.keying import PoolKeying

logger = get_logger(__name__)


@dataclass
class MigrationService:
    control: MigrationControl
    server: ControlServer

    @classmethod
    def start(cls, keying: PoolKeying, flushes: FlushRequests, backend: Backend, deployment: Deployment,
              cfg: AioConfig, hash_algo: str, role: str, engine_id: str) -> MigrationService:
        control = MigrationControl(keying, flushes, backend, deployment, cfg,
                                   PrefixHasher(hash_algo, deployment.block_size), role)
        path = socket_path(engine_id)
        server = ControlServer(path, control.handle)
        server.start()
        logger.info("vllm_aio: migration control on %s (watchdog %g s, transport %s)", path,
                    cfg.migration_watchdog_timeout, cfg.migration_protocol)
        return cls(control, server)

    def close(self) -> None:
        self.server.close()
        self.control.close()
