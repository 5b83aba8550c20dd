"""Ingest end to end: a real broker, real Spark, real Delta tables, Dagster through its public API.

Kafka records -> sensor tick (slice manifest, dynamic partition, run request) -> slice_job run
-> entity_batches and dead_letters rows.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
from dagster import AssetCheckSeverity, AssetKey, DagsterRunStatus, Definitions, RunsFilter, build_sensor_context

from confluent_kafka.admin import AdminClient

from entity_assets import samples, trace
from entity_assets.kafka_io import cluster_metadata, ensure_topics, release_producers
from entity_assets.ingest import INPUT_STREAMS
from entity_assets.messages import parse_message
from entity_assets.publish import STREAMS
from entity_assets.sensors import dump_cursor
from entity_assets.slices import slice_key
from entity_assets.storage import DeltaRsEngine
from entity_assets.tables import SCHEMAS
from resources import SparkResource, with_settings

REPO = Path(__file__).resolve().parents[1]

STREAM = "entity-batches"
K1, K2 = slice_key(1), slice_key(2)


def traffic(patches: int, seed: int = 7, **kwargs) -> list[tuple[str, str, bytes]]:
    return list(samples.BatchTraffic(patches=patches, entities=max(1, patches // 4), seed=seed, **kwargs).records())


def by_request(records) -> dict[tuple[str, int], dict]:
    out = {}
    for _, _, value in records:
        message = json.loads(value)
        out[(message["clientid"], message["request"])] = message
    return out


def coordinates(table) -> list[tuple[str, int, int]]:
    return list(zip(*(table.column(c).to_pylist() for c in ("kafka_topic", "kafka_partition", "kafka_offset"))))


def assert_unique_coordinates(table) -> None:
    coords = coordinates(table)
    assert all(None not in c for c in coords)
    duplicates = [c for c, n in Counter(coords).items() if n > 1]
    assert not duplicates, f"{len(duplicates)} duplicated Kafka coordinates, e.g. {duplicates[:3]}"


def rows_of_slice(table, key: str):
    return table.filter(pc.equal(table["slice"], key))


def ingest_only(pipeline) -> list:
    """The ingest multi-asset's keys: these tests check ingest; the full job runs in the end-to-end test."""
    return pipeline.asset_keys_of("entity_batches")


def fail_commits(patch: pytest.MonkeyPatch, table: str) -> None:
    """Makes the lake refuse a table's slice commits, as a store that went away would."""
    commit = DeltaRsEngine.replace_slice

    def failing(self, name, *args, **kwargs):
        if name == table:
            raise OSError("the store went away")
        return commit(self, name, *args, **kwargs)

    patch.setattr(DeltaRsEngine, "replace_slice", failing)


# --------------------------------------------------------------------------- definitions

def test_the_steps_assets_are_owned_by_whom_the_environment_names(monkeypatch):
    from dagster import AssetsDefinition

    from entity_assets.definitions import OWNERS_VARIABLE, build_assets
    from resources import SettingError

    def owners() -> dict[str, list[str]]:
        return {spec.key.to_user_string(): list(spec.owners) for a in build_assets()
                for spec in (a.specs if isinstance(a, AssetsDefinition) else [a])}

    assert not any(owners().values())  # unset: no owners
    monkeypatch.setenv(OWNERS_VARIABLE, "team:data-platform, ada@example.com,team:data-platform")
    owned = owners()
    assert owned["entities"] == owned["device_notifications"] == ["team:data-platform", "ada@example.com"]
    assert owned["kafka/entity-batches"] == []  # a topic is its producers' and consumers'
    monkeypatch.setenv(OWNERS_VARIABLE, "data team")
    with pytest.raises(SettingError, match="ENTITY_ASSETS_OWNERS='data team': Invalid owner 'data team'"):
        build_assets()


def test_definitions_load():
    from entity_assets.definitions import defs
    from entity_assets.partitions import slices_partitions

    Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert {"entity_batches", "schema_patches", "connections", "notification_acks", "dead_letters"} <= keys
    for key in graph.get_all_asset_keys():
        assert defs.resolve_assets_def(key) is not None
    job = defs.resolve_job_def("slice_job")
    assert job.partitions_def == slices_partitions
    # the job the sensor requests materializes every asset of the code location
    assert set(job.asset_layer.executable_asset_keys) == set(graph.materializable_asset_keys)
    sensor = defs.resolve_sensor_def("kafka_offsets_sensor")
    assert sensor.job_name == "slice_job"
    # each asset's columns, for the UI's Columns tab, are its table's
    from entity_assets.tables import SCHEMAS
    for key in graph.materializable_asset_keys:
        columns = graph.get(key).metadata["dagster/column_schema"].columns
        assert [c.name for c in columns] == SCHEMAS[key.to_user_string()].names
    # the UI's link to each asset's code is its step's function, not the retry wrapper around it
    [source] = graph.get(AssetKey("device_notifications")).metadata["dagster/code_references"].code_references
    assert source.file_path.endswith("entity_assets/assets/notifications.py")
    assert "def device_notifications(" in "".join(Path(source.file_path).read_text().splitlines(True)[
        source.line_number - 1:source.line_number + 12])
    assert all(graph.get(k).metadata["dagster/code_references"] for k in graph.materializable_asset_keys)
    # the lineage starts at the topics clients produce to and ends at the topics consumers read
    kafka = AssetKey(["kafka", "entity-batches"]), AssetKey(["kafka", "device-notifications"])
    assert graph.external_asset_keys == {k for k in graph.get_all_asset_keys() if k.path[0] == "kafka"}
    assert graph.get(AssetKey("entity_batches")).parent_keys == {kafka[0], AssetKey(["kafka", "ingestion"])}
    assert graph.get(kafka[1]).parent_keys == {AssetKey("device_notifications")}
    assert {k for k in graph.external_asset_keys if not graph.get(k).child_keys} == {
        AssetKey(["kafka", stream.name]) for stream in STREAMS.values()}
    assert {"kafka", "lake", "slicing", "spark"} <= set(defs.resources or {})


def test_each_group_of_the_ui_can_be_materialized_on_its_own():
    """A step writes its tables together, so a group holding some of a step's tables would be
    a selection the UI's Materialize could not launch."""
    from dagster import AssetSelection

    from entity_assets.definitions import defs

    graph, job = defs.resolve_asset_graph(), defs.resolve_implicit_global_asset_job_def()
    groups = {graph.get(key).group_name for key in graph.materializable_asset_keys}
    assert groups == {"ingest", "entity_core", "schemas", "devices", "notifications"}
    assert {graph.get(key).group_name for key in graph.external_asset_keys} == {"kafka"}  # the topics: none to run
    for group in groups:
        job.get_subset(asset_selection=AssetSelection.groups(group).resolve(graph))


def test_every_lake_writer_is_in_the_lake_pool_and_every_run_is_in_process(project_instance):
    """What keeps slices in order under the daemon (tests/test_daemon.py runs it)."""
    from entity_assets.definitions import defs
    from entity_assets.partitions import LAKE_POOL

    graph = defs.resolve_asset_graph()
    assert {defs.resolve_assets_def(k).op.pool for k in graph.materializable_asset_keys} == {LAKE_POOL}
    assert defs.resolve_job_def("lake_maintenance").graph.node_defs[0].pool == LAKE_POOL
    # the UI's Materialize and asset backfills run Dagster's asset job: one SparkSession per run too
    assert defs.resolve_implicit_global_asset_job_def().executor_def.name == "in_process"
    assert defs.resolve_job_def("slice_job").executor_def.name == "in_process"
    pools = project_instance.get_concurrency_config().pool_config
    assert (pools.pool_granularity.value, pools.default_pool_limit) == ("run", 1)
    assert project_instance.run_monitoring_enabled  # a run stuck starting would hold the pool's slot
    assert f"dagster instance concurrency set {LAKE_POOL} 1" in (REPO / "scripts/ui.sh").read_text()


def test_each_input_stream_fills_every_column_of_its_table():
    lineage = {"slice", "kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp"}
    for stream in INPUT_STREAMS.values():
        assert len(set(stream.fields)) == len(stream.fields)
        assert lineage | set(stream.fields) == set(SCHEMAS[stream.table].names), stream.name


@pytest.mark.parametrize(("learning", "before", "after"), [(False, True, False), (True, False, False)])
def test_input_stream_values_are_in_the_order_of_their_fields(learning, before, after):
    """`values` gives a tuple, not a dict: each value must sit under its own field's name. The
    seed's samples set every flag true, where a swap would not show: each pair of flags differs in
    one of the cases."""
    ack = {"db": "my-db", "user": "jsmith", "device": "d1", "begun": 5, "upTo": 9, "notifications": ["n1"]}
    flags = {"includeBefore": before, "includeAfter": after}
    messages = {"entity-batches": {**samples.SEED_ENTITY_BATCH, **flags, "learning": learning},
                "schema-patches": {**samples.SEED_SCHEMA_PATCH, **flags},
                "connections": samples.SEED_CONNECTION, "notification-acks": ack}
    computed = {"parts": lambda m: len(m.patches) if hasattr(m, "patches") else m.parts,
                "patches": lambda m: json.loads(json.dumps(m.patches)), "ops": lambda m: m.ops,
                "notifications": lambda m: m.notifications}
    for name, stream in INPUT_STREAMS.items():
        model = parse_message(stream.model, json.dumps(messages[name]).encode())
        row = dict(zip(stream.fields, stream.values(model)))
        for field, value in row.items():
            if field in ("patches", "ops", "notifications"):
                value = json.loads(value)
            assert value == (computed[field](model) if field in computed else getattr(model, field)), (name, field)
        assert row["dbid"] != row["user"]  # two strings a swap would exchange


def test_a_record_that_fails_for_no_reason_a_check_foresaw_is_an_unexpected_error_dead_letter():
    """A bug's error is GENERR009, which the no_dead_letters check makes an error, never a client's
    bad format (GENERR001), a warning."""
    from types import SimpleNamespace

    from entity_assets.ingest import dead_letter

    rows = []
    dead_letter(SimpleNamespace(append=lambda row, size: rows.append(row)), KeyError("x"), K1, STREAM, "entity-batches",
                0, 5, 1, b"k", b"v")
    assert (rows[0]["code"], rows[0]["reason"]) == ("GENERR009", "KeyError: 'x'")


def test_spark_settings_come_from_the_environment(monkeypatch):
    from entity_assets.definitions import build_resources

    monkeypatch.setenv("ENTITY_ASSETS_SPARK_CONF",
                       "spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1, spark.sql.shuffle.partitions=16")
    assert build_resources()["spark"].conf == {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
                                               "spark.sql.shuffle.partitions": "16"}


def test_slicing_settings_come_from_the_environment(monkeypatch):
    from entity_assets.definitions import build_resources

    def settings(slicing):
        return slicing.schema_wait_slices, slicing.offsets_went_back, slicing.dedupe_window_slices

    assert settings(build_resources()["slicing"]) == (4, "report", 4)
    monkeypatch.setenv("ENTITY_ASSETS_SCHEMA_WAIT_SLICES", "0")
    monkeypatch.setenv("ENTITY_ASSETS_OFFSETS_WENT_BACK", "restart")
    monkeypatch.setenv("ENTITY_ASSETS_DEDUPE_WINDOW_SLICES", "12")
    assert settings(build_resources()["slicing"]) == (0, "restart", 12)


def test_kafka_and_lake_settings_come_from_the_environment(monkeypatch):
    """The settings a deployment sets besides the slicing: librdkafka's own (mTLS certificates,
    say), output topics' partitions, and how far back replays reach."""
    from entity_assets.definitions import build_resources

    def settings(resources):
        kafka = resources["kafka"]
        return kafka.client_config, kafka.new_topic_partitions, resources["lake"].vacuum_retention_hours

    assert settings(build_resources()) == ({}, 4, 168)
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG",
                       "ssl.certificate.location=/etc/kafka/client.pem, ssl.key.location=/etc/kafka/client.key")
    monkeypatch.setenv("ENTITY_ASSETS_NEW_TOPIC_PARTITIONS", "12")
    monkeypatch.setenv("ENTITY_ASSETS_VACUUM_RETENTION_HOURS", "720")
    resources = build_resources()
    assert settings(resources) == ({"ssl.certificate.location": "/etc/kafka/client.pem",
                                    "ssl.key.location": "/etc/kafka/client.key"}, 12, 720)
    assert resources["kafka"].config()["ssl.key.location"] == "/etc/kafka/client.key"
    monkeypatch.setenv("ENTITY_ASSETS_NEW_TOPIC_PARTITIONS", "")  # set but empty: the default
    assert build_resources()["kafka"].new_topic_partitions == 4
    monkeypatch.setenv("ENTITY_ASSETS_NEW_TOPIC_CONFIG", "cleanup.policy=compact,delete, retention.ms=86400000")
    assert build_resources()["kafka"].new_topic_config == {"cleanup.policy": "compact,delete", "retention.ms": "86400000"}
    # a value that is itself a list of `k=v` (Confluent Cloud's identity pools): the JSON form
    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_CLIENT_CONFIG",
                       '{"sasl.oauthbearer.extensions": "logicalCluster=lkc-1,identityPoolId=pool-2", "linger.ms": 5}')
    assert build_resources()["kafka"].client_config == {
        "sasl.oauthbearer.extensions": "logicalCluster=lkc-1,identityPoolId=pool-2", "linger.ms": "5"}


def test_with_settings_copies_a_resource_as_dagster_builds_it():
    """`model_copy(update=...)` reads back on the copy, but Dagster builds the resource from the
    settings it was made with; `with_settings` makes it anew, secrets still bound to their variables."""
    from dagster import EnvVar

    from resources import KafkaResource, SlicingResource, with_settings

    made = SlicingResource(min_interval_seconds=600)
    for copy, seen in ((made.model_copy(update={"min_interval_seconds": 0}), 600),
                       (with_settings(made, min_interval_seconds=0), 0)):
        with build_sensor_context(resources={"slicing": copy}) as context:
            assert context.resources.slicing.min_interval_seconds == seen
    kafka = with_settings(KafkaResource(sasl_password=EnvVar("KAFKA_SASL_PASSWORD")), topic_prefix="acme.")
    assert isinstance(kafka.sasl_password, EnvVar) and kafka.topic_prefix == "acme."
    with pytest.raises(TypeError, match="SlicingResource has no setting max_mesages"):
        with_settings(made, max_mesages=1)


def test_a_pipelines_settings_are_the_ones_its_runs_get(make_pipeline, monkeypatch):
    """Dagster builds a run's resources from the settings they were constructed with: a test that
    asks for Spark tasks (driver_rows 0) must get them, or its Spark path is never run."""
    seen = []
    on_driver = SparkResource.on_driver

    def spy(self, rows):
        seen.append(self.driver_rows)
        return on_driver(self, rows)

    monkeypatch.setattr(SparkResource, "on_driver", spy)
    pipeline = make_pipeline(driver_rows=0)
    pipeline.produce(traffic(20, seed=1))
    assert all(run.success for run in pipeline.tick_and_run())
    assert seen and set(seen) == {0}


# --------------------------------------------------------------------------- one slice

def test_slice_rows_equal_what_was_produced(make_pipeline):
    pipeline = make_pipeline(max_messages_per_task=100)  # several Spark tasks per partition
    records = traffic(600, patches_per_batch=2, include_before=True)
    produced = by_request(records)
    assert pipeline.produce(records) == {STREAM: 300}

    [request] = pipeline.tick()
    assert request.partition_key == K1
    result = pipeline.run_request(request, assets=ingest_only(pipeline))
    assert result.success

    rows = pipeline.read("entity_batches")
    assert rows.num_rows == len(produced) == 300
    topic = pipeline.topic(STREAM)
    for row in rows.to_pylist():
        sent = produced[(row["clientid"], row["request"])]
        assert json.loads(row["patches"]) == sent["patches"]
        assert row["parts"] == len(sent["patches"]) == 2
        for field in ("user", "dbid", "begun", "learning", "includeBefore", "includeAfter"):
            assert row[field] == sent[field], field
        assert row["slice"] == K1 and row["kafka_topic"] == topic
        assert row["kafka_timestamp"] and row["kafka_timestamp"] > 0
    assert_unique_coordinates(rows)

    # The Kafka coordinates are the record's own: every offset of every partition, each row
    # equal to the record stored at its (partition, offset).
    on_kafka = {(r["partition"], r["offset"]): json.loads(r["value"]) for r in pipeline.consume(STREAM)}
    assert {(row["kafka_partition"], row["kafka_offset"]) for row in rows.to_pylist()} == set(on_kafka)
    for row in rows.to_pylist():
        assert on_kafka[(row["kafka_partition"], row["kafka_offset"])] == produced[(row["clientid"], row["request"])]
    assert pipeline.read("dead_letters").num_rows == 0

    meta = pipeline.materializations(result)
    ends = pipeline.end_offsets(STREAM)
    assert meta["entity_batches"]["rows"] == 300
    assert meta["entity_batches"]["dead_letters"] == 0
    assert meta["entity_batches"]["offsets"] == {f"{t}[{p}]": f"[0, {e})" for (t, p), e in ends.items() if e > 0}
    assert meta["entity_batches"]["delta_version"] == pipeline.engine.version("entity_batches")
    assert meta["dead_letters"]["rows"] == 0
    [check] = result.get_asset_check_evaluations()
    assert check.check_name == "no_dead_letters" and check.passed


# --------------------------------------------------------------------------- sensor ticks

def test_a_tick_with_nothing_to_say_opens_no_log(pipeline, monkeypatch):
    """The daemon's sensor context opens the tick's captured-log file at the first use of
    `context.log`, and tick retention deletes rows, not files: one file a tick, 2,880 a day."""
    from dagster import SensorEvaluationContext

    used, real = [], SensorEvaluationContext.log
    monkeypatch.setattr(SensorEvaluationContext, "log", property(lambda self: used.append(1) or real.fget(self)))
    pipeline.produce(traffic(20, seed=1))
    assert pipeline.tick() and used  # "requesting slices ..."
    used.clear()
    assert pipeline.tick() == [] and not used


def test_ticks_close_contiguous_slices(pipeline):
    assert pipeline.tick() == []  # empty topics
    assert pipeline.last_result.skip_reason is not None

    pipeline.produce(traffic(120, seed=1))
    [first] = pipeline.tick()
    assert first.partition_key == K1 and first.run_key == f"{K1}@{pipeline.manifest(K1).closed_at}"
    assert pipeline.tick() == []  # nothing new
    assert pipeline.tick() == []

    pipeline.produce(traffic(50, seed=2))
    [second] = pipeline.tick()
    assert second.partition_key == K2
    assert pipeline.tick() == []

    m1, m2 = pipeline.manifest(K1), pipeline.manifest(K2)
    assert m1.messages == 120 and m2.messages == 50
    assert {(r.topic, r.partition): r.start for r in m2.ranges} == m1.positions()
    ends = pipeline.kafka.end_offsets([pipeline.topic(s) for s in ("entity-batches", "schema-patches",
                                                                   "connections", "notification-acks")])
    assert m2.positions() == ends
    assert pipeline.instance.get_dynamic_partitions("slices") == [K1, K2]

    # A lost cursor (a new sensor on the same lake) resumes from the manifests: the same
    # slices are requested again under the same run keys, and no new slice is closed.
    pipeline.cursor = None
    assert [r.run_key for r in pipeline.tick()] == [first.run_key, second.run_key]
    assert pipeline.tick() == []
    assert pipeline.manifest(K2) == m2


def test_a_lake_restored_behind_the_sensor_runs_its_slices_again(pipeline, tmp_path, monkeypatch):
    """A backup taken when slice 2 was closed but not yet run, restored after slice 3 ran: the
    sensor closes slice 3 again, over the offsets since slice 2, and requests slice 2 again,
    which the lake lacks though its run succeeded. The daemon skips a request whose run key a
    run already has, so both need run keys of their own, or their records never reach the lake."""
    pipeline.produce(traffic(40, seed=1))
    [first] = pipeline.tick_and_run()
    second_records = traffic(20, seed=2)
    pipeline.produce(second_records)
    [second] = pipeline.tick()
    backup = tmp_path / "backup"
    shutil.copytree(pipeline.lake.root, backup)  # manifests of slices 1 and 2, state of slice 1
    assert pipeline.run_request(second).success
    lost = traffic(16, seed=3)
    pipeline.produce(lost)
    [third] = pipeline.tick()
    assert pipeline.run_request(third).success

    shutil.rmtree(pipeline.lake.root)
    shutil.copytree(backup, pipeline.lake.root)
    later = traffic(12, seed=4)
    pipeline.produce(later)
    again = pipeline.tick()  # the cursor is at slice 3, the lake's manifests at 2, its state at 1
    assert [r.partition_key for r in again] == [K2, slice_key(3)]
    assert again[0].run_key.startswith(second.run_key + "~") and again[1].run_key != third.run_key
    for request in again:
        assert not pipeline.instance.get_runs(RunsFilter(tags={"dagster/run_key": request.run_key}))
    assert pipeline.manifest(3).messages == len(lost) + len(later)
    assert all(pipeline.run_request(r).success for r in again)
    batches = pipeline.read("entity_batches")
    assert rows_of_slice(batches, K2).num_rows == len(second_records)
    assert rows_of_slice(batches, slice_key(3)).num_rows == len(lost) + len(later)

    # a lost cursor resumes from the manifests, and requests none of the slices that ran, nor
    # does a state table deleted to be rebuilt (docs/operations.md) make them look undone
    pipeline.cursor = None
    assert pipeline.tick() == []
    whole = tmp_path / "whole"
    shutil.copytree(pipeline.lake.root, whole)
    shutil.rmtree(Path(pipeline.lake.root) / "devices")
    pipeline.engine.ensure("devices", SCHEMAS["devices"])  # as the next run of devices makes it, empty
    pipeline.cursor = None
    assert pipeline.tick() == []
    shutil.rmtree(pipeline.lake.root)
    shutil.copytree(whole, pipeline.lake.root)

    # a backup of the same slices as the cursor, taken before the last one ran: the next tick
    # that closes a slice requests it again with that one. Runs of some assets of it, one that
    # succeeded after its whole run and one that failed after the restore (the lake lacks its
    # input), neither hide that whole run nor stand for one.
    pipeline.produce(traffic(8, seed=5))
    [fourth] = pipeline.tick()
    shutil.rmtree(backup)
    shutil.copytree(pipeline.lake.root, backup)
    assert pipeline.run_request(fourth).success
    assert pipeline.run(slice_key(4), assets=["learned_schemas"]).success
    shutil.rmtree(pipeline.lake.root)
    shutil.copytree(backup, pipeline.lake.root)
    assert not pipeline.run(slice_key(4), assets=pipeline.asset_keys_of("entity_updates"), raise_on_error=False).success
    pipeline.produce(traffic(8, seed=6))
    restored = pipeline.tick()
    assert [r.partition_key for r in restored] == [slice_key(4), slice_key(5)]
    assert restored[0].run_key.startswith(fourth.run_key + "~")

    # the whole run requested again fails: no tick requests it again (it would at every tick)
    with monkeypatch.context() as patched:
        fail_commits(patched, "entity_batches")
        assert not pipeline.run_request(restored[0], raise_on_error=False).success
    pipeline.produce(traffic(8, seed=7))
    [sixth] = pipeline.tick()
    assert sixth.partition_key == slice_key(6)
    assert pipeline.run(slice_key(4)).success  # as the user re-runs it
    assert all(pipeline.run_request(r).success for r in (restored[1], sixth))


def test_a_cursor_naming_the_lake_s_newest_slice_by_number_reads_on_from_the_lake_s_offsets(pipeline, tmp_path):
    """A lake restored behind the sensor and brought up to date by `entity-assets run` while the
    sensor was stopped: the CLI closed as many slices again as the restore lost, so the sensor's
    cursor names the lake's newest slice by its number, but another slice. Its offsets were read
    twice (the CLI's slice went further) or never (it went less far)."""
    pipeline.produce(traffic(20, seed=1))
    pipeline.tick_and_run()
    backup = tmp_path / "backup"
    shutil.copytree(pipeline.lake.root, backup)
    pipeline.produce(traffic(10, seed=2))
    [second] = pipeline.tick()
    stored = pipeline.cursor  # the daemon's, at its slice 2
    shutil.rmtree(pipeline.lake.root)
    shutil.copytree(backup, pipeline.lake.root)
    pipeline.produce(traffic(6, seed=3))
    first = pipeline.manifest(1)
    pipeline.cursor = dump_cursor(first.seq, first.positions(), first.closed_at)  # as `entity-assets run` starts
    [again] = pipeline.tick()
    assert again.partition_key == K2 and pipeline.manifest(2).messages == 16
    pipeline.cursor = stored  # the sensor turned on again; `entity-assets run` stopped before running slice 2
    later = traffic(4, seed=4)
    pipeline.produce(later)
    [second, third] = pipeline.tick()  # the CLI's slice 2 too: not a request of this sensor's
    assert (second.partition_key, third.partition_key) == (K2, slice_key(3))
    assert second.run_key == again.run_key
    assert pipeline.manifest(3).messages == len(later)
    assert {(r.topic, r.partition): r.start for r in pipeline.manifest(3).ranges} == pipeline.manifest(2).positions()


def test_a_run_that_succeeds_during_a_tick_is_not_requested_again(pipeline, monkeypatch):
    """The tick reads the runs, then the lake, then the newest whole runs: slice 1's run ended
    between the first two, so neither saw it, and the third did. It is done, not a slice the
    lake lacks (restored?), whose replay would publish its messages again."""
    from entity_assets import sensors

    pipeline.produce(traffic(20, seed=1))
    [first] = pipeline.tick()
    assert pipeline.run_request(first).success
    pipeline.produce(traffic(8, seed=2))
    looks, real = [], sensors.lake_holds
    monkeypatch.setattr(sensors, "slice_runs", lambda instance, closed_at: {})  # before the run ended
    monkeypatch.setattr(sensors, "lake_holds", lambda engine, *a, **kw: 0 if len(looks) < 2 and not looks.append(1)
                        else real(engine, *a, **kw))  # before its commits
    pipeline.cursor = dump_cursor(0, {}, None)  # slice 1 past the cursor, as closed by `entity-assets run`
    assert [r.partition_key for r in pipeline.tick()] == [slice_key(2)]


def test_a_sensor_whose_lake_has_no_slice_closes_none_until_its_cursor_is_deleted(pipeline, tmp_path):
    """A lake root mistyped or moved is an empty lake: the sensor would read all Kafka holds again
    and publish it again. No backup lacks every slice, so it refuses, naming the root."""
    pipeline.produce(traffic(20, seed=1))
    assert pipeline.tick_and_run()
    shutil.rmtree(pipeline.lake.root)
    pipeline.produce(traffic(8, seed=2))
    assert pipeline.tick() == []
    reason = pipeline.last_result.skip_reason.skip_message
    assert f"the lake at {pipeline.engine.root} has no slice, but this sensor closed 1" in reason
    assert "dagster sensor cursor kafka_offsets_sensor --delete" in reason
    pipeline.cursor = None
    [again] = pipeline.tick()
    assert again.partition_key == K1 and pipeline.manifest(K1).messages == 28


def delete_topic(pipeline, stream: str) -> str:
    """Deletes a stream's topic, and waits until the cluster no longer lists it."""
    topic = pipeline.topic(stream)
    admin = AdminClient(pipeline.kafka.config())
    for future in admin.delete_topics([topic]).values():
        future.result()
    deadline = time.monotonic() + 30  # a topic still listed would not be created again
    while topic in cluster_metadata(pipeline.kafka.config()).topics:
        assert time.monotonic() < deadline, f"{topic} is still listed 30 s after its deletion"
        time.sleep(0.1)
    return topic


def create_again(pipeline, stream: str) -> str:
    """Deletes a stream's topic and creates it again, empty: its offsets start again at 0."""
    topic = delete_topic(pipeline, stream)
    assert ensure_topics(pipeline.kafka.config(), [topic],
                         sum(r.topic == topic for r in pipeline.manifest(K1).ranges)) == [topic]
    release_producers()  # an idempotent producer's sequence numbers belong to the old topic
    return topic


def went_back(pipeline) -> str:
    """A topic deleted and created again, with fewer records than the slices read of the old one,
    then more: what the ticks between say."""
    pipeline.produce(traffic(120, seed=1))
    pipeline.tick()
    topic = create_again(pipeline, STREAM)
    pipeline.produce(traffic(4, seed=2))
    for _ in range(2):
        assert pipeline.tick() == []
        reason = pipeline.last_result.skip_reason.skip_message
        assert f"offsets went back: {topic}[" in reason and "created again" in reason
    pipeline.produce(traffic(200, seed=3))
    read = pipeline.manifest(K1).positions()
    assert all(end > read[tp] for tp, end in pipeline.end_offsets(STREAM).items())  # past the slices' offsets
    return topic


def test_offsets_that_went_back_are_reported_at_every_tick_and_held_until_the_user_decides(pipeline):
    """A topic deleted and created again restarts its offsets: its records below the slices'
    positions would never be read, so every tick says so, and its partitions stay held once the
    new topic grows past those positions (they would go on from there, its first records never
    read): until `restart` reads them from their first offsets, every partition of the topic."""
    topic = went_back(pipeline)
    assert pipeline.tick() == []
    assert "are held" in pipeline.last_result.skip_reason.skip_message
    pipeline.resources["slicing"] = with_settings(pipeline.resources["slicing"], offsets_went_back="restart")
    [second] = pipeline.tick()
    restarted = [r for r in pipeline.manifest(K2).ranges if r.topic == topic]
    assert all(r.start == 0 for r in restarted) and sum(r.count for r in restarted) == 204
    pipeline.resources["slicing"] = with_settings(pipeline.resources["slicing"], offsets_went_back="report")
    pipeline.produce(traffic(3, seed=4))
    [third] = pipeline.tick()  # none held any more
    assert pipeline.manifest(3).messages == 3


def test_offsets_held_since_they_went_back_are_read_on_from_the_slices_offsets_with_continue(pipeline):
    """The bootstrap servers named another cluster for a while: once they name the lake's again,
    the user sets `continue`, and the slices go on from their offsets."""
    went_back(pipeline)
    assert pipeline.tick() == []
    assert "or continue (read on from the slices' offsets" in pipeline.last_result.skip_reason.skip_message
    pipeline.resources["slicing"] = with_settings(pipeline.resources["slicing"], offsets_went_back="continue")
    [second] = pipeline.tick()
    ends = pipeline.end_offsets(STREAM)
    assert {(r.topic, r.partition): (r.start, r.end) for r in pipeline.manifest(K2).ranges if r.topic == pipeline.topic(STREAM)} \
        == {tp: (start, ends[tp]) for tp, start in pipeline.manifest(K1).positions().items() if tp[0] == pipeline.topic(STREAM)}
    assert (Path(pipeline.lake.root) / "_notes" / "offsets-went-back").read_text() == "{}"


def test_offsets_that_went_back_can_be_read_again_from_the_start(make_pipeline):
    """`offsets_went_back="restart"`: the new topic's records are read from its first offsets."""
    pipeline = make_pipeline(offsets_went_back="restart")
    pipeline.produce(traffic(120, seed=1))
    [first] = pipeline.tick_and_run()
    topic = create_again(pipeline, STREAM)
    pipeline.produce(traffic(4, seed=2))
    [second] = pipeline.tick_and_run()
    assert second.success
    restarted = [r for r in pipeline.manifest(K2).ranges if r.topic == topic and r.count]
    assert restarted and all(r.start == 0 for r in restarted) and sum(r.count for r in restarted) == 4
    assert rows_of_slice(pipeline.read("entity_batches"), K2).num_rows == 4
    assert pipeline.tick() == []  # and on from there


def test_a_partition_no_slice_has_read_starts_at_the_first_offset_kafka_holds(pipeline, delete_records_before):
    """Records that retention removed before the sensor ever saw the topic were never the
    pipeline's to read: no dead letter for them."""
    pipeline.produce(traffic(120, seed=1))
    ends = pipeline.end_offsets(STREAM)
    delete_records_before(pipeline.kafka.config(), {tp: end // 2 for tp, end in ends.items()})
    [run] = pipeline.tick_and_run()
    assert run.success
    assert {(r.topic, r.partition): r.start for r in pipeline.manifest(K1).ranges if r.topic == pipeline.topic(STREAM)} \
        == {tp: end // 2 for tp, end in ends.items()}
    assert pipeline.read("entity_batches").num_rows == sum(end - end // 2 for end in ends.values())
    assert pipeline.read("dead_letters").num_rows == 0


def test_a_topic_seen_by_ticks_before_a_slice_reads_it_starts_at_the_first_offset_kafka_holds_then(
        make_pipeline, delete_records_before):
    """The cursor keeps the slices' offsets, not the first offsets a tick that closed no slice saw:
    records retention removed before the first slice read the topic are no dead letters (as the
    manifests plan it, `entity-assets run`)."""
    from entity_assets.kafka_io import produce
    from entity_assets.samples import encode

    pipeline = make_pipeline(min_interval_seconds=3600, max_messages=100)
    pipeline.produce(traffic(1, seed=1))
    [first] = pipeline.tick_and_run()  # the CDC topic does not exist yet
    assert first.success
    topic, config = pipeline.topic("crm.customers.ingestion"), pipeline.kafka.config()
    ensure_topics(config, [topic], 1)

    def rows(ids):
        return [(encode({"ID": i}), encode({"ID": i, "NAME": f"n{i}"})) for i in ids]

    produce(config, topic, rows(range(60)))
    assert pipeline.tick() == []  # not due, under max_messages: a tick saw the topic at offset 0
    delete_records_before(config, {(topic, 0): 30})
    produce(config, topic, rows(range(60, 130)))
    [run] = pipeline.tick_and_run()  # the 100 records Kafka holds: a full slice
    assert run.success
    assert [(r.start, r.end) for r in pipeline.manifest(2).ranges if r.topic == topic] == [(30, 130)]
    assert pipeline.read("dead_letters").num_rows == 0
    assert pipeline.read("entity_batches").num_rows == 1 + 100


def test_a_partition_without_a_leader_waits_and_the_others_are_sliced(pipeline, monkeypatch):
    """One partition that gives no offsets (an election, its broker down) must not hold back
    every topic: the tick leaves it out, says so, and a later tick slices it from where it was."""
    from concurrent.futures import Future

    from confluent_kafka import KafkaError, KafkaException

    from entity_assets import kafka_io

    topic = pipeline.topic(STREAM)

    class Leaderless(kafka_io.AdminClient):
        def list_offsets(self, partitions, **kwargs):
            failed = Future()
            failed.set_exception(KafkaException(KafkaError(KafkaError.LEADER_NOT_AVAILABLE)))
            return {tp: failed if (tp.topic, tp.partition) == (topic, 1) else future
                    for tp, future in super().list_offsets(partitions, **kwargs).items()}

    pipeline.produce(traffic(120, seed=11))
    ends = pipeline.end_offsets(STREAM)
    assert ends[(topic, 1)] > 0
    monkeypatch.setattr(kafka_io, "AdminClient", Leaderless)
    with pytest.raises(kafka_io.KafkaUnreachable, match=f"{topic} partition 1"):  # asked without `unanswered`
        pipeline.end_offsets(STREAM)
    [first] = pipeline.tick_and_run()
    assert first.success
    read = Counter(p for _, p, _ in coordinates(pipeline.read("entity_batches")))
    assert read == {p: end for (_, p), end in ends.items() if p != 1}

    monkeypatch.setattr(kafka_io, "AdminClient", Leaderless.__mro__[1])
    [second] = pipeline.tick_and_run()
    assert second.success
    assert Counter(p for _, p, _ in coordinates(pipeline.read("entity_batches"))) == {p: e for (_, p), e in ends.items()}
    assert pipeline.read("dead_letters").num_rows == 0


def test_slices_respect_max_messages(make_pipeline):
    pipeline = make_pipeline(max_messages=100)
    pipeline.produce(traffic(250, seed=3))
    requests = pipeline.tick()
    assert [r.partition_key for r in requests] == [slice_key(n) for n in (1, 2, 3)]
    manifests = [pipeline.manifest(r.partition_key) for r in requests]
    assert [m.messages for m in manifests] == [100, 100, 50]
    for a, b in zip(manifests, manifests[1:]):
        assert {(r.topic, r.partition): r.start for r in b.ranges} == a.positions()


# --------------------------------------------------------------------------- re-runs

def test_rematerializing_a_slice_reads_its_manifest_and_never_duplicates(pipeline):
    pipeline.produce(traffic(200, seed=4))
    [r1] = pipeline.tick()
    ingest = ingest_only(pipeline)
    pipeline.run_request(r1, assets=ingest)
    first = pipeline.read("entity_batches")
    v1 = pipeline.engine.version("entity_batches")
    assert first.num_rows == 200

    # More messages after the slice closed: a re-run still reads only the slice's ranges.
    pipeline.produce(traffic(80, seed=5))
    again = pipeline.run(K1, assets=ingest)
    assert pipeline.materializations(again)["entity_batches"]["rows"] == 200
    rows = pipeline.read("entity_batches")
    assert rows.num_rows == 200
    assert sorted(coordinates(rows)) == sorted(coordinates(first))
    assert pipeline.engine.version("entity_batches") > v1  # rewritten in place, not skipped
    assert_unique_coordinates(rows)

    [r2] = pipeline.tick()
    assert r2.partition_key == K2
    pipeline.run_request(r2, assets=ingest)
    pipeline.run(K2, assets=ingest)  # the newest slice, twice
    rows = pipeline.read("entity_batches")
    assert rows.num_rows == 280
    assert_unique_coordinates(rows)
    assert rows_of_slice(rows, K1).num_rows == 200 and rows_of_slice(rows, K2).num_rows == 80
    for key in (K1, K2):
        ranges = {(r.topic, r.partition): r for r in pipeline.manifest(key).ranges}
        for topic, partition, offset in coordinates(rows_of_slice(rows, key)):
            r = ranges[(topic, partition)]
            assert r.start <= offset < r.end


def test_records_kafka_no_longer_holds_are_dead_letters_and_a_re_run_keeps_the_lake_rows(pipeline, delete_records_before):
    """Retention can delete a closed slice's records before its run reads them: each span of
    offsets gone is an EA-EXPIRED dead letter, never a silent gap. Once a slice is ingested, the
    lake holds the only copy of what Kafka dropped since: a re-run keeps its rows."""
    pipeline.produce(traffic(100, seed=8))
    [r1] = pipeline.tick()
    ranges = [r for r in pipeline.manifest(K1).ranges if r.count >= 4]
    config = pipeline.kafka.config()
    delete_records_before(config, {(r.topic, r.partition): r.start + 3 for r in ranges})
    run = pipeline.run_request(r1)
    assert run.success
    rows = pipeline.read("entity_batches")
    assert rows.num_rows == 100 - 3 * len(ranges)
    dead = pipeline.read("dead_letters").to_pylist()
    assert sorted((d["kafka_topic"], d["kafka_partition"], d["kafka_offset"], d["code"]) for d in dead) == sorted(
        (r.topic, r.partition, r.start, "EA-EXPIRED") for r in ranges)
    assert all(f"no longer holds offsets [{d['kafka_offset']}, {d['kafka_offset'] + 3})" in d["reason"]
               and d["value"] is None and d["kafka_timestamp"] == -1 for d in dead)
    check = pipeline.checks(run)["no_dead_letters"]
    assert not check.passed and check.metadata["by_stream_and_code"].data == {"entity-batches EA-EXPIRED": len(ranges)}
    # input lost is no producer's mistake: an error, where a malformed record is a warning
    assert check.severity == AssetCheckSeverity.ERROR and check.metadata["lost_or_unforeseen"].value == len(ranges)
    updates = pipeline.read("entity_updates").num_rows
    r = ranges[0]  # a record inside a span gone is traced to the span's dead letter
    [letter] = trace.trace(pipeline.engine, r.topic, r.partition, r.start + 1).rows["dead_letters"]
    assert letter["code"] == "EA-EXPIRED" and f"[{r.start}, {r.start + 3})" in letter["reason"]
    assert trace.trace(pipeline.engine, r.topic, r.partition, r.start + 3).rows.keys() >= {"entity_batches"}

    # Every record of the slice gone: the re-run keeps the lake's rows, and the steps after ingest run on them.
    delete_records_before(config, {(r.topic, r.partition): r.end for r in pipeline.manifest(K1).ranges if r.count})
    again = pipeline.run(K1)
    assert again.success
    meta = pipeline.materializations(again)
    assert "kept" in meta["entity_batches"] and meta["entity_batches"]["rows"] == rows.num_rows
    assert meta["dead_letters"]["rows"] == len(ranges)
    assert pipeline.read("entity_batches").num_rows == rows.num_rows
    assert pipeline.read("dead_letters").num_rows == len(ranges)
    assert "complete_responses" in meta and pipeline.read("entity_updates").num_rows == updates


def test_the_ranges_of_a_topic_deleted_before_the_slice_s_run_are_dead_letters(pipeline):
    """librdkafka tells a reader nothing of a partition that is no longer there: the read waited
    out its idle timeout, the run failed after its retries, and every later slice was refused."""
    pipeline.produce(traffic(40, seed=10))
    [r1] = pipeline.tick()
    topic = delete_topic(pipeline, STREAM)
    ranges = [r for r in pipeline.manifest(K1).ranges if r.topic == topic and r.count]
    run = pipeline.run_request(r1)
    assert run.success
    dead = pipeline.read("dead_letters").to_pylist()
    assert sorted((d["kafka_topic"], d["kafka_partition"], d["kafka_offset"], d["code"]) for d in dead) == sorted(
        (r.topic, r.partition, r.start, "EA-EXPIRED") for r in ranges)
    assert all(f"no longer holds offsets [{d['kafka_offset']}, " in d["reason"] for d in dead)
    assert pipeline.read("entity_batches").num_rows == 0


def test_a_span_gone_that_would_take_several_tasks_is_one_dead_letter(make_pipeline, delete_records_before):
    """The tasks of a slice split each range every `max_messages_per_task` offsets: a span Kafka no
    longer holds is one task, one EA-EXPIRED dead letter, not one per piece of offsets not there."""
    pipeline = make_pipeline(max_messages_per_task=10)
    pipeline.produce(traffic(200, seed=8))
    [r1] = pipeline.tick()
    ranges = [r for r in pipeline.manifest(K1).ranges if r.count > 30]
    assert ranges
    delete_records_before(pipeline.kafka.config(), {(r.topic, r.partition): r.start + 25 for r in ranges})
    assert pipeline.run_request(r1).success
    dead = pipeline.read("dead_letters").to_pylist()
    assert sorted((d["kafka_partition"], d["kafka_offset"], d["code"]) for d in dead) == sorted(
        (r.partition, r.start, "EA-EXPIRED") for r in ranges)
    assert all(f"[{d['kafka_offset']}, {d['kafka_offset'] + 25})" in d["reason"] for d in dead)
    assert pipeline.read("entity_batches").num_rows == 200 - 25 * len(ranges)


def test_a_re_run_after_a_failed_commit_keeps_the_tables_committed_and_fills_the_others(pipeline, delete_records_before,
                                                                                       monkeypatch):
    """A first run that failed between its tables' commits, then retention: the tables it committed
    keep their rows (their only copy); the others take what Kafka still holds, with a dead letter
    for each span gone, instead of staying empty."""
    pipeline.produce(traffic(40, seed=9) + [("connections", "jsmith", samples.encode(samples.SEED_CONNECTION))])
    [r1] = pipeline.tick()
    with monkeypatch.context() as patched:
        fail_commits(patched, "connections")
        assert not pipeline.run_request(r1, assets=ingest_only(pipeline), raise_on_error=False).success
    assert pipeline.read("entity_batches").num_rows == 40
    assert not pipeline.engine.reached("connections", K1, "replace_slice")

    batches = [r for r in pipeline.manifest(K1).ranges if r.count and r.topic == pipeline.topic(STREAM)]
    delete_records_before(pipeline.kafka.config(), {(r.topic, r.partition): r.end for r in batches})
    again = pipeline.run(K1, assets=ingest_only(pipeline))
    meta = pipeline.materializations(again)
    assert "kept" in meta["entity_batches"] and meta["entity_batches"]["rows"] == 40
    assert "kept" not in meta["connections"] and meta["connections"]["rows"] == 1
    assert pipeline.read("connections").column("user").to_pylist() == ["jsmith"]
    dead = pipeline.read("dead_letters").to_pylist()
    assert sorted((d["kafka_partition"], d["code"]) for d in dead) == sorted((r.partition, "EA-EXPIRED") for r in batches)
    assert meta["dead_letters"]["rows"] == len(batches)


def test_a_re_run_that_finds_other_records_at_the_slice_s_offsets_keeps_the_lake_rows(pipeline):
    """A topic deleted, created again and refilled past a slice's offsets: a re-run of the slice
    read as many records as its first run, but others, which would have replaced the lake's rows
    (and been read again by the next slices). Their Kafka timestamps tell them apart."""
    pipeline.produce(traffic(12, seed=21))
    [r1] = pipeline.tick()
    assert pipeline.run_request(r1).success
    before = sorted(pipeline.read("entity_batches").column("kafka_timestamp").to_pylist())
    create_again(pipeline, STREAM)
    time.sleep(0.01)  # other timestamps, as any later producer's
    pipeline.produce(traffic(12, seed=21))  # the same keys: as many records to each partition
    assert pipeline.end_offsets(STREAM) == {tp: end for tp, end in pipeline.manifest(K1).positions().items()
                                            if tp[0] == pipeline.topic(STREAM)}
    again = pipeline.run(K1, assets=ingest_only(pipeline))
    meta = pipeline.materializations(again)
    assert "Kafka holds other records at its offsets (12) than the 12 it read" in meta["entity_batches"]["kept"]
    assert sorted(pipeline.read("entity_batches").column("kafka_timestamp").to_pylist()) == before
    # the same once the commit that recorded the sum left the log: the rows' timestamps tell it
    from entity_assets.assets import ingest as ingest_asset

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(ingest_asset, "READ", "not-recorded")
        meta = pipeline.materializations(pipeline.run(K1, assets=ingest_only(pipeline)))
    assert "Kafka holds other records at its offsets (12) than the 12 it read" in meta["entity_batches"]["kept"]
    assert sorted(pipeline.read("entity_batches").column("kafka_timestamp").to_pylist()) == before


@pytest.mark.parametrize("in_the_log", [True, False], ids=["commit-in-the-log", "commit-expired"])
def test_a_re_run_that_reads_fewer_records_than_the_first_keeps_the_lake_rows(make_pipeline, monkeypatch, in_the_log):
    """A compacted topic drops a key's older records after the slice's first run, without moving
    its first offset: the re-run reads fewer records and no span is gone. The lake's rows are the
    only copy of those dropped, so they stay, also once lake maintenance expired the commit that
    recorded what the first run read (its rows replaced then). (Compaction is simulated by a read
    that skips one record: the small slice's tasks run in this process.)"""
    from entity_assets import ingest
    from entity_assets.assets import ingest as ingest_asset

    pipeline = make_pipeline(production_layout=True)
    pipeline.produce(traffic(30, seed=10))
    [r1] = pipeline.tick()
    assert pipeline.run_request(r1).success
    rows = pipeline.read("entity_batches")
    assert rows.num_rows == 30
    compacted = (rows.column("kafka_partition")[0].as_py(), rows.column("kafka_offset")[0].as_py())
    reading = ingest.read_range

    def read_compacted(config, r, **kwargs):
        return (m for m in reading(config, r, **kwargs) if (m.partition(), m.offset()) != compacted)

    monkeypatch.setattr(ingest, "read_range", read_compacted)
    if not in_the_log:  # no commit says what the first run read: expired from the log, or an older release's
        monkeypatch.setattr(ingest_asset, "READ", "not-recorded")
    again = pipeline.run(K1, assets=ingest_only(pipeline))
    meta = pipeline.materializations(again)
    assert "Kafka now holds 29 of its 30 records" in meta["entity_batches"]["kept"]
    assert pipeline.read("entity_batches").num_rows == 30


def test_a_re_run_after_re_runs_of_older_slices_still_knows_its_slice_was_ingested(make_pipeline, monkeypatch):
    """A rebuild or a backfill re-runs older slices after the newest one. Past the commits read back
    for it (`RECENT_COMMITS`, 2 here, 16 in production) a re-run must still know its slice as
    ingested before, or a compacted topic's fewer records replace the lake's rows."""
    from entity_assets import ingest
    from entity_assets.assets import common
    from entity_assets.assets import ingest as ingest_asset

    for module in (common, ingest_asset):
        monkeypatch.setattr(module, "RECENT_COMMITS", 2, raising=False)
    pipeline = make_pipeline(production_layout=True, max_messages=10)
    pipeline.produce(traffic(40, seed=12))
    assets = ingest_only(pipeline)
    requests = pipeline.tick()
    assert [r.partition_key for r in requests] == [slice_key(n) for n in (1, 2, 3, 4)]
    assert all(pipeline.run_request(r, assets=assets).success for r in requests)
    assert all(pipeline.run(slice_key(n), assets=assets).success for n in (1, 2))  # a backfill's first runs
    third = rows_of_slice(pipeline.read("entity_batches"), slice_key(3))
    compacted = (third.column("kafka_partition")[0].as_py(), third.column("kafka_offset")[0].as_py())
    reading = ingest.read_range

    def read_compacted(config, r, **kwargs):
        return (m for m in reading(config, r, **kwargs) if (m.partition(), m.offset()) != compacted)

    monkeypatch.setattr(ingest, "read_range", read_compacted)
    meta = pipeline.materializations(pipeline.run(slice_key(3), assets=assets))
    assert f"Kafka now holds {third.num_rows - 1} of its {third.num_rows} records" in meta["entity_batches"]["kept"]
    assert rows_of_slice(pipeline.read("entity_batches"), slice_key(3)).num_rows == third.num_rows


# --------------------------------------------------------------------------- bad input

def _batch(**changes) -> dict:
    return {**samples.SEED_ENTITY_BATCH, **changes}


OVERSIZE = samples.encode(_batch(patches=[{**samples.SEED_ENTITY_BATCH["patches"][0],
                                           "ops": [{"op": "add", "path": "blob", "value": "x" * 1_100_000}]}]))
BAD = {
    # key: (value, code, words the reason must contain)
    "bad/json": (b'{"clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd", "request": ', "GENERR007", ["JSON"]),
    "bad/missing": (samples.encode({k: v for k, v in samples.SEED_ENTITY_BATCH.items() if k != "user"}),
                    "GENERR001", ["user"]),
    "bad/type": (samples.encode(_batch(request="two")), "GENERR001", ["request"]),
    "bad/uuid": (samples.encode(_batch(clientid="not-a-uuid")), "GENERR010", ["clientid"]),
    # valid JSON, but no Delta long holds it: a dead letter, not a task crashed converting the row
    "bad/huge-int": (samples.encode(_batch(request=2**70)), "GENERR001", ["request", "less than or equal"]),
    "bad/oversize": (OVERSIZE, "EA-OVERSIZE", ["1000000"]),
    # not JSON, though pydantic-core reads it; and JSON that no double holds, which it reads as Infinity
    "bad/nan": (samples.encode(_batch()).replace(b'"Sally"', b"NaN"), "GENERR007", ["NaN"]),
    "bad/beyond-double": (samples.encode(_batch()).replace(b'"Sally"', b"1e400"), "GENERR001", ["double"]),
}


def test_a_dead_letter_keeps_its_record_s_headers(pipeline):
    """A producer's trace id and other headers stay with the record it sent, in their order, a
    repeated key and bytes that are no text included; `trace` shows them as text."""
    from confluent_kafka import Producer

    headers = [("traceparent", b"00-4bf92f3577b34da6-00f067aa0ba902b7-01"), ("bin", b"\xff\x00"),
               ("traceparent", b"again"), ("empty", None)]
    producer = Producer(pipeline.kafka.config())
    producer.produce(pipeline.topic(STREAM), key=b"traced", value=b'{"clientid": ', headers=headers, partition=0)
    producer.produce(pipeline.topic(STREAM), key=b"plain", value=b"[", partition=0)
    assert producer.flush(30) == 0
    [request] = pipeline.tick()
    assert pipeline.run_request(request, assets=ingest_only(pipeline)).success
    dead = {r["kafka_key"]: r for r in pipeline.read("dead_letters").to_pylist()}
    assert dead[b"traced"]["kafka_headers"] == [{"key": k, "value": v} for k, v in headers]
    assert dead[b"plain"]["kafka_headers"] is None
    shown = trace.trace(pipeline.engine, pipeline.topic(STREAM), 0, dead[b"traced"]["kafka_offset"])
    [letter] = shown.rows["dead_letters"]
    assert letter["kafka_headers"][0] == {"key": "traceparent", "value": headers[0][1].decode()}
    json.dumps(letter)  # as `trace --json` prints it


def test_bad_records_go_to_dead_letters_and_the_rest_is_written(pipeline):
    assert len(OVERSIZE) > 1_000_000
    seed = samples.seed_records()  # the seed's samples spell "db"
    good = traffic(150, seed=6) + [r for r in seed if r[0] == STREAM]
    other = [r for r in seed if r[0] != STREAM]  # valid records of the other input streams
    bad = [(STREAM, key, value) for key, (value, _, _) in BAD.items()]
    pipeline.produce(good[:70] + bad[:3] + good[70:] + bad[3:] + other)

    [request] = pipeline.tick()
    assert pipeline.manifest(request.partition_key).messages == len(good) + len(BAD) + len(other)
    result = pipeline.run_request(request, assets=ingest_only(pipeline))

    dead = pipeline.read("dead_letters")
    assert dead.num_rows == len(BAD)
    assert_unique_coordinates(dead)
    for row in dead.to_pylist():
        value, code, words = BAD[row["kafka_key"].decode()]
        assert row["code"] == code, row["reason"]
        assert row["value"] == value  # the original bytes
        assert row["stream"] == STREAM and row["slice"] == request.partition_key
        assert row["kafka_topic"] == pipeline.topic(STREAM) and row["kafka_partition"] is not None
        assert row["kafka_offset"] is not None and row["kafka_timestamp"]
        assert row["reason"] and all(w in row["reason"] for w in words), row["reason"]

    batches = pipeline.read("entity_batches")
    assert sorted((r["clientid"], r["request"]) for r in batches.to_pylist()) == sorted(by_request(good))
    seeded = [r for r in batches.to_pylist() if r["clientid"] == samples.SEED_CLIENT]
    assert [r["dbid"] for r in seeded] == ["my-db"]
    for stream, n in Counter(r[0] for r in other).items():
        rows = pipeline.read(INPUT_STREAMS[stream].table)
        assert rows.num_rows == n and set(rows.column("dbid").to_pylist()) == {"my-db"}, stream
    # good and bad records of the slice, each exactly once, none lost
    assert sorted(coordinates(batches) + coordinates(dead)) == sorted(
        (pipeline.topic(STREAM), r["partition"], r["offset"]) for r in pipeline.consume(STREAM))

    meta = pipeline.materializations(result)
    assert meta["entity_batches"]["rows"] == len(good)
    assert meta["entity_batches"]["dead_letters"] == len(BAD)
    assert meta["dead_letters"]["rows"] == len(BAD)
    # the UI's warning on the slice, counting its dead letters by stream and code
    [check] = result.get_asset_check_evaluations()
    assert check.check_name == "no_dead_letters" and not check.passed and check.severity == AssetCheckSeverity.WARN
    assert check.metadata["lost_or_unforeseen"].value == 0
    assert check.metadata["by_stream_and_code"].value == dict(Counter(f"{STREAM} {code}" for _, code, _ in BAD.values()))

    # a dead letter's trail (entity-assets trace): its code and reason, in its slice, nowhere else
    row = dead.to_pylist()[0]
    trail = trace.trace(pipeline.engine, row["kafka_topic"], row["kafka_partition"], row["kafka_offset"])
    assert trail.slice == request.partition_key and list(trail.rows) == ["dead_letters"]
    [shown] = trail.rows["dead_letters"]
    assert (shown["code"], shown["reason"], shown["stream"]) == (row["code"], row["reason"], STREAM)
    assert f"dead_letters          stream={STREAM} code={row['code']}" in trace.format_trail(trail)

    pipeline.run(request.partition_key, assets=ingest_only(pipeline))  # a re-run rewrites the dead letters too
    assert pipeline.read("dead_letters").num_rows == len(BAD)
    assert pipeline.read("entity_batches").num_rows == len(good)


# --------------------------------------------------------------------------- sensor -> run -> materialization

def test_sensor_run_request_materializes_its_partition(pipeline):
    records = traffic(40, seed=8)
    pipeline.produce(records)
    [request] = pipeline.tick()
    key = request.partition_key
    assert pipeline.instance.has_dynamic_partition("slices", key)

    result = pipeline.run_request(request)
    run = pipeline.instance.get_run_by_id(result.run_id)
    assert run.status == DagsterRunStatus.SUCCESS
    assert run.job_name == "slice_job"
    assert run.tags["dagster/partition"] == key and run.tags["dagster/run_key"] == request.run_key
    assert run.tags["entity-assets/messages"] == str(len(records))  # the slice's size, in the runs list

    asset = AssetKey("entity_batches")
    records = pipeline.instance.fetch_materializations(asset, limit=10).records
    assert [r.asset_materialization.partition for r in records] == [key]
    assert records[0].run_id == result.run_id
    latest = pipeline.instance.get_latest_materialization_event(asset)
    assert latest.asset_materialization.partition == key
    assert latest.asset_materialization.metadata["rows"].value == 40
    assert pipeline.instance.get_materialized_partitions(asset) == {key}
    # every asset of the job materialized this partition
    job = pipeline.defs.resolve_job_def("slice_job")
    for asset_key in job.asset_layer.executable_asset_keys:
        assert pipeline.instance.get_materialized_partitions(asset_key) == {key}, asset_key


def _lag(pipeline, stream: str = STREAM) -> list[dict]:
    """The lag observations of an input topic's asset, oldest first, as plain values."""
    records = pipeline.instance.fetch_observations(AssetKey(["kafka", stream]), limit=100).records
    return [{k: v.value for k, v in r.asset_observation.metadata.items()} for r in reversed(records)]


def _committed(pipeline, stream: str = STREAM) -> dict[tuple[str, int], int]:
    """The offsets of the slices' consumer group on a stream's topic."""
    from confluent_kafka import ConsumerGroupTopicPartitions

    admin = AdminClient(pipeline.kafka.config())
    [future] = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions("entity-assets-slices")]).values()
    return {(tp.topic, tp.partition): tp.offset for tp in future.result(10).topic_partitions
            if tp.topic == pipeline.topic(stream) and tp.offset >= 0}


def test_the_sensor_observes_how_far_the_lake_is_behind_kafka_and_commits_each_slice_done(pipeline, monkeypatch):
    """The UI plots each input topic's lag; Kafka's own lag tools read the slices' consumer
    group, whose offsets are those of the last slice the lake's state holds."""
    from entity_assets import sensors

    holds = sensors.lake_holds
    pipeline.produce(traffic(30, seed=21))
    produced = sum(pipeline.end_offsets().values())
    [request] = pipeline.tick()
    [closed] = _lag(pipeline)
    assert closed["lag"] == produced and closed["slices_not_done"] == 1 and "last_slice_done" not in closed
    assert _committed(pipeline) == {}  # nothing done yet

    pipeline.run_request(request)
    assert pipeline.tick() == []
    done = _lag(pipeline)[-1]
    assert done == {"lag": 0, "seconds_behind": 0.0, "slices_not_done": 0, "last_slice_done": K1}
    slice_1 = {tp: end for tp, end in pipeline.manifest(1).positions().items() if tp[0] == pipeline.topic(STREAM)}
    assert _committed(pipeline) == slice_1
    looks = []
    monkeypatch.setattr(sensors, "lake_holds", lambda *a, **k: looks.append(a) or holds(*a, **k))
    pipeline.tick()
    assert len(_lag(pipeline)) == 2 and looks == []  # nothing changed: nothing observed, no state table read

    pipeline.produce(traffic(5, seed=22))
    assert len(pipeline.tick()) == 1
    behind = _lag(pipeline)[-1]
    assert behind["lag"] == 5 and behind["slices_not_done"] == 1 and behind["last_slice_done"] == K1
    assert 0 <= behind["seconds_behind"] < 60  # since slice 2, the oldest not done, closed
    pipeline.tick()
    assert len(_lag(pipeline)) == 3
    monkeypatch.setattr(sensors, "LAG_EVERY", 0)  # a lake still behind is observed again, later
    pipeline.tick()
    again = _lag(pipeline)[-1]
    assert again["lag"] == 5 and again["seconds_behind"] >= behind["seconds_behind"]
    assert _committed(pipeline) == slice_1  # slice 2 is not done


def test_a_commit_the_cluster_refuses_is_tried_again_later_and_the_tick_goes_on(pipeline, monkeypatch, capfd):
    from entity_assets import kafka_io, sensors

    attempts, refused = [], [True]

    def commit(config, positions, timeout=10.0):
        attempts.append(positions)
        if refused:
            raise kafka_io.OffsetsNotCommitted("group entity-assets-slices: Broker: Group authorization failed")
        return "entity-assets-slices"

    monkeypatch.setattr(kafka_io, "commit_offsets", commit)
    pipeline.produce(traffic(10, seed=23))
    pipeline.tick_and_run()
    assert pipeline.tick() == [] and pipeline.tick() == []
    assert len(attempts) == 1  # not at every tick
    said = capfd.readouterr().err
    assert said.count("Group authorization failed") == 1 and "ENTITY_ASSETS_KAFKA_COMMIT_OFFSETS=false" in said
    assert _lag(pipeline)[-1]["last_slice_done"] == K1
    monkeypatch.setattr(sensors, "LAG_EVERY", 0)  # later: tried again
    refused.clear()
    pipeline.tick()
    pipeline.tick()
    assert len(attempts) == 2 and attempts[0] == attempts[1]  # then done, not again


def test_a_lag_report_that_fails_is_a_warning_and_the_slices_go_on(pipeline, monkeypatch, capfd):
    from entity_assets import sensors

    def broken(*args):
        raise RuntimeError("a report's bug")

    monkeypatch.setattr(sensors, "read_to", broken)
    pipeline.produce(traffic(10, seed=24))
    [run] = pipeline.tick_and_run()
    assert run.success
    assert "lag not reported: RuntimeError: a report's bug" in capfd.readouterr().err


def test_a_tick_that_loses_a_race_for_its_slice_commits_nothing(pipeline, monkeypatch):
    """Two ticks at once (the daemon's and `entity-assets run`'s): the sensor reads the manifests
    as of its first look, and the one that commits second is refused by Delta's conflict check
    on the manifests' app transaction, so no slice is closed twice."""
    from deltalake.exceptions import CommitFailedError

    from entity_assets import sensors

    pipeline.produce(traffic(20, seed=9))
    plan, raced = sensors.plan_slices, []

    def plan_after_another_tick(*args, **kwargs):
        if not raced:
            raced.append(True)
            pipeline.tick()  # the other tick closes the same offsets as slice 1 in the meantime
        return plan(*args, **kwargs)

    monkeypatch.setattr(sensors, "plan_slices", plan_after_another_tick)
    cursor = pipeline.cursor
    with pytest.raises(CommitFailedError):
        sensor = pipeline.defs.resolve_sensor_def("kafka_offsets_sensor")
        with build_sensor_context(instance=pipeline.instance, cursor=cursor, resources=pipeline.resources) as context:
            sensor(context)
    manifests = pipeline.read("slice_manifests")
    assert set(manifests.column("seq").to_pylist()) == {1}
    assert manifests.num_rows == len(pipeline.manifest(1).positions())  # a row per topic partition, once
    assert pipeline.tick() == []  # the next tick finds slice 1 requested and nothing new
    # a record of the closed slice, before its run: trace names the slice and finds no row yet
    first = pipeline.consume(STREAM)[0]
    trail = trace.trace(pipeline.engine, pipeline.topic(STREAM), first["partition"], first["offset"])
    assert trail.slice == K1 and trail.rows == {}
    assert "its slice has not run yet" in trace.format_trail(trail)
    # a step of the slice not run yet, further down: the trail says which
    assert pipeline.run(K1, assets=[*ingest_only(pipeline), *pipeline.asset_keys_of("entity_patches")]).success
    trail = trace.trace(pipeline.engine, pipeline.topic(STREAM), first["partition"], first["offset"])
    assert "entity_patches" in trail.rows and trail.notes == ["partial_responses: its slice's step has not run yet"]


def test_a_new_instance_over_a_lake_runs_on_from_the_slices_the_lake_holds(make_pipeline, tmp_path):
    """From SQLite to Postgres, or a new DAGSTER_HOME: a new instance has run none of the slices
    the lake holds. It takes those as done and runs the new ones, not every slice again; and a
    lake restored behind them later runs them again, as slices the instance ran."""
    import shutil

    first = make_pipeline(production_layout=True, max_messages=20)
    first.produce(traffic(50, seed=13))
    runs = first.tick()
    assert [first.run_request(r).success for r in runs[:2]] == [True, True]
    shutil.copytree(first.lake.root, tmp_path / "backup")  # the lake as of slice 2
    assert first.run_request(runs[2]).success
    first.produce(traffic(10, seed=14))
    moved = make_pipeline(production_layout=True, prefix=first.prefix, lake_root=first.lake.root, max_messages=20)
    assert moved.instance is not first.instance
    requests = moved.tick()
    assert [r.partition_key for r in requests] == [slice_key(4)]
    assert moved.run_request(requests[0]).success
    assert rows_of_slice(moved.read("entity_batches"), slice_key(4)).num_rows == 10
    assert moved.tick() == []
    shutil.rmtree(first.lake.root)
    shutil.copytree(tmp_path / "backup", first.lake.root)  # restored behind the slices taken as done
    again = moved.tick()
    assert [r.partition_key for r in again] == [slice_key(3), slice_key(4)]  # slice 3 once lacked a request
    assert all(moved.run_request(r).success for r in again)
    assert moved.tick() == []


def test_a_run_without_a_manifest_fails_clearly(pipeline):
    pipeline.instance.add_dynamic_partitions("slices", [slice_key(9)])
    result = pipeline.run(slice_key(9), assets=ingest_only(pipeline), raise_on_error=False)
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    assert "slice 0000000009 has no manifest" in pipeline.failure_text(failure)


def test_a_tick_on_a_cluster_without_an_input_topic_says_so(broker, tmp_path):
    """A mistyped prefix (`acme.prod` without its dot) or another cluster: not an idle pipeline."""
    from dagster import DagsterInstance

    from entity_assets.definitions import defs
    from resources import KafkaResource, LakeResource, SlicingResource

    sensor = defs.resolve_sensor_def("kafka_offsets_sensor")
    resources = {"kafka": KafkaResource(bootstrap_servers=broker.bootstrap, topic_prefix="no-such-prefix."),
                 "lake": LakeResource(root=str(tmp_path)), "slicing": SlicingResource()}
    with build_sensor_context(instance=DagsterInstance.ephemeral(), resources=resources) as context:
        result = sensor(context)
    said = result.skip_reason.skip_message
    assert said.startswith("no slice closed (0 messages pending); Kafka at ") and "has no input topic" in said
    assert "no-such-prefix.entity-batches" in said


def test_a_tick_without_an_answer_from_kafka_fails_naming_the_servers_it_asked(tmp_path, capfd):
    """librdkafka's "Failed to get metadata" names no server: the tick's error must, with the
    cause librdkafka logged, which it would otherwise print ten times a second."""
    from dagster import DagsterInstance

    from entity_assets.definitions import defs
    from entity_assets.kafka_io import KafkaUnreachable
    from entity_assets.manifests import ManifestStore
    from resources import KafkaResource, LakeResource, SlicingResource

    sensor = defs.resolve_sensor_def("kafka_offsets_sensor")
    resources = {"kafka": KafkaResource(bootstrap_servers="127.0.0.1:1"), "lake": LakeResource(root=str(tmp_path)),
                 "slicing": SlicingResource()}
    with build_sensor_context(instance=DagsterInstance.ephemeral(), resources=resources) as context:
        with pytest.raises(KafkaUnreachable, match=r"Kafka at 127\.0\.0\.1:1 gave no metadata .*Connection refused"):
            sensor(context)
    assert "Connect to ipv4#127.0.0.1:1 failed" not in capfd.readouterr().err
    assert ManifestStore(resources["lake"].open()).latest_seq() == 0  # nothing closed
