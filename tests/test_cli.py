"""`entity-assets run` as a deployment runs it, in a process of its own configured by the environment.

Small slices run in the driver (no Spark session), so each command is a few seconds.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
from dagster import DagsterInstance

from entity_assets import cli, history, samples
from entity_assets.kafka_io import ensure_topics
from entity_assets.manifests import ManifestStore
from entity_assets.slices import slice_key
from entity_assets.tables import SCHEMAS
from entity_assets.trace import parse_record
from resources import KafkaResource, LakeResource, SettingError, SlicingResource


def test_run_materializes_closed_slices_again_in_order_to_rebuild_deleted_tables(make_pipeline, lake_rows, tmp_path,
                                                                                  monkeypatch, capsys):
    topics = make_pipeline()  # the test's own input topics on the session's broker
    topics.produce(samples.GraphTraffic(samples.BatchTraffic(patches=160, entities=40, learning=True),
                                        devices=4).records())
    lake = LakeResource(root=str(tmp_path / "lake"))
    env = {**{k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"},
           "ENTITY_ASSETS_HOME": str(tmp_path / "home"), "ENTITY_ASSETS_LAKE": lake.root,
           "ENTITY_ASSETS_KAFKA_BOOTSTRAP": topics.kafka.bootstrap_servers, "ENTITY_ASSETS_TOPIC_PREFIX": topics.prefix,
           "ENTITY_ASSETS_SLICE_INTERVAL_SECONDS": "0", "ENTITY_ASSETS_SLICE_MAX_MESSAGES": "100"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(Path(sys.executable).parent / "entity-assets"), "run", *args], env=env,
                              capture_output=True, text=True, timeout=600)

    done = run()
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    slices = done.stdout.count(": ok in ")
    assert slices >= 2
    assert f"lag: 0 messages on the input topics past slice {slice_key(slices)}" in done.stdout
    built = lake_rows(lake)

    # an upgrade's rebuild: tables deleted, then materialized again from the first slice, states
    # among them, apply_patches' three together (docs/operations.md)
    for table in ("zone_changes", "devices", "entities", "schemas", "pending_responses"):
        shutil.rmtree(Path(lake.root) / table)
    again = run("--slices", f"1..{slices}", "--assets", "zone_changes,devices,entities")
    assert again.returncode == 0 and again.stdout.count(": ok in ") == slices, again.stdout[-3000:] + again.stderr[-3000:]
    assert "entity_patches=" not in again.stdout  # only the chosen assets' steps ran
    assert lake_rows(lake) == built

    # refusals, in this process: nothing runs
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home" / "dagster"))
    for args, says in ((("--slices", f"1..{slices + 1}"), f"the sensor has closed slices 1..{slices}"),
                       (("--slices", "1", "--assets", "zone_change"), "no asset zone_change"),
                       (("--assets", "devices"), "--assets needs --slices"),
                       (("--republish",), "--republish needs --slices"),
                       (("--slices", "first"), "give slice numbers"),
                       (("--slices", "2..1"), "the first comes after the last"),
                       (("--slices", "1", "--assets", ""), "no asset named"),
                       (("--slices", "1", "--max-messages", "5"), "--max-messages cuts new slices")):
        assert cli.main(["run", *args]) == 2
        assert says in capsys.readouterr().err, args
    with DagsterInstance.get() as instance:  # each run tagged with its slice's size, as the sensor's are
        sizes = {r.tags["dagster/partition"]: r.tags.get("entity-assets/messages") for r in instance.get_runs()}
    manifests = ManifestStore(lake.open()).get_many(range(1, slices + 1))
    assert sizes == {slice_key(s): str(m.messages) for s, m in manifests.items()}

    # trace: an input record's rows, by the stream's name for its topic
    record = lake.open().read("entity_batches").to_pylist()[0]
    assert cli.main(["trace", f"entity-batches:{record['kafka_partition']}:{record['kafka_offset']}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{record['kafka_topic']}:{record['kafka_partition']}:{record['kafka_offset']}: "
                          f"slice {record['slice']}")
    assert f"entity_batches        clientid={record['clientid']} request={record['request']}" in out
    assert "entity_updates" in out and "partial_responses" in out and "entities              now: collection=" in out
    assert cli.main(["trace", f"entity-batches:{record['kafka_partition']}:{10 ** 9}"]) == 1
    assert "in no slice (the sensor has not closed one over this offset yet" in capsys.readouterr().out
    assert cli.main(["trace", "entity-batches:0"]) == 2
    assert "is not TOPIC:PARTITION:OFFSET" in capsys.readouterr().err
    # the demo's hint: a record that reached devices, whose trail ends at their inboxes
    hint = cli._a_notifying_record()
    assert cli.main(["trace", hint]) == 0
    assert "device_notifications  device=" in capsys.readouterr().out

    # changes: a state's rows that later slices changed, as JSON lines
    assert cli.main(["changes", "entities"]) == 0
    out = capsys.readouterr()
    every = [json.loads(line) for line in out.out.splitlines()]
    assert len(every) == len(built["entities"]) and "bucket" not in every[0]
    # where to go on from: the slice of the snapshot read
    assert out.err == f"changes of entities as of slice {slice_key(slices)}: next, --since {slices}\n"
    assert cli.main(["changes", "entities", "--since", str(slices - 1)]) == 0
    late = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert late and sorted(map(json.dumps, late)) == sorted(
        json.dumps(r) for r in every if r["slice"] > slice_key(slices - 1))
    assert cli.main(["changes", "entities", "--since", "last"]) == 2
    assert "entity-assets changes: --since last: give a slice number" in capsys.readouterr().err

    # history: an entity's versions replayed from entity_updates, and its document as of a slice
    entity = max((r for r in every if not r["deleted"]), key=lambda r: r["version"])
    key = [entity[c] for c in ("dbid", "collection", "zone", "entity")]
    assert cli.main(["history", *key, "--json"]) == 0
    versions = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [v["version"] for v in versions] == list(range(1, entity["version"] + 1)) and entity["version"] > 1
    assert versions[-1]["document"] == json.loads(entity["document"])
    assert cli.main(["history", *key]) == 0
    assert capsys.readouterr().out.startswith(f"v1  slice {versions[0]['slice']}  valid {versions[0]['valid_from']}..")
    assert cli.main(["history", *key, "--slice", str(slices)]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(entity["document"])
    assert cli.main(["history", *key, "--at", str(versions[0]["valid_from"] - 1)]) == 1
    assert capsys.readouterr().err.startswith(  # the entity is there, only not yet then
        f"entity-assets history: no version at {versions[0]['valid_from'] - 1} (the first: v1, slice ")
    assert cli.main(["history", *key[:3], "no-such-entity"]) == 1
    assert "history: no version of " in capsys.readouterr().err
    # the demo's hint: the entity of the most versions
    hint = cli._an_entity_of_many_versions().split(" ")
    assert cli.main(["history", *hint]) == 0
    assert len(capsys.readouterr().out.splitlines()) == max(r["version"] for r in every)
    # a history that does not replay (an update missing from entity_updates) is an error message, not a traceback

    def incomplete(*_):
        raise history.Diverged("update c/2/1 of slice 0000000001 gives status 2")

    monkeypatch.setattr(history, "entity_history", incomplete)
    with pytest.raises(SystemExit, match="entity-assets history: update c/2/1"):
        cli.main(["history", *key])

    # a lake restored from a backup behind its runs: `run` closes the slices after it again, and
    # runs them, although runs of those slice keys succeeded before the restore
    backup = tmp_path / "backup"
    shutil.copytree(lake.root, backup)
    lost = list(samples.BatchTraffic(patches=20, entities=8, seed=5).records())
    topics.produce(lost)
    assert run().stdout.count(": ok in ") >= 1
    shutil.rmtree(lake.root)
    shutil.copytree(backup, lake.root)
    later = list(samples.BatchTraffic(patches=12, entities=8, seed=6).records())
    topics.produce(later)
    restored = run()
    assert restored.returncode == 0 and f"slice {slice_key(slices + 1)}: ok in " in restored.stdout, restored.stdout
    rows = lake.open().read("entity_batches", columns=["slice"])["slice"].to_pylist()
    assert sum(s > slice_key(slices) for s in rows) == len(lost) + len(later)

    # a lake with no slice under an instance that ran some is another lake (a root mistyped):
    # refused, not read from the first offsets and published again
    shutil.rmtree(lake.root)
    refused = run()
    assert refused.returncode == 2 and f"the lake at {lake.root} has no slice, but this Dagster instance ran " \
        in refused.stderr and not Path(lake.root, "entity_batches").exists(), refused.stderr


def test_topics_creates_what_the_cluster_lacks_with_each_topics_settings(broker, monkeypatch, tmp_path, capsys):
    """`entity-assets topics`: a dry run creates nothing; then the input topics get the given
    partitions and settings, each output topic its stream's settings; a second run finds them all."""
    from confluent_kafka.admin import AdminClient, ConfigResource

    from entity_assets.ingest import INPUT_STREAMS
    from entity_assets.kafka_io import partition_counts
    from resources.kafka import DERIVED_STREAMS

    prefix = "cli-topics."
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", broker.bootstrap)
    monkeypatch.setenv("ENTITY_ASSETS_TOPIC_PREFIX", prefix)
    monkeypatch.setenv("ENTITY_ASSETS_NEW_TOPIC_CONFIG", "retention.ms=86400000")
    monkeypatch.setenv("ENTITY_ASSETS_STREAM_TOPIC_CONFIG", '{"device-notifications": {"cleanup.policy": "delete"}}')
    config = {"bootstrap.servers": broker.bootstrap}
    topics = [prefix + s for s in [*INPUT_STREAMS, *DERIVED_STREAMS]]

    assert cli.main(["topics", "--dry-run"]) == 0
    planned = capsys.readouterr().out
    assert planned.count("would be created") == len(topics) and partition_counts(config, topics) == {}
    assert planned.count("would be created: 4 partitions, the cluster's default replicas, ") == len(topics)
    # the seed's durability of a derived stream ("time-based compacted"), under the settings given
    compacted = f"{prefix}entity-updates".ljust(40) + " output would be created: 4 partitions, the cluster's " \
        "default replicas, cleanup.policy=compact,min.compaction.lag.ms=604800000,retention.ms=86400000"
    assert compacted in planned.splitlines()
    assert "cleanup.policy=delete,min.compaction.lag.ms=604800000,retention.ms=86400000" in planned

    assert cli.main(["topics", "--partitions", "3", "--input-config", "retention.ms=-1"]) == 0
    assert capsys.readouterr().out.count("created: ") == len(topics)
    counts = partition_counts(config, topics)
    assert {counts[prefix + s] for s in INPUT_STREAMS} == {3} and {counts[prefix + s] for s in DERIVED_STREAMS} == {4}
    admin = AdminClient(config)  # held: a collected client cancels its futures
    for stream, settings in (("entity-batches", {"retention.ms": "-1"}),
                             ("entity-updates", {"retention.ms": "86400000", "cleanup.policy": "compact",
                                                 "min.compaction.lag.ms": "604800000"}),
                             ("device-notifications", {"retention.ms": "86400000", "cleanup.policy": "delete"})):
        resource = ConfigResource("topic", prefix + stream)
        described = admin.describe_configs([resource])[resource].result(30)
        assert {k: described[k].value for k in settings} == settings, stream

    assert cli.main(["topics"]) == 0
    again = capsys.readouterr().out
    assert again.count("exists, ") == len(topics) and "created" not in again


def test_commands_give_librdkafka_the_sasl_credentials_not_the_names_of_their_variables(monkeypatch):
    """`topics`, `produce` and `broker start` use the Kafka resource outside a run, where Dagster
    does not resolve its `EnvVar`s: `cli.kafka_resource` must."""
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("KAFKA_SASL_USERNAME", "pipeline")
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", "s3cret")
    monkeypatch.setenv("KAFKA_SSL_KEY_PASSWORD", "k3y")
    monkeypatch.setenv("KAFKA_KEYSTORE_PASSWORD", "st0re")
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV", "ssl.keystore.password=KAFKA_KEYSTORE_PASSWORD")
    # settings that name a secret's provider, endpoint or file are no secrets
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "sasl.oauthbearer.token.endpoint.url=https://idp/token, "
                                                            "ssl.keystore.location=/etc/kafka/client.p12")
    monkeypatch.setenv("ENTITY_ASSETS_SPARK_CONF", "spark.hadoop.fs.s3a.aws.credentials.provider=x.Provider, "
                                                   "spark.hadoop.fs.azure.sas.token.provider.type=y.Provider, "
                                                   "spark.hadoop.fs.azure.sas.token.renew.period.for.streams=120, "
                                                   "spark.hadoop.fs.azure.account.keyprovider.acct.blob.core.windows.net="
                                                   "z.Provider, "
                                                   "spark.hadoop.fs.s3a.access.key=AKIA, spark.executorEnv.AWS_REGION=r")
    config = cli.kafka_resource().config()
    assert config["ssl.keystore.password"] == "st0re" and config["ssl.keystore.location"] == "/etc/kafka/client.p12"
    assert {k: config[k] for k in ("security.protocol", "sasl.mechanism", "sasl.username", "sasl.password",
                                   "ssl.key.password")} == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "pipeline",
        "sasl.password": "s3cret", "ssl.key.password": "k3y"}
    # the code location's snapshot, which the UI shows and the instance stores, names the variables only
    from dagster._core.remote_representation.external_data import RepositorySnap

    from entity_assets.definitions import Definitions, build_resources

    defs = Definitions(resources={"kafka": build_resources()["kafka"]})
    snap = str(RepositorySnap.from_def(defs.get_repository_def()))
    assert "s3cret" not in snap and "k3y" not in snap and "st0re" not in snap and "KAFKA_SSL_KEY_PASSWORD" in snap


def test_a_command_without_an_answer_from_kafka_fails_fast_naming_the_servers(monkeypatch, tmp_path, capfd):
    """A producer would wait minutes for a broker that is not there: `produce` asks for the
    metadata first, and the error is a line, not a traceback."""
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))  # main would set it for good otherwise
    assert cli.main(["produce", "seed"]) == 1
    err = capfd.readouterr().err  # librdkafka writes to the file descriptor itself
    assert err.startswith("entity-assets produce: Kafka at 127.0.0.1:1 gave no metadata")
    # the cause librdkafka logged, once, not a line per reconnect on stderr
    assert "Connection refused" in err and err.count("\n") == 1


def test_an_empty_dagster_home_gets_the_project_homes(monkeypatch, tmp_path):
    """Dagster takes DAGSTER_HOME set and empty for unset, and would refuse to start."""
    monkeypatch.setenv("DAGSTER_HOME", "")
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # restored after the test, as DAGSTER_HOME
    cli.prepare_environment()
    assert os.environ["DAGSTER_HOME"] == str(tmp_path / "dagster")
    assert (tmp_path / "dagster" / "dagster.yaml").exists()


def test_a_secret_s_variable_may_have_the_project_s_prefix(monkeypatch):
    """Unknown `ENTITY_ASSETS_…` variables are refused, but not one that holds a secret named in
    ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV: its name is the user's choice."""
    from entity_assets.definitions import build_resources

    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV", "sasl.password=ENTITY_ASSETS_KAFKA_PASSWORD")
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_PASSWORD", "s3cret")
    assert build_resources()["kafka"].client_secret_env == {"sasl.password": "ENTITY_ASSETS_KAFKA_PASSWORD"}


def test_the_project_home_s_instance_config_is_the_repository_s_unless_the_user_made_it_theirs(
        monkeypatch, tmp_path, capsys):
    """Each command copies the repository's dagster.yaml into the project home's instance, so an
    upgrade's settings reach it; a Postgres storage written there once went at the next command."""
    config = tmp_path / "dagster" / "dagster.yaml"
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", "127.0.0.1:1")

    def prepare() -> str:
        monkeypatch.setenv("DAGSTER_HOME", "")
        cli.prepare_environment()
        return config.read_text()

    repository = (cli.REPO / "dagster.yaml").read_text()
    assert prepare() == f"{cli.COPIED}\n{repository}"
    config.write_text(f"{cli.COPIED}\nstorage: {{}}\n")  # edited below the line that says it is replaced
    assert prepare() == f"{cli.COPIED}\n{repository}"
    config.write_text("storage:\n  postgres: {}\n")  # the user's own
    assert prepare() == "storage:\n  postgres: {}\n"
    assert "is not the copy of" in capsys.readouterr().err
    config.write_text(repository.replace("# Dagster instance", "# An older comment.\n# Dagster instance"))
    assert prepare() == f"{cli.COPIED}\n{repository}" and not capsys.readouterr().err  # an older release's copy
    # every released copy, before copies said so on their first line (in a clone with that history)
    commits = subprocess.run(["git", "log", "--format=%H", "--", "dagster.yaml"], cwd=cli.REPO, capture_output=True,
                             text=True).stdout.split()
    for commit in commits:
        released = subprocess.run(["git", "show", f"{commit}:dagster.yaml"], cwd=cli.REPO, capture_output=True,
                                  text=True).stdout
        if released and not released.startswith(cli.COPIED):
            config.write_text(released)
            assert prepare() == f"{cli.COPIED}\n{repository}" and not capsys.readouterr().err, commit


def test_produce_file_checks_the_whole_file_and_its_topics_before_it_produces(broker, monkeypatch, tmp_path, capsys):
    """A bad line, a missing file or a topic the cluster lacks is said on one line, status 2, and
    nothing is produced: a broker that creates topics on first use would make a misspelt one."""
    from entity_assets.kafka_io import partition_counts

    prefix = "cli-file."
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", broker.bootstrap)
    monkeypatch.setenv("ENTITY_ASSETS_TOPIC_PREFIX", prefix)
    config = {"bootstrap.servers": broker.bootstrap}
    assert cli.main(["topics"]) == 0
    capsys.readouterr()
    good = json.dumps({"topic": "connections", "key": "jsmith", "value": samples.SEED_CONNECTION})
    path = tmp_path / "records.jsonl"
    for lines, said in ([good, '{"topic": "connections", "key": "k"}'], f"{path}:2: no 'value'"), \
                       ([good, "{not json"], f"{path}:2: "), \
                       ([good, good.replace('"connections"', '"conections"')],
                        f"{path}:2: conections is neither an input stream"), \
                       ([good, good.replace('"connections"', '"entity-updates"')],  # a derived stream's apps' input
                        f"{path}:2: entity-updates is neither an input stream"), \
                       ([good, "[1, 2]"], f"{path}:2: a JSON list, not an object"), \
                       ([good, good.replace('"jsmith"', "NaN")], f"{path}:2: NaN is no JSON value"), \
                       ([good, good.replace('"jsmith"', "1e999")], f"{path}:2: 1e999 is beyond a double"), \
                       (["", "  "], f"{path}: no record"):
        path.write_text("\n".join(lines) + "\n")
        assert cli.main(["produce", "file", str(path)]) == 2
        assert capsys.readouterr().err.startswith(f"entity-assets produce: {said}")
    assert partition_counts(config, [f"{prefix}conections"]) == {}
    assert cli.main(["produce", "file", str(tmp_path / "missing.jsonl")]) == 2
    assert "No such file or directory" in capsys.readouterr().err
    assert cli.main(["produce", "file"]) == 2
    # the samples need the input topics too: under a new prefix a broker would create them with its defaults
    monkeypatch.setenv("ENTITY_ASSETS_TOPIC_PREFIX", f"new-{prefix}")
    assert cli.main(["produce", "sample", "--patches", "5"]) == 2
    assert f"no topic new-{prefix}connections, new-{prefix}entity-batches" in capsys.readouterr().err
    assert partition_counts(config, [f"new-{prefix}entity-batches"]) == {}
    monkeypatch.setenv("ENTITY_ASSETS_TOPIC_PREFIX", prefix)
    path.write_text(good + "\n")
    assert cli.main(["produce", "file", str(path)]) == 0
    assert capsys.readouterr().out == "produced 1 to connections\n"
    # a topic named with its prefix, as `trace` takes it too, is that topic
    path.write_text(good.replace('"connections"', f'"{prefix}connections"') + "\n")
    assert cli.main(["produce", "file", str(path)]) == 0
    assert partition_counts(config, [f"{prefix}{prefix}connections"]) == {}
    topic_named = cli.kafka_resource().topic_named
    assert parse_record(f"{prefix}connections:0:1", topic_named) == parse_record("connections:0:1", topic_named) \
        == (f"{prefix}connections", 0, 1)


def test_produce_sample_is_new_traffic_each_time_unless_its_seed_is_given(broker, monkeypatch, tmp_path, capsys):
    """The demo's traffic and a later `produce sample` of the same seed share request ids, which the
    dedupe window drops as redeliveries: a sample's default seed is a new one, printed."""
    prefix = "cli-seed."
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", broker.bootstrap)
    monkeypatch.setenv("ENTITY_ASSETS_TOPIC_PREFIX", prefix)
    assert cli.main(["topics"]) == 0
    capsys.readouterr()
    seeds = []
    for _ in range(2):
        assert cli.main(["produce", "sample", "--patches", "3", "--entities", "3"]) == 0
        said, produced = capsys.readouterr().out.splitlines()
        seeds.append(int(re.fullmatch(r"seed (\d+) \(--seed \1 produces these records again\)", said)[1]))
        assert produced == "produced 3 to entity-batches"
    assert seeds[0] != seeds[1] and seeds[0] != samples.BatchTraffic.seed
    assert cli.main(["produce", "sample", "--patches", "3", "--entities", "3", "--seed", "7"]) == 0
    assert capsys.readouterr().out == "produced 3 to entity-batches\n"


def test_produce_file_writes_keys_and_values_that_are_no_strings_as_json_and_a_null_value_as_a_tombstone(tmp_path):
    """A CDC topic's keys are objects (Debezium's `{"ID": 1}`), and a delete is followed by a tombstone."""
    path = tmp_path / "cdc.jsonl"
    path.write_text('{"topic": "crm.customers.ingestion", "key": {"ID": 1}, "value": {"op": "d"}}\n'
                    '{"topic": "crm.customers.ingestion", "key": 7, "value": null}\n'
                    '{"topic": "connections", "key": "jsmith", "value": "{}"}\n')
    assert list(cli._file_records(str(path))) == [("crm.customers.ingestion", '{"ID": 1}', b'{"op": "d"}'),
                                                  ("crm.customers.ingestion", "7", None),
                                                  ("connections", "jsmith", b"{}")]


@pytest.mark.parametrize("content, said", [
    (b'{"topic": "connections", "key": "k", "value": "\xe9"}\n', "not UTF-8 text"),  # Latin-1
    (b'{"topic": ["connections"], "key": "k", "value": "{}"}\n', ':1: topic is ["connections"], not a name'),
    (b'{"topic": 7, "key": "k", "value": "{}"}\n', ":1: topic is 7, not a name"),
])
def test_produce_file_says_a_file_it_cannot_read_on_a_line(content, said, tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_bytes(content)
    with pytest.raises(cli.UsageError, match=re.escape(said)):
        list(cli._file_records(str(path)))


def _slices_of_a_lake(monkeypatch, tmp_path, runs: dict[int, str], holds: int) -> tuple[list, list]:
    """`run` over a lake of five closed slices, whose state holds `holds`, and an instance whose
    successful runs are `runs`: the slices it runs, and what it says."""
    from dagster import SensorResult, SkipReason

    from entity_assets import definitions, manifests, sensors

    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    (tmp_path / "dagster").mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))

    class Store:
        def __init__(self, engine):
            self.engine = engine

        def latest(self):
            return None

        def closed_at(self):
            return {1: 10, 2: 20, 3: 30, 4: 40, 5: 50}

    def sensor(context):
        return SensorResult(skip_reason=SkipReason("nothing pending"))

    sensor.name = definitions.kafka_offsets_sensor.name
    monkeypatch.setattr(sensors, "kafka_offsets_sensor", sensor)
    monkeypatch.setattr(manifests, "ManifestStore", Store)
    monkeypatch.setattr(sensors, "slice_runs", lambda instance, closed: runs)
    monkeypatch.setattr(sensors, "lake_holds", lambda engine, tables=(), newest=max: holds)
    asked, said = [], []
    monkeypatch.setattr(cli, "_materialize", lambda instance, store, runs, selection, log: asked.extend(runs) or [])
    assert cli.run_pending(log=said.append) == []
    return [key for key, _ in asked], said


def test_run_on_a_new_instance_takes_the_slices_the_lake_holds_as_done(monkeypatch, tmp_path):
    """From SQLite to Postgres, or a new DAGSTER_HOME: not every slice the lake holds again."""
    asked, said = _slices_of_a_lake(monkeypatch, tmp_path, runs={}, holds=3)
    assert asked == [slice_key(4), slice_key(5)]
    assert any("holds slices up to 0000000003: taken as done" in line for line in said), said


def test_run_leaves_a_slice_without_a_successful_run_that_slices_after_it_passed(monkeypatch, tmp_path):
    """A run that failed after its last commit (killed, cancelled at its end) leaves a slice the
    state holds and the slices after it applied: the sensor leaves it be, and so does `run`,
    which would otherwise replay it first at every call, or fail for good once the vacuum took
    the state before it, and run no new slice."""
    # 1 failed at its end; 4 failed midway; 5 waits
    asked, said = _slices_of_a_lake(monkeypatch, tmp_path, runs={2: "r2", 3: "r3"}, holds=3)
    assert asked == [slice_key(4), slice_key(5)]
    assert any(line.startswith("warning: 1 slice(s) without a successful run before slice 0000000003")
               and slice_key(1) in line for line in said)


def test_run_s_lag_report_gives_librdkafka_the_sasl_credentials_not_the_names_of_their_variables(monkeypatch):
    from entity_assets import kafka_io
    from entity_assets.definitions import build_resources

    monkeypatch.setenv("KAFKA_SASL_USERNAME", "pipeline")
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", "s3cret")
    asked, said = [], []

    def watermarks(config, topics, timeout, unanswered=None, expected=()):
        asked.append(config)
        raise kafka_io.KafkaUnreachable("no answer")

    monkeypatch.setattr(kafka_io, "watermarks", watermarks)
    cli._report_lag(None, build_resources(), said.append)
    assert (asked[0]["sasl.username"], asked[0]["sasl.password"]) == ("pipeline", "s3cret")
    assert said == ["warning: lag not reported: no answer"]


def test_a_kafka_client_setting_librdkafka_refuses_is_a_line_and_status_2(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SSL")  # a CA file the client reads as it is made
    monkeypatch.setenv("KAFKA_SSL_CA_LOCATION", str(tmp_path / "missing-ca.pem"))
    assert cli.main(["topics", "--dry-run"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("entity-assets topics: a Kafka client setting is not valid: ") and "ssl.ca.location" in err
    assert err.count("\n") == 1


def test_what_the_cluster_refuses_is_a_line_and_status_1(monkeypatch, tmp_path, capsys):
    """A topic setting the broker refuses (`topics --input-config retention.ms=abc`), or a right
    the client lacks."""
    from confluent_kafka import KafkaError, KafkaException

    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))

    def refused(args):
        raise KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "Topic authorization failed"))

    monkeypatch.setattr(cli, "cmd_summary", refused)
    assert cli.main(["summary"]) == 1
    assert capsys.readouterr().err == ("entity-assets summary: Kafka refused: TOPIC_AUTHORIZATION_FAILED: "
                                       "Topic authorization failed\n")


def test_records_the_cluster_refuses_are_a_line_and_status_1(broker, monkeypatch, tmp_path, capsys):
    """A record over the producer's limit (4,000,000 bytes), which librdkafka refuses itself."""
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", broker.bootstrap)
    monkeypatch.setenv("ENTITY_ASSETS_TOPIC_PREFIX", "cli-refused.")
    ensure_topics({"bootstrap.servers": broker.bootstrap}, ["cli-refused.entity-batches"], 1)
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"topic": "entity-batches", "key": "k", "value": "x" * 5_000_000}) + "\n")
    assert cli.main(["produce", "file", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("entity-assets produce: Kafka refused: ") and "MSG_SIZE_TOO_LARGE" in err, err
    assert "Traceback" not in err


def test_a_lake_on_a_store_it_cannot_reach_is_a_line_and_status_1(monkeypatch, tmp_path, capsys):
    """delta-rs's error is a coloured tree of lines: the first says what failed, the last why."""
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))

    def unreachable(args):
        raise OSError("Kernel error -> Generic S3 error\n  \x1b[31m↳\x1b[0m Error performing GET http://x/\n"
                      "   \x1b[31m↳\x1b[0m Connection refused (os error 111)\n")

    monkeypatch.setattr(cli, "cmd_summary", unreachable)
    assert cli.main(["summary"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("entity-assets summary: Kernel error -> Generic S3 error: Connection refused (os error 111) "
                          "(the lake: ENTITY_ASSETS_LAKE") and err.count("\n") == 1


@pytest.mark.parametrize("command", [["summary"], ["trace", "entity-batches:0:17"], ["changes", "entities"],
                                     ["history", "db", "c", "z", "e"], ["run", "--slices", "1"]])
def test_a_lake_that_holds_no_slice_is_said_not_read_as_an_empty_one(monkeypatch, tmp_path, capsys, command):
    """A mistyped ENTITY_ASSETS_LAKE read as an empty lake (a summary of no table, status 0), and
    `run --slices` made a manifests table there."""
    lake = tmp_path / "no-such-lake"
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("ENTITY_ASSETS_LAKE", str(lake))
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    assert cli.main(command) == 1
    err = capsys.readouterr().err
    assert f"no lake at {lake}: it holds no slice" in err and "ENTITY_ASSETS_LAKE" in err, err
    assert not lake.exists()


def test_a_delta_log_delta_rs_cannot_read_is_a_line_and_status_1(monkeypatch, tmp_path, capsys):
    from deltalake.exceptions import DeltaError

    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))

    def damaged(args):
        raise DeltaError("Failed to parse commit 00000000000000000000.json: EOF while parsing")

    monkeypatch.setattr(cli, "cmd_summary", damaged)
    assert cli.main(["summary"]) == 1
    assert capsys.readouterr().err == ("entity-assets summary: the lake's Delta log: Failed to parse commit "
                                       "00000000000000000000.json: EOF while parsing\n")


def test_output_to_a_reader_that_ended_is_status_141_and_no_message(monkeypatch, tmp_path, capfd):
    """`entity-assets changes entities | head`: the pipe's reader is gone, and so is anyone to tell."""
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))

    def piped(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_summary", piped)
    assert cli.main(["summary"]) == 141
    assert capfd.readouterr().err == ""


def test_the_demo_and_broker_start_stay_on_the_embedded_broker_and_the_home_s_lake(monkeypatch, tmp_path, capsys):
    """A cluster's settings left in the shell would take the demo's sample traffic."""
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", "prod-kafka-1:9093")
    for argv in (["broker", "start"], ["demo"]):
        assert cli.main(argv) == 2
        assert "the Kafka settings name prod-kafka-1:9093, not the embedded broker" in capsys.readouterr().err
    monkeypatch.delenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP")
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "bootstrap.servers=prod-kafka-2:9093")
    assert cli.main(["broker", "start"]) == 2
    assert "the Kafka settings name prod-kafka-2:9093" in capsys.readouterr().err
    monkeypatch.delenv("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG")
    monkeypatch.setenv("ENTITY_ASSETS_LAKE", "s3://prod/lake")
    assert cli.main(["demo"]) == 2
    assert "ENTITY_ASSETS_LAKE names s3://prod/lake" in capsys.readouterr().err
    assert not (tmp_path / "broker" / "broker.pid").exists()  # nothing started


def test_run_with_a_dagster_home_that_is_no_folder_is_a_line_and_status_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "nowhere"))
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err
    assert "entity-assets run: " in err and "nowhere" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["topics", "--partitions", "-2"], ["run", "--max-messages", "0"],
                                  ["demo", "--partitions", "0"]])
def test_a_count_below_1_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2 and "is not a count of 1 or more" in capsys.readouterr().err


def test_an_interrupted_command_is_a_line_and_status_130(monkeypatch, tmp_path, capsys):
    """The UI's Terminate of a run of `run` interrupts its process, as Ctrl-C does, maybe between runs."""
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_summary", interrupted)
    assert cli.main(["summary"]) == 130
    assert capsys.readouterr().err == "entity-assets summary: interrupted\n"


@pytest.mark.parametrize("argv, said", [
    (["topics", "--dry-run", "--input-config", "foo"], "--input-config foo: give KEY=VALUE"),
    (["run", "--slices", "1.."], "--slices 1..: give slice numbers"),
    (["run", "--slices", "\u00b2"], "give slice numbers"),  # a digit to str.isdigit, not to int()
    (["changes", "entities", "--since", "\u00b2"], "give a slice number"),
    (["produce", "acks"], "produce acks needs --devices"),
])
def test_arguments_the_user_can_fix_are_a_line_and_status_2(argv, said, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    assert cli.main(argv) == 2
    assert said in capsys.readouterr().err


def test_a_port_from_the_environment_that_is_no_port_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("ENTITY_ASSETS_BROKER_PORT", "29O92")
    with pytest.raises(SystemExit) as exited:
        cli.main(["broker", "status"])
    assert exited.value.code == 2
    assert "'29O92' is not a port (the default comes from ENTITY_ASSETS_BROKER_PORT)" in capsys.readouterr().err


@pytest.mark.parametrize("name, value, said", [
    ("ENTITY_ASSETS_PUBLISH", "partial-respones", "partial-respones"),
    ("ENTITY_ASSETS_SLICE_MAX_MESSAGES", "lots", "ENTITY_ASSETS_SLICE_MAX_MESSAGES='lots' is not an integer"),
    ("ENTITY_ASSETS_STREAM_TOPIC_CONFIG", "{", "ENTITY_ASSETS_STREAM_TOPIC_CONFIG is not JSON"),
    ("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "/etc/kafka/client.pem, ssl.key.location=/k",
     "ENTITY_ASSETS_KAFKA_CLIENT_CONFIG: item 1 is not KEY=VALUE (not repeated"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.ui.enabled=false, =true", "ENTITY_ASSETS_SPARK_CONF: item 2 is not KEY=VALUE"),
    ("ENTITY_ASSETS_NEW_TOPIC_CONFIG", "retention.ms", "ENTITY_ASSETS_NEW_TOPIC_CONFIG: 'retention.ms' is not KEY=VALUE"),
    ("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "ssl.key.password=hunter2",
     "ENTITY_ASSETS_KAFKA_CLIENT_CONFIG: ssl.key.password holds a secret"),
    ("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "sasl.oauthbearer.assertion.private.key.passphrase=hunter2",
     "ENTITY_ASSETS_KAFKA_CLIENT_CONFIG: sasl.oauthbearer.assertion.private.key.passphrase holds a secret"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.hadoop.fs.s3a.secret.key=abc",
     "ENTITY_ASSETS_SPARK_CONF: spark.hadoop.fs.s3a.secret.key holds a secret"),
    ("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "ssl.keystore.location=/k.p12, ssl.keystore.password=hunter2",
     "ssl.keystore.password holds a secret, which the UI would show: name the variable"),
    ("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "sasl.oauthbearer.client.secret=s", "sasl.oauthbearer.client.secret holds"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.hadoop.fs.azure.account.key.acct.blob.core.windows.net=k", "account.key"),
    # executors' variables and the object stores' other secrets
    ("ENTITY_ASSETS_SPARK_CONF", "spark.executorEnv.AWS_REGION=eu-west-1, spark.executorEnv.AWS_SECRET_ACCESS_KEY=k",
     "spark.executorEnv.AWS_SECRET_ACCESS_KEY holds a secret"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.executorEnv.AZURE_STORAGE_SAS_KEY=sv", "AZURE_STORAGE_SAS_KEY holds a secret"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.hadoop.fs.s3a.session.token=t", "fs.s3a.session.token holds a secret"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.hadoop.fs.azure.sas.fixed.token=t", "sas.fixed.token holds a secret"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.hadoop.fs.azure.sas.logs.acct.blob.core.windows.net=t", "logs.acct"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.hadoop.fs.gs.auth.service.account.private.key=k", "private.key holds"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.hadoop.fs.azure.account.oauth2.client.secret.acct.dfs.core.windows.net=s",
     "client.secret.acct.dfs.core.windows.net holds a secret"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.hadoop.fs.s3n.awsSecretAccessKey=k", "awsSecretAccessKey holds a secret"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.executorEnv.AZURE_STORAGE_CONNECTION_STRING=k", "CONNECTION_STRING holds"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.driver.extraJavaOptions=-Xss4m -Dfs.s3a.secret.key=k",
     "spark.driver.extraJavaOptions holds a secret"),
    ("ENTITY_ASSETS_SPARK_CONF", "spark.executorEnv.AZURE_STORAGE_MASTER_KEY=k", "AZURE_STORAGE_MASTER_KEY holds"),
    ("ENTITY_ASSETS_SPARK_MASTER", "sc://spark:15002/;token=abc", "SPARK_CONNECT_AUTHENTICATE_TOKEN"),
    ("ENTITY_ASSETS_STEP_RETRIES", "many", "ENTITY_ASSETS_STEP_RETRIES='many' is not a count of retries"),
    # a cluster's executors would write the default lake, a folder of this host, on their own disks
    ("ENTITY_ASSETS_SPARK_MASTER", "spark://spark-master:7077", "names a cluster, but ENTITY_ASSETS_LAKE is unset"),
    ("ENTITY_ASSETS_SPARK_MASTER", "sc://spark.internal:15002", "names a cluster, but ENTITY_ASSETS_LAKE is unset"),
    ("ENTITY_ASSETS_INGESTION", "crm=qlik,erp=odbc", "ENTITY_ASSETS_INGESTION: system 'erp': format: Input should be"),
    ("ENTITY_ASSETS_INGESTION", '{"crm": {"formt": "qlik"}}', "ENTITY_ASSETS_INGESTION: system 'crm': no setting formt"),
    # values a resource refuses: one line that names the variable, not pydantic's text naming the field
    ("ENTITY_ASSETS_OFFSETS_WENT_BACK", "bogus", "ENTITY_ASSETS_OFFSETS_WENT_BACK='bogus': Input should be 'report'"),
    ("ENTITY_ASSETS_STATE_FILE_ROWS", "0", "ENTITY_ASSETS_STATE_FILE_ROWS='0': Input should be greater than"),
    # the vacuum would delete the files of a slice that `run` writes beside it, not committed yet
    ("ENTITY_ASSETS_VACUUM_RETENTION_HOURS", "0", "ENTITY_ASSETS_VACUUM_RETENTION_HOURS=0: give 1 or more: lake "
                                                  "maintenance deletes files no version names once they are that old"),
    ("ENTITY_ASSETS_KAFKA_COMMIT_OFFSETS", "maybe", "ENTITY_ASSETS_KAFKA_COMMIT_OFFSETS='maybe': Input should be a valid "
                                                     "boolean"),
    ("ENTITY_ASSETS_PUBLISH", "no", "ENTITY_ASSETS_PUBLISH='no': Value error, published_streams: no derived stream"),
    ("ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV", "ssl.keystore.password=EA_UNSET_VARIABLE",
     "client_secret_env: EA_UNSET_VARIABLE not set"),
    # a secret written where its variable's name goes: refused, and not repeated
    ("ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV", "sasl.password=S3cr3t!pa55", "the value of sasl.password is not an "
                                                                          "environment variable's name"),
    # refused by librdkafka at the load, not by each run's producer after its retries
    ("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "acks=1", "librdkafka refuses it: Failed to create producer: `acks` must"),
    ("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "ssl.certificate.locaton=/x", 'No such configuration property: '
                                                                        '"ssl.certificate.locaton"'),
    ("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "error_cb=log", "librdkafka refuses it"),  # a callback's name: no traceback
    # a secret's key misspelt is the secrets' variable's, which the client config's error blamed
    ("ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV", "ssl.keystore.pasword=KAFKA_KEYSTORE_PASSWORD",
     'ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV: librdkafka refuses it: No such configuration property: '
     '"ssl.keystore.pasword"'),
    ("KAFKA_SECURITY_PROTOCOL", "SASL-SSL", "security_protocol 'SASL-SSL': one of PLAINTEXT"),
    ("ENTITY_ASSETS_NEW_TOPIC_PARTITIONS", "0", "new_topic_partitions: 0; give 1 or more"),
    # settings that would be read as something else, and do nothing
    ("ENTITY_ASSETS_LAKE_URI", "s3://bucket/lake", "no setting is named ENTITY_ASSETS_LAKE_URI (is it "
                                                    "ENTITY_ASSETS_LAKE?)"),
    ("ENTITY_ASSETS_LAKE", "s3:/bucket/lake", "root 's3:/bucket/lake' is neither a folder nor a URI"),
    ("ENTITY_ASSETS_INGESTION", "acme.prod.crm=debezium", "source system 'acme.prod.crm' is not one name"),
    ("ENTITY_ASSETS_INGESTION", '{"hr": {"schema_projection": "hr.schemas"}}', "a topic's projection is one name"),
    ("ENTITY_ASSETS_PUBLISH", " , ", "names no stream: set it to false to publish none"),
])
def test_a_setting_from_the_environment_that_is_not_valid_is_a_line_not_a_traceback(name, value, said, monkeypatch,
                                                                                    tmp_path, capsys):
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv(name, value)
    assert cli.main(["topics", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("entity-assets topics: a setting is not valid") and said in err and err.count("\n") == 1


@pytest.mark.parametrize("mechanism, said", [
    ("SCRAM-SHA512", "KAFKA_SASL_MECHANISM='SCRAM-SHA512': librdkafka takes PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, "
                     "OAUTHBEARER, as written"),
    ("plain", "KAFKA_SASL_MECHANISM='plain': librdkafka takes"),
    ("GSSAPI", "KAFKA_SASL_MECHANISM='GSSAPI': librdkafka takes PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER, as "
               "written (this build has no GSSAPI, Kerberos)"),
])
def test_a_sasl_mechanism_librdkafka_lacks_stops_the_load_naming_its_variable(mechanism, said, monkeypatch):
    """librdkafka checks the mechanism as each client is made: every tick and run failed, after
    the run's retries, naming no variable. Without a SASL protocol it reads none."""
    from entity_assets import definitions

    monkeypatch.setattr(definitions, "has_gssapi", lambda: False)  # confluent-kafka's wheels
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KAFKA_SASL_MECHANISM", mechanism)
    with pytest.raises(SettingError) as refused:
        definitions.build_resources()
    assert said in str(refused.value)
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "sasl.mechanisms=OAUTHBEARER")  # the client config's wins
    definitions.build_resources()
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "security.protocol=SSL")
    definitions.build_resources()


def test_a_spark_connect_endpoint_of_another_host_without_tls_is_warned_of(monkeypatch, recwarn):
    """The Spark tasks' closures carry the resolved Kafka and lake secrets; pyspark's channel to
    an endpoint is plaintext unless its URL says use_ssl=true or a token is given."""
    from entity_assets.definitions import build_resources

    monkeypatch.setenv("ENTITY_ASSETS_LAKE", "s3://bucket/lake")
    for master, warned in (("sc://spark.internal:15002", True), ("sc://spark.internal:15002/;use_ssl=true", False),
                           ("sc://127.0.0.1:15002", False), ("spark://spark-master:7077", False)):
        monkeypatch.setenv("ENTITY_ASSETS_SPARK_MASTER", master)
        recwarn.clear()
        build_resources()
        said = [str(w.message) for w in recwarn.list if "Spark Connect" in str(w.message)]
        assert said == ([f"ENTITY_ASSETS_SPARK_MASTER={master!r}: the channel to this Spark Connect endpoint is "
                         "plaintext (add ;use_ssl=true), and the Spark tasks' closures carry the Kafka and lake "
                         "secrets (docs/operations.md, secrets in Spark tasks)"] if warned else []), master
    monkeypatch.setenv("ENTITY_ASSETS_SPARK_MASTER", "sc://spark.internal:15002")
    monkeypatch.setenv("SPARK_CONNECT_AUTHENTICATE_TOKEN", "t")
    recwarn.clear()
    build_resources()
    assert not [w for w in recwarn.list if "Spark Connect" in str(w.message)]


def test_librdkafka_s_default_mechanism_is_taken_only_where_it_has_gssapi(monkeypatch):
    from entity_assets import definitions

    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "security.protocol=sasl_plaintext")
    monkeypatch.setattr(definitions, "has_gssapi", lambda: False)
    with pytest.raises(SettingError, match="^security.protocol in ENTITY_ASSETS_KAFKA_CLIENT_CONFIG=sasl_plaintext "
                                           "needs KAFKA_SASL_MECHANISM .PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, "
                                           "OAUTHBEARER.: librdkafka's default, GSSAPI .Kerberos., is not in this "
                                           "build of it$"):
        definitions.build_resources()
    monkeypatch.setattr(definitions, "has_gssapi", lambda: True)
    definitions.build_resources()


def test_plain_and_scram_need_a_user_name_and_password_from_any_of_their_settings(monkeypatch):
    """librdkafka refuses the client without them; they may come from the client config and the
    secrets' variables too."""
    from entity_assets.definitions import build_resources

    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    needs = "needs a user name and password: set"
    for settings, said in (  # each over those before it
            ({"KAFKA_SASL_MECHANISM": "PLAIN"},
             f"KAFKA_SASL_MECHANISM=PLAIN {needs} KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD"),
            ({"KAFKA_SASL_MECHANISM": "SCRAM-SHA-256", "KAFKA_SASL_USERNAME": "pipeline"},
             f"KAFKA_SASL_MECHANISM=SCRAM-SHA-256 {needs} KAFKA_SASL_PASSWORD"),
            ({"ENTITY_ASSETS_KAFKA_CLIENT_CONFIG": "sasl.username="},  # the client config's wins
             f"KAFKA_SASL_MECHANISM=SCRAM-SHA-256 {needs} sasl.username in ENTITY_ASSETS_KAFKA_CLIENT_CONFIG and "
             "KAFKA_SASL_PASSWORD"),
            ({"ENTITY_ASSETS_KAFKA_CLIENT_CONFIG": "sasl.username=pipeline",
              "ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV": "sasl.password=KAFKA_SCRAM_PASSWORD"}, None)):
        for name, value in settings.items():
            monkeypatch.setenv(name, value)
        if said is None:
            build_resources()
            continue
        with pytest.raises(SettingError) as refused:
            build_resources()
        assert str(refused.value) == said


@pytest.mark.parametrize("name, value", [
    ("ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV", "sasl.oauthbearer.client.secret=s3cr3t-Value!"),  # a value, not a name
    ("ENTITY_ASSETS_KAFKA_CLIENT_SECRET_ENV", "s3cr3t-Value!"),
    ("ENTITY_ASSETS_SPARK_CONF", '{"spark.hadoop.fs.s3a.secret.key": "s3cr3t-Value!", "spark.executor.cores": null}'),
    ("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", '["s3cr3t-Value!"]'),
    ("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG", "s3cr3t-Value!, ssl.key.location=/k"),
])
def test_a_setting_refused_is_not_repeated_where_it_may_hold_a_secret(name, value, monkeypatch, tmp_path, capsys):
    """The error reaches the CLI's stderr, the UI's load error and the daemon's logs."""
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv(name, value)
    assert cli.main(["topics", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("entity-assets topics: a setting is not valid") and name in err and "s3cr3t" not in err


def test_a_variable_set_empty_counts_as_unset(monkeypatch):
    """A deployment's template often sets every variable, some to nothing: ENTITY_ASSETS_PUBLISH
    set empty once published nothing at all."""
    from entity_assets.definitions import VARIABLES, build_resources
    from resources.lake import default_home

    names = {*VARIABLES.values(), "ENTITY_ASSETS_HOME", "ENTITY_ASSETS_STEP_RETRIES", "ENTITY_ASSETS_BROKER_PORT"}
    for i, name in enumerate(sorted(names - {"ENTITY_ASSETS_INGESTION"})):
        monkeypatch.setenv(name, " " if i % 2 else "")  # blank too: numbers and ports as well
    resources = build_resources()
    assert resources["slicing"] == SlicingResource()
    assert cli._port_of("ENTITY_ASSETS_BROKER_PORT", 9092)["default"] == "9092"
    assert resources["kafka"].publishes("device-notifications") and resources["kafka"].sasl_password is None
    assert resources["spark"].master == "local[*]" and resources["slicing"].offsets_went_back == "report"
    assert resources["kafka"].bootstrap_servers == KafkaResource().bootstrap_servers
    assert default_home() == os.path.abspath(".entity-assets")
    from entity_assets.assets.retries import DEFAULT_RETRIES, retries

    assert retries() == DEFAULT_RETRIES


def test_run_ticks_the_sensor_with_the_slicing_settings_of_the_environment(monkeypatch, tmp_path):
    """`run` closes everything pending now, in slices of `max_messages`, with the deployment's
    other slicing settings, as the daemon's sensor has them (offsets that went back: `restart`)."""
    from dagster import SensorResult, SkipReason

    from entity_assets import definitions, sensors

    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    (tmp_path / "dagster").mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("ENTITY_ASSETS_OFFSETS_WENT_BACK", "restart")
    monkeypatch.setenv("ENTITY_ASSETS_SLICE_INTERVAL_SECONDS", "600")
    seen = []

    def sensor(context):
        seen.append(context.resources.slicing)
        return SensorResult(skip_reason=SkipReason("nothing pending"))

    sensor.name = definitions.kafka_offsets_sensor.name  # the definitions keep the real one
    monkeypatch.setattr(sensors, "kafka_offsets_sensor", sensor)
    assert cli.run_pending(max_messages=7, log=lambda _: None) == []
    [slicing] = seen
    assert (slicing.offsets_went_back, slicing.min_interval_seconds, slicing.max_messages) == ("restart", 0, 7)


def test_run_stops_between_slices_when_a_run_of_the_lake_starts_elsewhere(monkeypatch):
    """The daemon may start a maintenance or a backfill between two of `run`'s slices: the next
    slice does not start beside it."""
    from dagster import DagsterInstance

    from entity_assets import definitions, launcher
    from entity_assets.slices import Manifest, OffsetRange

    ran, checks = [], iter([[], ["run abc (lake_maintenance, slice -) is STARTED"]])

    class Outcome:
        success, run_id, all_events = True, "0123456789", []

        def get_asset_materialization_events(self):
            return []

    class Job:
        def execute_in_process(self, partition_key, **_):
            ran.append(partition_key)
            return Outcome()

    class Defs:
        def resolve_job_def(self, name):
            return Job()

    class Store:
        def get_many(self, seqs):
            return {s: Manifest(s, (OffsetRange("t", 0, s, s + 1),), 0) for s in seqs}

    monkeypatch.setattr(definitions, "defs", Defs())
    monkeypatch.setattr(launcher, "settle_runs", lambda instance, sensor: next(checks))
    runs = [(slice_key(s), f"{slice_key(s)}@0") for s in (1, 2, 3)]
    with DagsterInstance.ephemeral() as instance, pytest.raises(cli.RunsInFlight) as stopped:
        cli._materialize(instance, Store(), runs, None, log=lambda _: None)
    assert ran == [slice_key(1), slice_key(2)]
    assert stopped.value.args[0][-1] == f"(stopped before slice {slice_key(3)}; the slices before it are done)"


def test_an_instance_without_the_projects_dagster_yaml_is_named_before_runs_are_recorded_in_it(monkeypatch, tmp_path,
                                                                                               capsys):
    """A wheel carries no dagster.yaml: without DAGSTER_HOME, `run` would record its runs in a
    default instance that no deployment's daemon sees, and it says so; the commands that use no
    instance say nothing."""
    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # restored after: prepare sets what is unset
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.setattr(cli, "REPO", tmp_path / "site-packages")
    cli.prepare_environment()
    assert capsys.readouterr().err == ""
    cli._instance_for_runs()
    assert "no dagster.yaml in DAGSTER_HOME" in capsys.readouterr().err
    (tmp_path / "home" / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    instance = cli._instance_for_runs()
    assert capsys.readouterr().err == ""
    # the home's own instance gets the lake pool's limit as scripts/ui.sh sets it: the sensor warns of none
    from entity_assets.partitions import LAKE_POOL

    assert instance.event_log_storage.get_concurrency_info(LAKE_POOL).slot_count == 1


def test_broker_start_without_the_local_extra_says_which_extra_brings_it(monkeypatch, tmp_path, capsys):
    """A deployment's install has no embedded broker: `broker start` says how to get it, on one line."""
    import builtins

    real_import = builtins.__import__

    def without_noida(name, *args, **kwargs):
        if name == "noida_db":
            raise ModuleNotFoundError("No module named 'noida_db'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setattr(builtins, "__import__", without_noida)
    assert cli.main(["--port", "1", "broker", "start"]) == 1
    assert "pip install 'entity-assets[local]'" in capsys.readouterr().err


def test_constraints_pin_every_dependency_at_the_version_pyproject_names():
    """constraints.txt (what setup.sh installs with) must hold what pyproject.toml asks for: a
    dependency changed in one and not the other would fail a fresh set-up, or test another release."""
    import re
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((cli.REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]]
    pinned = dict(re.match(r"([^=\s]+)==(\S+)", line).groups() for line in
                  (cli.REPO / "constraints.txt").read_text().splitlines() if line and not line.startswith("#"))
    pinned = {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pinned.items()}
    for requirement in wanted:
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert name in pinned and requirement.specifier.contains(pinned[name], prereleases=True), (requirement, pinned.get(name))


@pytest.mark.slow
@pytest.mark.timeout(600)  # two demos of up to 240 s each
def test_the_readme_s_demo_command_runs_the_whole_graph_twice_on_one_home(tmp_path, free_port):
    """`bash scripts/demo.sh`, as a user runs it (smaller traffic), and again on the same home:
    the second run goes on from the first's slices. The broker it leaves running is stopped."""
    repo = Path(__file__).resolve().parent.parent
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("ENTITY_ASSETS_", "DAGSTER_"))},
           "ENTITY_ASSETS_HOME": str(tmp_path / "home"), "ENTITY_ASSETS_BROKER_PORT": str(free_port())}
    demo = ["bash", "scripts/demo.sh", "--patches", "300", "--entities", "30", "--devices", "4", "--cdc-rows", "10"]
    ran = []
    try:
        for _ in range(2):
            with subprocess.Popen(demo, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True) as proc:
                try:
                    out, err = proc.communicate(timeout=240)  # under the test's own limit (its mark)
                except BaseException:  # past it, or the test's limit: the script's `entity-assets run` too
                    os.killpg(proc.pid, signal.SIGKILL)
                    raise
            done = subprocess.CompletedProcess(demo, proc.returncode, out, err)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            assert done.stdout.count("lag: 0 messages on the input topics past slice") == 2, done.stdout[-3000:]
            # A row count per table: every stream of the graph has rows, dead letters by their codes.
            counts = {t: int(n) for t, n in re.findall(r"^(\w+) +(\d+)  v\d+", done.stdout, re.MULTILINE)}
            empty = {t for t in SCHEMAS if counts.get(t, 0) == 0}
            assert empty <= {"schema_waits", "pending_responses"}, (empty, done.stdout[-3000:])
            assert re.search(r"^dead_letters +\d+  v\d+  \{'GENERR", done.stdout, re.MULTILINE), done.stdout[-3000:]
            assert "entity-assets trace entity-batches:" in done.stdout and "entity-assets history " in done.stdout
            ran.append(re.findall(r"^slice (\d{10}): ok in ", done.stdout, re.MULTILINE))
        assert ran[0] and ran[1] and min(ran[1]) > max(ran[0]), ran  # the second goes on after the first's
    finally:
        subprocess.run([str(repo / ".venv" / "bin" / "entity-assets"), "broker", "stop"], cwd=repo, env=env,
                       capture_output=True, timeout=120)


def test_maintenance_vacuums_the_lake_without_the_daemon(monkeypatch, tmp_path, capsys):
    """A deployment of cron and `run` has no daemon to fire the daily schedule: `maintenance`
    runs lake_maintenance in the lake pool, as the schedule would."""
    from dagster import DagsterInstance

    from entity_assets.storage import DeltaRsEngine, FileWriter
    from entity_assets.tables import SCHEMAS

    monkeypatch.setenv("ENTITY_ASSETS_HOME", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", "")
    monkeypatch.setenv("ENTITY_ASSETS_VACUUM_RETENTION_HOURS", "1")  # the least the variable takes
    engine = DeltaRsEngine(str(tmp_path / "lake"))
    engine.ensure("dead_letters", SCHEMAS["dead_letters"])
    written = []
    for seq in ("0000000001", "0000000002"):
        orphan = FileWriter("dead_letters", engine.uri("dead_letters"), SCHEMAS["dead_letters"], seq)
        orphan.append({"slice": seq, "stream": "entity-batches", "code": "GENERR001", "reason": "r",
                       "kafka_topic": "t", "kafka_partition": 0, "kafka_offset": 0, "kafka_timestamp": 1})
        written += [tmp_path / "lake" / "dead_letters" / f.path for f in orphan.close()]
    failed, writing = written  # a failed run's file, never committed; a running slice's, not committed yet
    os.utime(failed, (time.time() - 2 * 3600,) * 2)
    at_exit = []
    monkeypatch.setattr(cli.atexit, "register", lambda fn, *args: at_exit.append(partial(fn, *args)))
    assert cli.main(["maintenance"]) == 0
    assert "lake_maintenance: done" in capsys.readouterr().out
    assert not failed.exists() and writing.exists()
    with DagsterInstance.get() as instance:
        [run] = instance.get_runs()
    assert run.job_name == "lake_maintenance" and "entity-assets/worker" in run.tags
    for close in at_exit:  # as the process's exit does: a run file left open keeps its events in its -wal
        close()
    assert not list(Path(os.environ["DAGSTER_HOME"]).rglob("*-wal"))
