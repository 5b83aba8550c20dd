"""The embedded local broker: a Kafka-protocol server (noida-db) on 127.0.0.1.

Started and stopped by the project's own commands with its data under the project home, so
the demo and the tests need nothing installed by hand. A real cluster replaces it through the
Kafka resource's settings alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from entity_assets.local_service import LocalService, NotInstalled

DEFAULT_PORT = 29092
"""Below Linux's ephemeral ports (32768-60999 by default), which the kernel gives to outgoing
connections: right after a busy test run one of those may still hold a port in that range."""


def _binary() -> Path:
    try:
        import noida_db
    except ImportError:  # a deployment's install, which has a cluster of its own
        raise NotInstalled("the embedded broker comes with the package's `local` extra: "
                           "pip install 'entity-assets[local]' (scripts/setup.sh installs it)") from None
    return Path(noida_db.__file__).parent / "noida-db"


@dataclass(frozen=True)
class LocalBroker(LocalService):
    port: int = DEFAULT_PORT
    name, program = "broker", "noida-db"

    @property
    def bootstrap(self) -> str:
        return self.address

    @property
    def folder_argument(self) -> str:
        return str(self.data_dir / "data")

    def command(self) -> list[str]:
        return [str(_binary()), "start", "--data-dir", self.folder_argument, "--only", "kafka",
                "--kafka-port", str(self.port), "--host", self.host]

    def ready(self) -> bool:
        """A Kafka metadata answer naming a broker; a closed port is told by a plain connect, without
        starting a client (its threads) for every probe of a start."""
        from confluent_kafka.admin import AdminClient

        if not self.listening():
            return False
        try:
            return bool(AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=1).brokers)
        except Exception:
            return False

    def stop(self, timeout: float = 30.0) -> bool:
        """Waits for the broker to save its data. This process's idle producers end first: they
        would retry connecting until it exits."""
        from entity_assets.kafka_io import release_producers

        release_producers()
        return super().stop(timeout)
