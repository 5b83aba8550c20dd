"""The code location: assets, checks, the slice job, the Kafka sensor and their resources."""

from __future__ import annotations

import json
import os
import re

from dagster import Definitions, EnvVar, in_process_executor, map_asset_specs
from pydantic import ValidationError

from entity_assets.assets.common import with_columns
from entity_assets.assets.devices import devices
from entity_assets.assets.entities import apply_patches, entity_patches
from entity_assets.assets.ingest import ingest
from entity_assets.assets.notifications import changes_by_device, device_notifications, zone_changes
from entity_assets.assets.schemas import learn_schemas
from entity_assets.jobs import history_job, slice_job, trace_job
from entity_assets.maintenance import lake_maintenance, lake_maintenance_schedule
from entity_assets.sensors import kafka_offsets_sensor
from resources import KafkaResource, LakeResource, SettingError, SlicingResource, SparkResource
from resources.kafka import DEFAULT_BOOTSTRAP, IngestionSource


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _number(name: str, default: str, kind: type = int):
    """Environment variable `name` as an int (or `kind`), its default when unset or empty."""
    text = os.environ.get(name) or default
    try:
        return kind(text)
    except ValueError:
        raise SettingError(f"{name}={text!r} is not {'an integer' if kind is int else 'a number'}") from None


SECRET_KEYS = re.compile(r"(password|secret|secret\.key|session\.token|jaas\.config|oauthbearer\.config|key\.pem)$"
                         r"|account\.key")
"""Keys of librdkafka and Spark (Hadoop) settings that hold a secret (`ssl.keystore.password`,
`sasl.oauthbearer.client.secret`, `ssl.key.pem`, `spark.hadoop.fs.s3a.secret.key`,
`fs.azure.account.key.<account>`): a resource's plain setting is shown in the UI and stored
with the code location's snapshot, so a secret comes through the environment
(`ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV`; Spark's object stores read their own variables)."""


def _settings(name: str, *, secrets_refused: bool = False) -> dict[str, str]:
    """Environment variable `name`, `key=value,key=value` (the form of Kafka's own CLI tools), as
    a dict. An item without `=` continues the value before it (`cleanup.policy=compact,delete`);
    with none before, it is refused here, where librdkafka or Spark would name no variable."""
    settings: dict[str, str] = {}
    key = None
    for item in filter(str.strip, _env(name, "").split(",")):
        name_part, equals, value = item.partition("=")
        if equals and name_part.strip():
            key = name_part.strip()
            settings[key] = value.strip()
        elif key is not None and not equals:
            settings[key] += "," + item.strip()
        else:
            raise SettingError(f"{name}: {item.strip()!r} is not KEY=VALUE")
    if secrets_refused and (secret := next((k for k in settings if SECRET_KEYS.search(k.lower())), None)):
        raise SettingError(f"{name}: {secret} holds a secret, which the UI would show: name the variable that holds "
                           f"it in ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV ({secret}=VARIABLE), or for Spark use the "
                           "object store's own variables (docs/operations.md)")
    return settings


def _json_object(name: str, text: str) -> dict:
    """The JSON object of environment variable `name`; an error names the variable, which the
    code location's load error otherwise would not."""
    try:
        value = json.loads(text.strip() or "{}")
    except json.JSONDecodeError as exc:
        raise SettingError(f"{name} is not JSON: {exc}") from exc
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise SettingError(f"{name} must be a JSON object of objects, not {text.strip()[:80]!r}")
    return value


def _ingestion(name: str) -> dict[str, IngestionSource]:
    """`system=format,...` (`*` for any other system), or a JSON object of each system's
    `IngestionSource` settings; empty: no ingestion topics are read."""
    text = os.environ[name]
    sources = _json_object(name, text) if text.lstrip().startswith("{") else {
        system: {"format": fmt} for system, fmt in _settings(name).items()}
    ingestion = {}
    for system, settings in sources.items():
        if unknown := sorted(set(settings) - set(IngestionSource.model_fields)):  # Config keeps them, unused
            raise SettingError(f"{name}: system {system!r}: no setting {', '.join(unknown)}")
        try:
            ingestion[system] = IngestionSource(**settings)
        except ValidationError as exc:
            said = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise SettingError(f"{name}: system {system!r}: {said}") from None
    return ingestion


def _stream_topic_config(text: str) -> dict[str, dict[str, str]]:
    """A JSON object of each derived stream's topic configs, `{"device-notifications":
    {"cleanup.policy": "compact"}}`; a value may be a JSON number (`"retention.ms": 86400000`)."""
    return {stream: {key: str(value) for key, value in settings.items()}
            for stream, settings in _json_object("ENTITY_ASSETS_STREAM_TOPIC_CONFIG", text).items()}


def _publish(text: str) -> dict:
    """`true`, `false`, or the derived streams to publish, `stream,stream` (their seed names)."""
    switch = text.strip().lower()
    if switch in ("true", "false"):
        return {"publish": switch == "true"}
    return {"publish": True, "published_streams": [s.strip() for s in text.split(",") if s.strip()]}


def build_resources() -> dict:
    """Embedded defaults (local broker, local lake, local Spark); the settings a deployment sets
    are overridable by env (docs/operations.md lists them), secrets through EnvVar."""
    kafka = {
        "bootstrap_servers": _env("ENTITY_ASSETS_KAFKA_BOOTSTRAP", DEFAULT_BOOTSTRAP),
        "topic_prefix": _env("ENTITY_ASSETS_TOPIC_PREFIX", ""),
        "client_config": _settings("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", secrets_refused=True),
        "client_secret_env": _settings("ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV"),
        "new_topic_partitions": _number("ENTITY_ASSETS_NEW_TOPIC_PARTITIONS", "4"),
        "new_topic_config": _settings("ENTITY_ASSETS_NEW_TOPIC_CONFIG"),
        "new_topic_replication_factor": _number("ENTITY_ASSETS_NEW_TOPIC_REPLICATION_FACTOR", "-1"),
        "stream_topic_config": _stream_topic_config(_env("ENTITY_ASSETS_STREAM_TOPIC_CONFIG", "")),
        **_publish(_env("ENTITY_ASSETS_PUBLISH", "true")),
    }
    if "ENTITY_ASSETS_INGESTION" in os.environ:
        kafka["ingestion"] = _ingestion("ENTITY_ASSETS_INGESTION")
    for field, var in (("security_protocol", "KAFKA_SECURITY_PROTOCOL"), ("sasl_mechanism", "KAFKA_SASL_MECHANISM"),
                       ("ssl_ca_location", "KAFKA_SSL_CA_LOCATION")):
        if os.environ.get(var):
            kafka[field] = os.environ[var]
    for field, var in (("sasl_username", "KAFKA_SASL_USERNAME"), ("sasl_password", "KAFKA_SASL_PASSWORD"),
                       ("ssl_key_password", "KAFKA_SSL_KEY_PASSWORD")):
        if os.environ.get(var):
            kafka[field] = EnvVar(var)  # resolved at run time, never stored in run config
    lake = {"root": os.environ["ENTITY_ASSETS_LAKE"]} if os.environ.get("ENTITY_ASSETS_LAKE") else {}
    lake["vacuum_retention_hours"] = _number("ENTITY_ASSETS_VACUUM_RETENTION_HOURS", "168")
    if os.environ.get("ENTITY_ASSETS_STATE_FILE_ROWS"):
        lake["state_file_rows"] = _number("ENTITY_ASSETS_STATE_FILE_ROWS", "")
    spark = {"driver_rows": _number("ENTITY_ASSETS_SPARK_DRIVER_ROWS", "")} \
        if os.environ.get("ENTITY_ASSETS_SPARK_DRIVER_ROWS") else {}
    return {
        "spark": SparkResource(master=_env("ENTITY_ASSETS_SPARK_MASTER", "local[*]"),
                               conf=_settings("ENTITY_ASSETS_SPARK_CONF", secrets_refused=True), **spark),
        "kafka": KafkaResource(**kafka),
        "lake": LakeResource(**lake),
        "slicing": SlicingResource(
            min_interval_seconds=_number("ENTITY_ASSETS_SLICE_INTERVAL_SECONDS", "900", float),
            max_messages=_number("ENTITY_ASSETS_SLICE_MAX_MESSAGES", "5000000"),
            max_messages_per_task=_number("ENTITY_ASSETS_SLICE_MAX_PER_TASK", "200000"),
            dedupe_window_slices=_number("ENTITY_ASSETS_DEDUPE_WINDOW_SLICES", "4"),
            parts_wait_slices=_number("ENTITY_ASSETS_PARTS_WAIT_SLICES", "96"),
            schema_wait_slices=_number("ENTITY_ASSETS_SCHEMA_WAIT_SLICES", "4"),
            offsets_went_back=_env("ENTITY_ASSETS_OFFSETS_WENT_BACK", "report"),
        ),
    }


defs = Definitions(
    assets=map_asset_specs(with_columns, [ingest, entity_patches, apply_patches, learn_schemas, devices, zone_changes,
                                          changes_by_device, device_notifications]),
    jobs=[slice_job, lake_maintenance, trace_job, history_job],
    schedules=[lake_maintenance_schedule],
    sensors=[kafka_offsets_sensor],
    resources=build_resources(),
    # In-process: all steps of a run share one SparkSession (one JVM start per run, not per step),
    # also in the runs that the UI's Materialize and asset backfills launch (Dagster's asset job).
    executor=in_process_executor,
)
