"""Kafka: any cluster by configuration; the embedded local broker by default."""

from __future__ import annotations

import os
import re
from typing import Literal

from dagster import Config, ConfigurableResource
from pydantic import Field, ValidationInfo, field_validator

from entity_assets import adapters
from entity_assets.broker import DEFAULT_PORT
from entity_assets.ingest import INPUT_STREAMS, IngestionStream, InputStream, ingestion_stream
from entity_assets.publish import STREAMS
from resources.deployed import Deployed

DERIVED_STREAMS = tuple(stream.name for stream in STREAMS.values())
"""The streams the assets publish, by their seed names (`KafkaResource.published_streams`)."""

SEED_DURABILITY = {"cleanup.policy": "compact", "min.compaction.lag.ms": str(7 * 24 * 3600 * 1000)}
"""Every derived stream is "time-based compacted" (the seed): each message is kept a week, Kafka's
default retention, before compaction may drop it; then each key's newest is kept for good."""

DEFAULT_BOOTSTRAP = f"127.0.0.1:{DEFAULT_PORT}"
"""The embedded broker (entity_assets.broker) of the demo and the scripts."""
_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""An environment variable's name, as `client_secret_env` values must be."""


class IngestionSource(Config):
    """A source system whose CDC connector writes `<prefix><system>.<projection>.ingestion` topics."""

    format: Literal["auto", "db2", "goldengate", "debezium", "qlik"] = Field(
        default="auto", description="the connector's record format; auto tells them apart per record")
    dbid: str | None = Field(default=None, description="database of its entities (default: the system's name)")
    zone: str | None = Field(default=None, description="zone of its entities (default: the system's name)")
    learning: bool = Field(default=False, description="its entity updates feed schema learning")
    updates: Literal["replace", "merge"] = Field(
        default="replace", description="replace: a change's row is the whole row (the seeds); merge: set its "
                                       "columns and keep the others (connectors that send changed columns only)")
    collection: Literal["projection", "table"] = Field(
        default="projection", description="projection: the topic's (the seed's one topic per table); table: the "
                                          "table each record names (topics that carry several tables)")
    includeBefore: bool = Field(default=False, description="its entity updates carry the document before the change")
    includeAfter: bool = Field(default=False, description="its entity updates carry the document after the change")
    schema_projection: str | None = Field(
        default=None, description="Qlik Replicate's schema topic, <system>.<schema_projection>.ingestion: a slice reads "
                                  "its metadata messages first, so data that they register decodes at once")
    unavailable_value: str | None = Field(
        default=adapters.UNAVAILABLE_VALUE, description="Debezium's placeholder of a column it did not read (a PostgreSQL TOASTed "
                                               "value an update left, an Oracle LOB): such a column keeps the entity's value")

    @field_validator("schema_projection")
    @classmethod
    def _one_name(cls, projection: str | None) -> str | None:
        if projection is not None and (not projection or "." in projection):
            raise ValueError(f"schema_projection {projection!r}: a topic's projection is one name, without a dot")
        return projection


class KafkaResource(Deployed, ConfigurableResource):
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
    ssl_key_password: str | None = Field(default=None, description="the client key's password (mutual TLS), set "
                                                                   "through EnvVar, never inline")
    client_config: dict[str, str] = Field(default_factory=dict, description="extra librdkafka settings, passed through")
    client_secret_env: dict[str, str] = Field(
        default_factory=dict, description="librdkafka settings that hold secrets -> the environment variable each is "
                                          "read from when a client is made, e.g. {'ssl.keystore.password': "
                                          "'KAFKA_KEYSTORE_PASSWORD'}: only the names are settings")
    publish: bool = Field(default=True, description="publish derived streams back to their topics")
    published_streams: list[str] | None = Field(
        default=None, description="with publish: only these derived streams (the seed's names, e.g. "
                                  "['partial-responses', 'complete-responses']); None: every one")
    new_topic_partitions: int = Field(default=4, description="partitions of output topics this project creates")
    new_topic_replication_factor: int = Field(
        default=-1, description="replicas of each topic this project creates; -1: the cluster's default.replication.factor")
    new_topic_config: dict[str, str] = Field(
        default_factory=dict, description="topic configs of output topics this project creates, e.g. retention.ms")
    stream_topic_config: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="derived stream (its seed name) -> topic configs of its topic when this "
                                          "project creates it, over new_topic_config, e.g. "
                                          "{'device-notifications': {'cleanup.policy': 'compact'}}")
    commit_offsets: bool = Field(
        default=True, description="commit the offsets of the last slice done to the consumer group the slices are "
                                  "read as, so Kafka's lag tools show how far the lake is behind (needs Read on the "
                                  "group); nothing reads them back")
    ingestion: dict[str, IngestionSource] = Field(
        default_factory=lambda: {adapters.ANY_SYSTEM: IngestionSource()},
        description="source system ('*': any other) -> how its CDC ingestion topics become entity batches; "
                    "{} reads none")

    def config(self) -> dict[str, str]:
        """librdkafka settings for consumers, producers and admin clients."""
        conf = {"bootstrap.servers": self.bootstrap_servers}
        optional = {
            "security.protocol": self.security_protocol,
            "sasl.mechanism": self.sasl_mechanism,
            "sasl.username": self.sasl_username,
            "sasl.password": self.sasl_password,
            "ssl.ca.location": self.ssl_ca_location,
            "ssl.key.password": self.ssl_key_password,
        }
        conf.update({k: v for k, v in optional.items() if v is not None})
        conf.update(self.client_config)
        missing = [var for var in self.client_secret_env.values() if not os.environ.get(var)]
        if missing:
            from resources import SettingError  # not at the top: the package imports this module first

            raise SettingError(f"client_secret_env: {', '.join(missing)} not set (or empty) in this process's environment")
        conf.update({key: os.environ[var] for key, var in self.client_secret_env.items()})
        return conf

    @field_validator("published_streams", "stream_topic_config")
    @classmethod
    def _known_streams(cls, streams: list[str] | dict[str, dict[str, str]] | None, info: ValidationInfo):
        unknown = sorted(set(streams or ()) - set(DERIVED_STREAMS))
        if unknown:
            raise ValueError(f"{info.field_name}: no derived stream is named {', '.join(unknown)} "
                             f"(they are {', '.join(DERIVED_STREAMS)})")
        return streams

    @field_validator("ingestion")
    @classmethod
    def _systems(cls, ingestion: dict[str, IngestionSource]) -> dict[str, IngestionSource]:
        """A system is one name of `<prefix><system>.<projection>.ingestion`: `acme.prod.crm` would
        never match a topic, and its CDC data would go unread."""
        if bad := sorted(system for system in ingestion if not system.strip() or "." in system):
            raise ValueError(f"ingestion: source system {bad[0]!r} is not one name of a topic "
                             "<prefix><system>.<projection>.ingestion (the prefix is topic_prefix, "
                             "ENTITY_ASSETS_TOPIC_PREFIX)")
        return ingestion

    @field_validator("client_secret_env")
    @classmethod
    def _variable_names(cls, secrets: dict[str, str]) -> dict[str, str]:
        """A value is a variable's name: a secret written here by mistake would be a plain
        setting, shown in the UI; it is not repeated in the error."""
        if bad := sorted(key for key, variable in secrets.items() if not _VARIABLE.fullmatch(variable)):
            raise ValueError(f"client_secret_env: the value of {', '.join(bad)} is not an environment variable's name "
                             "(the variable holds the secret)")
        return secrets

    @field_validator("security_protocol")
    @classmethod
    def _protocol(cls, protocol: str | None) -> str | None:
        if protocol is not None and protocol.upper() not in _PROTOCOLS:
            raise ValueError(f"security_protocol {protocol!r}: one of {', '.join(_PROTOCOLS)}")
        return protocol

    @field_validator("new_topic_partitions", "new_topic_replication_factor")
    @classmethod
    def _count_or_default(cls, count: int, info: ValidationInfo) -> int:
        if count == 0 or count < -1:
            raise ValueError(f"{info.field_name}: {count}; give 1 or more, or -1 for the cluster's default")
        return count

    def publishes(self, stream: str) -> bool:
        """Whether the derived stream `stream` (its seed name) is written to its topic."""
        return self.publish and (self.published_streams is None or stream in self.published_streams)

    def topic(self, stream: str) -> str:
        return f"{self.topic_prefix}{stream}"

    def topic_named(self, name: str) -> str:
        """The topic a user names (`produce file`, `trace`): an input stream's, or a topic's with or
        without the prefix, which ingestion topics hold too."""
        if name in INPUT_STREAMS or not name.startswith(self.topic_prefix):
            return self.topic(name)
        return name

    def new_topic_settings(self, stream: str) -> dict[str, str]:
        """Topic configs of the derived stream `stream`'s topic, for when this project creates it:
        the seed's durability, under `new_topic_config`, under the stream's own."""
        return {**SEED_DURABILITY, **self.new_topic_config, **self.stream_topic_config.get(stream, {})}

    def end_offsets(self, topics: list[str], timeout: float = 10.0) -> dict[tuple[str, int], int]:
        """High watermarks of every partition of `topics` that exists."""
        from entity_assets.kafka_io import end_offsets

        return end_offsets(self.config(), topics, timeout)

    def commit(self, positions: dict[tuple[str, int], int]) -> str:
        """Commits a slice's end offsets to the slices' consumer group (`commit_offsets`); returns the group."""
        from entity_assets.kafka_io import commit_offsets

        return commit_offsets(self.config(), positions)

    def sources(self) -> dict[str, adapters.Source]:
        """`ingestion` as the adapters' plain settings (what Spark tasks get)."""
        return {system: adapters.Source(system, **s.model_dump()) for system, s in self.ingestion.items()}

    def input_stream(self, topic: str) -> InputStream | IngestionStream | None:
        """What a topic feeds: a seed input stream, a configured source's ingestion topic, or nothing."""
        for name, stream in INPUT_STREAMS.items():
            if topic == self.topic(name):
                return stream
        return ingestion_stream(topic, self.topic_prefix, self.sources())

    def input_watermarks(self, timeout: float = 10.0,
                         unanswered: list[str] | None = None) -> dict[tuple[str, int], tuple[int, int]]:
        """(first offset held, end offset) of every partition of every input topic on the broker:
        the seed's and the ingestion topics. With `unanswered`, a seed input topic the broker
        does not list is named there too, unless no input topic answered: the sensor then says
        the cluster has none (`no_input_topic`; see `kafka_io.watermarks`)."""
        from entity_assets.kafka_io import watermarks

        return watermarks(self.config(), lambda topic: self.input_stream(topic) is not None, timeout, unanswered,
                          expected=map(self.topic, INPUT_STREAMS))
