"""Kafka: any cluster by configuration; the embedded local broker by default."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from entity_assets.broker import DEFAULT_PORT

DEFAULT_BOOTSTRAP = f"127.0.0.1:{DEFAULT_PORT}"
"""The embedded broker (entity_assets.broker) of the demo and the scripts."""


class KafkaResource(ConfigurableResource):
    """Connection settings shared by the sensor (driver) and the Spark tasks (executors).

    Topic names are the seed's stream names behind an optional prefix, such as the
    `<tenant>.<environment>.` convention of the ingestion seed.
    """

    bootstrap_servers: str = DEFAULT_BOOTSTRAP
    topic_prefix: str = Field(default="", description="prepended to every stream name, e.g. 'acme.prod.'")
    security_protocol: str | None = Field(default=None, description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = Field(default=None, description="set through EnvVar, never inline")
    ssl_ca_location: str | None = None
    client_config: dict[str, str] = Field(default_factory=dict, description="extra librdkafka settings, passed through")
    publish: bool = Field(default=True, description="publish derived streams back to their topics")
    new_topic_partitions: int = Field(default=4, description="partitions of output topics this project creates")
    new_topic_config: dict[str, str] = Field(
        default_factory=dict, description="topic configs of output topics this project creates, e.g. retention.ms")

    def config(self) -> dict[str, str]:
        """librdkafka settings for consumers, producers and admin clients."""
        conf = {"bootstrap.servers": self.bootstrap_servers}
        optional = {
            "security.protocol": self.security_protocol,
            "sasl.mechanism": self.sasl_mechanism,
            "sasl.username": self.sasl_username,
            "sasl.password": self.sasl_password,
            "ssl.ca.location": self.ssl_ca_location,
        }
        conf.update({k: v for k, v in optional.items() if v is not None})
        conf.update(self.client_config)
        return conf

    def topic(self, stream: str) -> str:
        return f"{self.topic_prefix}{stream}"

    def end_offsets(self, topics: list[str], timeout: float = 10.0) -> dict[tuple[str, int], int]:
        """High watermarks of every partition of `topics` that exists."""
        from entity_assets.kafka_io import end_offsets

        return end_offsets(self.config(), topics, timeout)
