"""The code location: assets, checks, the slice job, the Kafka sensor and their resources."""

from __future__ import annotations

import inspect
import json
import os
import re
import warnings

from dagster import (AssetSpec, BetaWarning, CodeReferencesMetadataValue, DagsterInvalidDefinitionError, Definitions,
                     EnvVar, LocalFileCodeReference, in_process_executor, map_asset_specs)
from pydantic import ValidationError

from entity_assets.assets import topics
from entity_assets.assets.common import with_columns
from entity_assets.assets.devices import devices
from entity_assets.assets.entities import apply_patches, entity_patches
from entity_assets.assets.ingest import ingest
from entity_assets.assets.retries import retries
from entity_assets.assets.notifications import changes_by_device, device_notifications, zone_changes
from entity_assets.assets.schemas import learn_schemas
from entity_assets.jobs import history_job, slice_job, trace_job
from entity_assets.kafka_io import SASL_MECHANISMS, has_gssapi, refused_setting
from entity_assets.maintenance import lake_maintenance, lake_maintenance_schedule
from entity_assets.sensors import kafka_offsets_sensor
from resources import KafkaResource, LakeResource, SettingError, SlicingResource, SparkResource
from resources.kafka import DEFAULT_BOOTSTRAP, IngestionSource
from resources.lake import LEAST_RETENTION_HOURS


VARIABLES = {
    # KafkaResource
    "bootstrap_servers": "ENTITY_ASSETS_KAFKA_BOOTSTRAP",
    "topic_prefix": "ENTITY_ASSETS_TOPIC_PREFIX",
    "client_config": "ENTITY_ASSETS_KAFKA_CLIENT_CONFIG",
    "client_secret_env": "ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV",
    "new_topic_partitions": "ENTITY_ASSETS_NEW_TOPIC_PARTITIONS",
    "new_topic_config": "ENTITY_ASSETS_NEW_TOPIC_CONFIG",
    "new_topic_replication_factor": "ENTITY_ASSETS_NEW_TOPIC_REPLICATION_FACTOR",
    "stream_topic_config": "ENTITY_ASSETS_STREAM_TOPIC_CONFIG",
    "published_streams": "ENTITY_ASSETS_PUBLISH",
    "ingestion": "ENTITY_ASSETS_INGESTION",
    "commit_offsets": "ENTITY_ASSETS_KAFKA_COMMIT_OFFSETS",
    "security_protocol": "KAFKA_SECURITY_PROTOCOL",
    "sasl_mechanism": "KAFKA_SASL_MECHANISM",
    "ssl_ca_location": "KAFKA_SSL_CA_LOCATION",
    "sasl_username": "KAFKA_SASL_USERNAME",
    "sasl_password": "KAFKA_SASL_PASSWORD",
    "ssl_key_password": "KAFKA_SSL_KEY_PASSWORD",
    # LakeResource
    "root": "ENTITY_ASSETS_LAKE",
    "vacuum_retention_hours": "ENTITY_ASSETS_VACUUM_RETENTION_HOURS",
    "state_file_rows": "ENTITY_ASSETS_STATE_FILE_ROWS",
    # SparkResource
    "master": "ENTITY_ASSETS_SPARK_MASTER",
    "conf": "ENTITY_ASSETS_SPARK_CONF",
    "driver_rows": "ENTITY_ASSETS_SPARK_DRIVER_ROWS",
    # SlicingResource
    "min_interval_seconds": "ENTITY_ASSETS_SLICE_INTERVAL_SECONDS",
    "max_messages": "ENTITY_ASSETS_SLICE_MAX_MESSAGES",
    "max_messages_per_task": "ENTITY_ASSETS_SLICE_MAX_PER_TASK",
    "dedupe_window_slices": "ENTITY_ASSETS_DEDUPE_WINDOW_SLICES",
    "parts_wait_slices": "ENTITY_ASSETS_PARTS_WAIT_SLICES",
    "schema_wait_slices": "ENTITY_ASSETS_SCHEMA_WAIT_SLICES",
    "offsets_went_back": "ENTITY_ASSETS_OFFSETS_WENT_BACK",
}
"""The environment variable of each resource setting a deployment sets (docs/operations.md):
an error in a value names the variable, not the field."""


def _env(field: str, default: str = "") -> str:
    """The variable of `field`, its default when unset or set empty or blank (a deployment's
    template often sets every variable, some to nothing)."""
    return os.environ.get(VARIABLES[field], "").strip() or default


def _given(fields: tuple[str, ...]) -> dict[str, str]:
    """Those of `fields` whose variable is set (and not blank): the others keep the resource's default."""
    return {field: _env(field) for field in fields if _env(field)}


OTHER_VARIABLES = ("ENTITY_ASSETS_HOME", "ENTITY_ASSETS_OWNERS", "ENTITY_ASSETS_STEP_RETRIES",
                   "ENTITY_ASSETS_BROKER_PORT", "ENTITY_ASSETS_SPARK_CONNECT_PORT")
"""The project's variables that are no resource's setting."""


def _no_unknown_variables() -> None:
    """A misspelt variable (`ENTITY_ASSETS_LAKE_URI`) would leave its setting at the default:
    a lake in a folder of the code server's container, which goes with it."""
    known = {*VARIABLES.values(), *OTHER_VARIABLES, *_settings("client_secret_env").values()}  # a secret's own
    unknown = sorted(name for name in os.environ if name.startswith("ENTITY_ASSETS_") and name not in known)
    if unknown:
        import difflib

        meant = {name: difflib.get_close_matches(name, known, 1) for name in unknown}
        raise SettingError("no setting is named " + ", ".join(
            f"{name}{f' (is it {close[0]}?)' if close else ''}" for name, close in meant.items())
            + " (docs/operations.md lists them)")


def _number(field: str, default: str, kind: type = int):
    """The variable of `field` as an int (or `kind`), its default when unset, empty or blank."""
    name = VARIABLES[field]
    text = _env(field, default)
    try:
        return kind(text)
    except ValueError:
        raise SettingError(f"{name}={text!r} is not {'an integer' if kind is int else 'a number'}") from None


SECRET_KEYS = re.compile(r"(password|passphrase|secret|token|secret\.key|secret_key|secretkey|secretaccesskey|access_key"
                         r"|account_key|master_key|sas_key|jaas\.config|oauthbearer\.config|key\.pem|private\.key"
                         r"|encryption\.key|credential|connection_string)$"
                         r"|account\.key(\.|$)|client\.secret\.|fs\.azure\.sas\.(?!token\.(provider\.type|renew\.period\.for\.streams)$)")
"""Keys of librdkafka and Spark (Hadoop) settings that hold a secret (`ssl.keystore.password`,
`sasl.oauthbearer.client.secret`, `ssl.key.pem`, `spark.hadoop.fs.s3a.secret.key`,
`fs.s3a.session.token`, `fs.azure.account.key.<account>`, `fs.azure.sas.fixed.token`,
`fs.azure.account.oauth2.client.secret.<account>`, `fs.gs.auth.service.account.private.key`),
and executors' variables that do (`spark.executorEnv.AWS_SECRET_ACCESS_KEY`,
`…AZURE_STORAGE_SAS_KEY`, `…AZURE_STORAGE_MASTER_KEY`, `…AZURE_STORAGE_CONNECTION_STRING`,
`fs.s3n.awsSecretAccessKey`, `fs.adl.oauth2.credential`, `fs.cosn.userinfo.secretKey`); not
`fs.azure.account.keyprovider.<account>`, which names a class: a resource's plain
setting is shown in the UI and stored with the code location's snapshot, so a secret comes
through the environment (`ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV`; Spark's object stores read
their own variables)."""


def _settings(field: str, *, secrets_refused: bool = False) -> dict[str, str]:
    """The variable of `field`, `key=value,key=value` (the form of Kafka's own CLI tools), or a
    JSON object of strings, as a dict. An item without `=` continues the value before it
    (`cleanup.policy=compact,delete`); with none before, it is refused here, where librdkafka or
    Spark would name no variable."""
    name, text = VARIABLES[field], _env(field)
    if text.startswith("{"):  # a value that holds `k=v,k=v` itself (sasl.oauthbearer.extensions)
        settings = {key: value if isinstance(value, str) else json.dumps(value)
                    for key, value in _json_object(name, text, flat=True).items()}
    else:
        settings = _pairs(name, text)
    if secrets_refused and (secret := next((k for k, v in settings.items() if SECRET_KEYS.search(k.lower().strip())
                                            or any(SECRET_KEYS.search(d.lower()) for d in JAVA_OPTION.findall(v))),
                                           None)):
        raise SettingError(f"{name}: {secret} holds a secret, which the UI would show: name the variable that holds "
                           f"it in ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV ({secret}=VARIABLE), or for Spark use the "
                           "object store's own variables (docs/operations.md)")
    return settings


JAVA_OPTION = re.compile(r"-D([^=\s]+)=")
"""A JVM system property set in a value (`spark.driver.extraJavaOptions=-Dfs.s3a.secret.key=…`)."""

ECHOED = frozenset(VARIABLES) - {"client_config", "client_secret_env", "conf", "sasl_password", "ssl_key_password"}
"""The settings whose text an error may repeat: the others may hold a secret, or a secret given
where a variable's name goes."""


def _pairs(name: str, text: str) -> dict[str, str]:
    """`key=value,key=value` of variable `name`; an item without `=` continues the value before it."""
    settings: dict[str, str] = {}
    key = None
    for n, item in enumerate(filter(str.strip, text.split(",")), 1):
        name_part, equals, value = item.partition("=")
        if equals and name_part.strip():
            key = name_part.strip()
            settings[key] = value.strip()
        elif key is not None and not equals:
            settings[key] += "," + item.strip()
        else:
            if name in {VARIABLES[f] for f in ECHOED}:
                raise SettingError(f"{name}: {item.strip()!r} is not KEY=VALUE")
            raise SettingError(f"{name}: item {n} is not KEY=VALUE (not repeated: it may hold a secret)")
    return settings


def _master() -> str:
    """The Spark master URL, without a Spark Connect token (`sc://host:15002/;token=…`): the UI
    would show it. Spark Connect's client reads it from `SPARK_CONNECT_AUTHENTICATE_TOKEN`.

    A cluster's master needs a lake its executors share: the default lake, a folder of this
    host, would have them write files the driver then commits but does not have."""
    master = _env("master", "local[*]")
    if re.search(r";\s*token\s*=", master, re.IGNORECASE):
        raise SettingError(f"{VARIABLES['master']} holds a token, which the UI would show: set it in "
                           "SPARK_CONNECT_AUTHENTICATE_TOKEN instead, which Spark Connect's client reads")
    if not _given(("root",)) and not LOCAL_MASTER.match(master):
        raise SettingError(f"{VARIABLES['master']}={master!r} names a cluster, but {VARIABLES['root']} is unset: "
                           f"the lake would be a folder of this host that its executors do not share. Set "
                           f"{VARIABLES['root']} (s3://…, abfss://…, or a path every executor mounts)")
    if (master.startswith("sc://") and not LOCAL_MASTER.match(master)
            and not re.search(r";use_ssl=(?i:true)(;|$)", master)
            and not os.environ.get("SPARK_CONNECT_AUTHENTICATE_TOKEN")):  # what makes pyspark's channel TLS
        warnings.warn(f"{VARIABLES['master']}={master!r}: the channel to this Spark Connect endpoint is plaintext "
                      "(add ;use_ssl=true), and the Spark tasks' closures carry the Kafka and lake secrets "
                      "(docs/operations.md, secrets in Spark tasks)", stacklevel=2)
    return master


LOCAL_MASTER = re.compile(r"local(-cluster)?(\[.*\])?$|sc://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?(/.*)?$",
                          re.IGNORECASE)
"""Spark masters whose executors run on this host, and so share its default lake."""


def _json_object(name: str, text: str, *, flat: bool = False) -> dict:
    """The JSON object of environment variable `name`, of objects (or with `flat` of strings,
    numbers and booleans); an error names the variable, which the code location's load error
    otherwise would not."""
    try:
        value = json.loads(text.strip() or "{}")
    except json.JSONDecodeError as exc:
        raise SettingError(f"{name} is not JSON: {exc}") from exc
    kinds = (str, int, float, bool) if flat else dict
    what = f"a JSON object of {'strings' if flat else 'objects'}"
    if not isinstance(value, dict):  # named by its kind and its keys alone: the values may hold secrets
        raise SettingError(f"{name} must be {what}, not a JSON {type(value).__name__}")
    if wrong := next((k for k, v in value.items() if not isinstance(v, kinds)), None):
        raise SettingError(f"{name} must be {what}: {wrong!r} holds a JSON {type(value[wrong]).__name__}")
    return value


def _ingestion() -> dict[str, IngestionSource]:
    """`system=format,...` (`*` for any other system), or a JSON object of each system's
    `IngestionSource` settings; empty: no ingestion topics are read."""
    name = VARIABLES["ingestion"]
    text = os.environ[name]
    sources = _json_object(name, text) if text.lstrip().startswith("{") else {
        system: {"format": fmt} for system, fmt in _settings("ingestion").items()}
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


def _stream_topic_config() -> dict[str, dict[str, str]]:
    """A JSON object of each derived stream's topic configs, `{"device-notifications":
    {"cleanup.policy": "compact"}}`; a value may be a JSON number (`"retention.ms": 86400000`)."""
    return {stream: {key: str(value) for key, value in settings.items()}
            for stream, settings in _json_object(VARIABLES["stream_topic_config"], _env("stream_topic_config")).items()}


def _publish() -> dict:
    """`true`, `false`, or the derived streams to publish, `stream,stream` (their seed names)."""
    text = _env("published_streams", "true")
    switch = text.strip().lower()
    if switch in ("true", "false"):
        return {"publish": switch == "true"}
    streams = [s.strip() for s in text.split(",") if s.strip()]
    if not streams:
        raise SettingError(f"{VARIABLES['published_streams']}={text!r} names no stream: set it to false to "
                           "publish none")
    return {"publish": True, "published_streams": streams}


def _librdkafka_takes(kafka: dict) -> None:
    """Refuses, naming its variable, what librdkafka would refuse as each tick's and run's
    client is made (after the run's retries), naming none."""
    secrets = dict.fromkeys(kafka["client_secret_env"], "-")
    if "ssl_key_password" in kafka:
        secrets["ssl.key.password"] = "-"
    # the secrets' keys alone first: one misspelt is theirs, not the client config's (which may
    # need them: `ssl.keystore.location` its password)
    for field, settings in (("client_secret_env", secrets), ("client_config", {**kafka["client_config"], **secrets})):
        if said := refused_setting(settings):
            raise SettingError(f"{VARIABLES[field]}: librdkafka refuses it: {said}")
    _sasl(kafka)


def _sasl(kafka: dict) -> None:
    """A SASL protocol's mechanism and credentials, which `refused_setting` leaves to a client
    that connects. Each comes from its variable or from a key of the client config, which wins
    (`KafkaResource.config`); the secrets' keys are read at run time only."""
    config, secrets = kafka["client_config"], kafka["client_secret_env"]

    def setting(field: str, *keys: str) -> tuple[str | None, str]:
        """The value librdkafka gets for `keys` (a name and its alias), and where it is set."""
        key = next((k for k in keys if k in config), None)
        return (config[key], f"{key} in {VARIABLES['client_config']}") if key else (kafka.get(field), VARIABLES[field])

    protocol, protocol_from = setting("security_protocol", "security.protocol")
    if not (protocol or "").upper().startswith("SASL_") or secrets.keys() & {"security.protocol", "sasl.mechanism",
                                                                              "sasl.mechanisms"}:
        return  # no SASL, or a protocol or mechanism known at run time only
    mechanism, mechanism_from = setting("sasl_mechanism", "sasl.mechanism", "sasl.mechanisms")
    built = [m for m in SASL_MECHANISMS if m != "GSSAPI" or has_gssapi()]
    if mechanism is None and "GSSAPI" not in built:
        raise SettingError(f"{protocol_from}={protocol} needs {VARIABLES['sasl_mechanism']} ({', '.join(built)}): "
                           "librdkafka's default, GSSAPI (Kerberos), is not in this build of it")
    if mechanism is not None and mechanism not in built:
        raise SettingError(f"{mechanism_from}={mechanism!r}: librdkafka takes {', '.join(built)}, as written"
                           + (" (this build has no GSSAPI, Kerberos)" if mechanism == "GSSAPI" else ""))
    if mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
        lacking = []
        for field, key in (("sasl_username", "sasl.username"), ("sasl_password", "sasl.password")):
            value, where = setting(field, key)
            if not value and key not in secrets:
                lacking.append(where)
        if lacking:
            raise SettingError(f"{mechanism_from}={mechanism} needs a user name and password: set "
                               f"{' and '.join(lacking)}")


def _retention_hours() -> int:
    """The vacuum's retention, refused below `LEAST_RETENTION_HOURS`, which spares the files of a
    slice being written."""
    hours = _number("vacuum_retention_hours", "168")
    if hours < LEAST_RETENTION_HOURS:
        raise SettingError(f"{VARIABLES['vacuum_retention_hours']}={hours}: give {LEAST_RETENTION_HOURS} or more: "
                           "lake maintenance deletes files no version names once they are that old, and a slice "
                           "writing beside it (entity-assets run) has not committed its own yet")
    return hours


def build_resources() -> dict:
    """Embedded defaults (local broker, local lake, local Spark); the settings a deployment sets
    are overridable by env (`VARIABLES`, docs/operations.md), secrets through EnvVar."""
    _no_unknown_variables()
    kafka = {
        "bootstrap_servers": _env("bootstrap_servers", DEFAULT_BOOTSTRAP),
        "topic_prefix": _env("topic_prefix"),
        "client_config": _settings("client_config", secrets_refused=True),
        "client_secret_env": _settings("client_secret_env"),
        "new_topic_partitions": _number("new_topic_partitions", "4"),
        "new_topic_config": _settings("new_topic_config"),
        "new_topic_replication_factor": _number("new_topic_replication_factor", "-1"),
        "stream_topic_config": _stream_topic_config(),
        **_publish(),
        **_given(("security_protocol", "sasl_mechanism", "ssl_ca_location", "commit_offsets")),
        # resolved at run time, never stored in run config
        **{field: EnvVar(VARIABLES[field]) for field in _given(("sasl_username", "sasl_password", "ssl_key_password"))},
    }
    if VARIABLES["ingestion"] in os.environ:  # set empty: no ingestion topics
        kafka["ingestion"] = _ingestion()
    lake = {**_given(("root",)), "vacuum_retention_hours": _retention_hours(),
            **{field: _number(field, "") for field in _given(("state_file_rows",))}}
    spark = {"master": _master(), "conf": _settings("conf", secrets_refused=True),
             **{field: _number(field, "") for field in _given(("driver_rows",))}}
    slicing = {
        "min_interval_seconds": _number("min_interval_seconds", "900", float),
        "max_messages": _number("max_messages", "5000000"),
        "max_messages_per_task": _number("max_messages_per_task", "200000"),
        "dedupe_window_slices": _number("dedupe_window_slices", "4"),
        "parts_wait_slices": _number("parts_wait_slices", "96"),
        "schema_wait_slices": _number("schema_wait_slices", "4"),
        "offsets_went_back": _env("offsets_went_back", "report"),
    }
    retries()  # read when a step fails; a value that is no count is refused here, at the load
    _librdkafka_takes(kafka)
    return {name: _resource(cls, settings) for name, cls, settings in (
        ("spark", SparkResource, spark), ("kafka", KafkaResource, kafka), ("lake", LakeResource, lake),
        ("slicing", SlicingResource, slicing))}


def drifted(resource) -> list[str]:
    """The fields of `resource` (a run's) whose value is not the one their variable, set, gives."""
    name, deployed = next((name, r) for name, r in build_resources().items() if type(r) is type(resource))
    out = []
    for field, variable in [*VARIABLES.items(), ("publish", VARIABLES["published_streams"])]:
        if field not in type(resource).model_fields or not os.environ.get(variable, "").strip():
            continue
        given, value = (v.get_value() if isinstance(v, EnvVar) else v for v in (getattr(deployed, field),
                                                                               getattr(resource, field)))
        if value != given:
            shown = "(a secret)" if isinstance(getattr(deployed, field), EnvVar) else repr(value)[:80]
            out.append(f"{name}.{field} is {shown}, where {variable} sets it")
    return out


def _resource(cls, settings: dict):
    """The resource; a value it refuses is said on one line, naming its variable."""
    try:
        return cls(**settings)
    except ValidationError as exc:
        def variable(error) -> str:
            field = str(error["loc"][0]) if error["loc"] else ""
            if field not in VARIABLES:
                return field or cls.__name__
            return f"{VARIABLES[field]}={os.environ.get(VARIABLES[field], '')!r}" if field in ECHOED else VARIABLES[field]

        said = "; ".join(f"{variable(e)}: {e['msg']}" for e in exc.errors())
        raise SettingError(said) from None


def with_source(step):
    """The step's asset specs pointing at its own function, for the UI's link to the code: Dagster's
    `with_source_code_references` would name the file of the retry wrapper around it
    (`assets.retries`). A deployment links them to its repository with `link_code_references_to_git`."""
    fn = inspect.unwrap(step.op.compute_fn.decorated_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BetaWarning)  # the UI has shown them since 1.7
        source = CodeReferencesMetadataValue(code_references=[LocalFileCodeReference(
            file_path=inspect.getsourcefile(fn), line_number=inspect.getsourcelines(fn)[1])])
    return step.map_asset_specs(lambda spec: spec.merge_attributes(metadata={"dagster/code_references": source}))


OWNERS_VARIABLE = "ENTITY_ASSETS_OWNERS"


def with_owners(spec: AssetSpec) -> AssetSpec:
    """The asset owned by `ENTITY_ASSETS_OWNERS` (emails and `team:` names, comma-separated), whom
    the UI's catalog shows and finds it by; the topics are their producers' and consumers'."""
    owners = list(dict.fromkeys(name.strip() for name in os.environ.get(OWNERS_VARIABLE, "").split(",") if name.strip()))
    try:
        return spec.merge_attributes(owners=owners)
    except DagsterInvalidDefinitionError as exc:
        raise SettingError(f"{OWNERS_VARIABLE}={os.environ[OWNERS_VARIABLE]!r}: {exc.args[0].split(' for asset ')[0]}; "
                           "an owner is an email address or a team name prefixed with 'team:'") from None


STEPS = [ingest, entity_patches, apply_patches, learn_schemas, devices, zone_changes, changes_by_device,
         device_notifications]


def build_assets() -> list:
    """The steps' assets with their columns, code and owners, and the Kafka topics."""
    return [*map_asset_specs(lambda spec: with_owners(with_columns(spec)), [with_source(step) for step in STEPS]),
            *topics.SPECS]


defs = Definitions(
    assets=build_assets(),
    jobs=[slice_job, lake_maintenance, trace_job, history_job],
    schedules=[lake_maintenance_schedule],
    sensors=[kafka_offsets_sensor],
    resources=build_resources(),
    # In-process: all steps of a run share one SparkSession (one JVM start per run, not per step),
    # also in the runs that the UI's Materialize and asset backfills launch (Dagster's asset job).
    executor=in_process_executor,
)
