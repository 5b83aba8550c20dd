"""The lake on object storage. An S3 endpoint on 127.0.0.1 (moto's server: the S3 API over HTTP,
as MinIO or any S3-compatible store serves it), or Azure's storage emulator (Azurite, which
`scripts/setup.sh --test` installs from npm), holds the lake: Spark tasks write and read its
data files, delta-rs commits them, the slice manifests and the outbox live there too, each
through `LakeResource.storage_options` alone, or (the slow test) through the environment alone."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from entity_assets import history, samples, trace
from entity_assets.assets.ingest import TABLES as INGESTED
from entity_assets.kafka_io import ensure_topics
from entity_assets.slices import slice_key
from entity_assets.local_stores import AZURITE, LatencyProxy, LocalAzurite, LocalS3
from entity_assets.storage import AZURITE_KEY, FileWriter, TableFile, filesystem, read_files, read_table
from entity_assets.tables import SCHEMAS
from resources import LakeResource

BUCKET = "entity-lake"


def _client(options: dict[str, str]):
    return boto3.client("s3", endpoint_url=options["AWS_ENDPOINT_URL"], region_name=options["AWS_REGION"],
                        aws_access_key_id=options["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=options["AWS_SECRET_ACCESS_KEY"])


@pytest.fixture
def s3_options(tmp_path, free_port):
    """The storage options of a lake in a fresh bucket of a local S3 endpoint, stopped by its pid after the test."""
    server = LocalS3(tmp_path / "s3", port=free_port())
    server.start(timeout=60)
    try:
        options = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "entity-assets",
                   "AWS_SECRET_ACCESS_KEY": "not-a-secret", "AWS_REGION": "eu-west-1", "AWS_ALLOW_HTTP": "true"}
        _client(options).create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": options["AWS_REGION"]})
        yield options
    finally:
        server.stop()


@pytest.fixture
def azure_options(tmp_path, free_port):
    """The storage options of a lake in a fresh container of a local Azurite, stopped by its pid after the test."""
    if not AZURITE.exists():
        said = f"no Azurite at {AZURITE}: `bash scripts/setup.sh --test` installs it (needs npm)"
        if os.environ.get("CI"):  # .ci/run: the Azure lake must be checked, not skipped
            pytest.fail(said)
        pytest.skip(said)
    server = LocalAzurite(tmp_path / "azurite", port=free_port())
    assert "--disableTelemetry" in server.command()  # else it sends usage to Azure Monitor, off this machine
    server.start(timeout=60)
    try:
        options = {"azure_storage_account_name": "devstoreaccount1", "azure_storage_account_key": AZURITE_KEY,
                   "azure_storage_endpoint": server.endpoint, "azure_allow_http": "true"}
        fs, _ = filesystem(f"az://{BUCKET}", options)
        fs.create_dir(BUCKET)
        yield options
    finally:
        server.stop(timeout=2)  # it waits out the clients' kept-alive connections; held in memory, nothing is lost


@pytest.fixture(params=["s3", "azure"])
def object_lake(request, no_aws_environment) -> tuple[str, dict[str, str]]:
    """The root and storage options of a lake in a local S3 bucket or Azure container, with no
    `AWS_*` or `AZURE_*` variable in the environment."""
    if request.param == "s3":
        return f"s3://{BUCKET}/entity-assets", request.getfixturevalue("s3_options")
    return f"az://{BUCKET}/entity-assets", request.getfixturevalue("azure_options")


@pytest.fixture
def no_aws_environment(monkeypatch):
    """No `AWS_*` or `AZURE_*` variable in this process: the store's endpoint and credentials can
    come from the options alone."""
    for var in [v for v in os.environ if v.startswith(("AWS_", "AZURE_", "AZURITE_"))]:
        monkeypatch.delenv(var)


def test_task_files_reach_the_store_through_the_lake_options_alone(s3_options, no_aws_environment, monkeypatch):
    fs, path = filesystem(f"s3a://{BUCKET}/lake/entities/part-1.parquet", s3_options)
    assert path == f"{BUCKET}/lake/entities/part-1.parquet"
    with fs.open_output_stream(path) as sink:
        sink.write(b"PAR1")
    again, _ = filesystem(f"s3://{BUCKET}/lake/other", dict(reversed(s3_options.items())))
    assert again is fs  # one filesystem per set of options in a process, whatever their order
    with again.open_input_stream(path) as source:
        assert source.read() == b"PAR1"
    # options that concern the Delta log only leave the files' endpoint and credentials to the environment
    for name, value in s3_options.items():
        monkeypatch.setenv(name, value)
    from_env, _ = filesystem(f"s3://{BUCKET}/lake/entities/part-1.parquet", {"AWS_S3_ALLOW_UNSAFE_RENAME": "true"})
    with from_env.open_input_stream(path) as source:
        assert source.read() == b"PAR1"


@pytest.mark.parametrize("upload_bytes", [None, 1], ids=["default", "one-at-a-time"])
def test_task_files_upload_in_threads_come_back_in_written_order_and_a_failed_upload_fails_the_close(
        s3_options, no_aws_environment, monkeypatch, upload_bytes):
    from entity_assets import storage

    if upload_bytes:  # rows bigger than the bound: each upload waits for the one before it
        monkeypatch.setattr(storage, "UPLOAD_BYTES", upload_bytes)

    def writer(bucket: str) -> FileWriter:
        return FileWriter("entities", f"s3://{bucket}/lake/entities", SCHEMAS["entities"], "0000000001",
                          storage_options=s3_options)

    files = writer(BUCKET)
    for i in range(20):  # more than the uploads a writer keeps in flight
        files.write_table(pa.Table.from_pylist([{"slice": "0000000001", "entity": f"e{i}"}] * (i + 1), SCHEMAS["entities"]),
                          tag=f"t{i:02d}")
    written = files.close()
    assert [f.path.split("-")[2] for f in written] == [f"t{i:02d}" for i in range(20)]
    for i, f in enumerate(written):
        table = read_table(f"s3://{BUCKET}/lake/entities/{f.path}", s3_options)
        assert f.rows == table.num_rows == i + 1 and set(table.column("entity").to_pylist()) == {f"e{i}"}

    lost = writer("no-such-bucket")
    lost.write_table(pa.Table.from_pylist([{"slice": "0000000001", "entity": "e"}], SCHEMAS["entities"]))
    with pytest.raises(OSError):
        lost.close()


def test_files_read_ahead_whole_or_streamed_give_their_rows_in_order(s3_options, no_aws_environment, monkeypatch):
    from entity_assets import storage

    files = FileWriter("entities", f"s3://{BUCKET}/lake/entities", SCHEMAS["entities"], "0000000001",
                       storage_options=s3_options)
    for i in range(6):
        files.write_table(pa.Table.from_pylist([{"slice": "0000000001", "entity": f"e{i}-{j}"} for j in range(50)],
                                               SCHEMAS["entities"]))
    written = [TableFile(f.path, f"s3://{BUCKET}/lake/entities/{f.path}", f.size, f.rows) for f in files.close()]
    expected = [f"e{i}-{j}" for i in range(6) for j in range(50)]
    sizes = sorted(f.size for f in written)
    monkeypatch.setattr(storage, "SMALL_FILE_BYTES", sizes[2])  # some read whole ahead, the others streamed
    batches = list(read_files(written, s3_options, batch_size=20, columns=["entity"]))
    assert max(b.num_rows for b in batches) == 20
    assert [e for b in batches for e in b.column("entity").to_pylist()] == expected


def test_the_latency_proxy_of_the_benches_holds_each_request_and_passes_what_it_carries(s3_options, tmp_path, free_port):
    target = int(s3_options["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    proxy = LatencyProxy(tmp_path / "proxy", port=free_port(), target=target, rtt_ms=300,
                         log=str(tmp_path / "requests.log"))
    proxy.start(timeout=30)
    try:
        client = _client({**s3_options, "AWS_ENDPOINT_URL": proxy.endpoint})
        for _ in range(2):  # a new connection, then a request on a kept-alive one
            started = time.monotonic()
            assert [b["Name"] for b in client.list_buckets()["Buckets"]] == [BUCKET]
            assert time.monotonic() - started >= 0.3
    finally:
        proxy.stop()
    requests = (tmp_path / "requests.log").read_text().splitlines()
    assert len(requests) == 2 and all(r.split(" ", 2)[2].startswith("GET / HTTP/1.1") for r in requests)


def _traffic() -> list:
    traffic = samples.GraphTraffic(samples.BatchTraffic(patches=160, entities=40, learning=True), devices=4)
    return [*traffic.records(), *(("entity-batches", f"bad/{i}", v) for i, (_, v) in enumerate(samples.BAD_VALUES))]


def test_azure_files_use_the_account_and_endpoint_of_the_options_or_of_the_uri(no_aws_environment, monkeypatch):
    fs, path = filesystem("abfss://lake@acct.dfs.core.windows.net/entity-assets/t/part-1.parquet",
                          {"AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY})
    assert isinstance(fs, pafs.AzureFileSystem) and path == "lake/entity-assets/t/part-1.parquet"
    # the emulator's account, key and address come with use_emulator, as in delta-rs
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", "http://127.0.0.1:1")
    emulated, path = filesystem("az://lake/entity-assets", {"use_emulator": "true"})
    assert path == "lake/entity-assets" and emulated is filesystem("azure://lake", {"USE_EMULATOR": "true"})[0]
    with pytest.raises(ValueError, match="storage account"):
        filesystem("az://lake/entity-assets", {"azure_storage_account_key": AZURITE_KEY})


def _credential(storage_options: dict[str, str]) -> dict[str, str]:
    """The credential arguments of an Azure lake's filesystem (made without a request to Azure)."""
    made = filesystem("abfss://lake@acct.dfs.core.windows.net/lake", storage_options)[0].__reduce__()[1][0]
    return {k: made[k] for k in ("account_key", "sas_token", "client_id", "client_secret", "tenant_id") if made[k]}


def test_azure_files_take_one_credential_the_options_before_the_environment(no_aws_environment, monkeypatch):
    # AKS workload identity: ids and a token file, no secret, which pyarrow's default chain reads
    for name, value in {"AZURE_CLIENT_ID": "app", "AZURE_TENANT_ID": "tenant",
                        "AZURE_FEDERATED_TOKEN_FILE": "/var/run/secrets/azure/tokens/token"}.items():
        monkeypatch.setenv(name, value)
    assert _credential({}) == {}
    assert _credential({"AZURE_STORAGE_SAS_KEY": "sv=1"}) == {"sas_token": "sv=1"}
    assert _credential({"client_secret": "s"}) == {"client_id": "app", "client_secret": "s", "tenant_id": "tenant"}
    monkeypatch.delenv("AZURE_FEDERATED_TOKEN_FILE")
    assert _credential({}) == {"client_id": "app"}  # a user-assigned managed identity
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY)
    assert _credential({}) == {"account_key": AZURITE_KEY}
    assert _credential({"sas_token": "sv=1"}) == {"sas_token": "sv=1"}


def test_a_lake_on_object_storage_holds_what_a_local_lake_holds(make_pipeline, object_lake, lake_rows,
                                                                delete_records_before):
    root, options = object_lake
    records = [*_traffic(), *samples.CdcTraffic(rows=10).records()]  # with CDC ingestion topics, Qlik's too
    local = make_pipeline(max_messages=120)
    remote = make_pipeline(max_messages=120, prefix=local.prefix,  # the same input topics, read at the same points
                           lake_root=root, storage_options=options)
    ensure_topics(local.kafka.config(), [local.topic(s) for s in samples.CDC_STREAMS], 2)
    local.produce(records)
    local_runs, remote_runs = local.tick_and_run(), remote.tick_and_run()
    assert len(remote_runs) == len(local_runs) >= 2 and all(r.success for r in local_runs + remote_runs)

    tables = lake_rows(remote.lake)
    assert tables == lake_rows(local.lake)
    assert len(tables["dead_letters"]) == len(samples.BAD_VALUES) and tables["device_notifications"]
    assert len(tables["avro_schemas"]) == 1
    assert sum("hr.employees.ingestion" in r for r in tables["entity_batches"]) == 10 * 3 + 1
    # row-level lineage (entity-assets trace) reads the same trail from either lake
    note = local.read("changes_by_device").to_pylist()[0]
    at = (note["kafka_topic"], note["kafka_partition"], note["kafka_offset"])
    trail = trace.trace(remote.engine, *at)
    assert trail.rows["changes_by_device"] and trail.inboxes and trail.states["entities"] and trail == trace.trace(local.engine, *at)
    # and the same entity history and changes of a state
    key = tuple(note[c] for c in ("dbid", "collection", "zone", "entity"))
    assert history.entity_history(remote.engine, *key) == history.entity_history(local.engine, *key) != []
    def changed(pipeline):
        return sorted(json.dumps(r, sort_keys=True) for t in pipeline.engine.changes("entities", "0000000001")
                      for r in t.to_pylist())

    assert changed(remote) == changed(local) != []
    fs, folder = filesystem(root, options)
    sizes = {info.path.removeprefix(f"{folder}/"): info.size
             for info in fs.get_file_info(pafs.FileSelector(folder, recursive=True)) if info.is_file}
    keys = list(sizes)
    assert any(k.startswith("entity_updates/part-") for k in keys)
    # the Delta log gives each data file the size the store has for it
    engine = remote.engine
    committed = {f"{t}/{f.path}": f.size for t in tables for f in engine.files(t)}
    assert committed and all(sizes[k] == n for k, n in committed.items())
    # the held Qlik data messages' files were rewritten and deleted
    assert not [k for k in keys if k.startswith("schema_waits/part-") and k not in committed]
    assert any(k.startswith("slice_manifests/_delta_log/") for k in keys)
    # every message published: no spool is left in the outbox
    assert not [k for k in keys if k.endswith(".spool")]
    # lake maintenance (vacuum, log expiry) works there too; nothing is old enough to delete
    from entity_assets.maintenance import lake_maintenance

    assert lake_maintenance.execute_in_process(resources={"lake": remote.lake}).success
    assert lake_rows(remote.lake) == tables

    # Kafka drops the first slice's records: its re-run keeps the rows and leaves no file behind
    delete_records_before(local.kafka.config(), {(r.topic, r.partition): r.end
                                                 for r in remote.manifest(1).ranges if r.count})
    again = remote.run(slice_key(1), assets=remote.asset_keys_of("entity_batches"))
    assert again.success and "kept" in remote.materializations(again)["entity_batches"]
    assert lake_rows(remote.lake) == tables
    now = {f"{t}/{f.path}" for t in INGESTED for f in remote.engine.files(t)}
    assert not [path for info in fs.get_file_info(pafs.FileSelector(folder, recursive=True))
                if info.is_file and (path := info.path.removeprefix(f"{folder}/")).split("/part-")[0] in INGESTED
                and "/part-" in path and path not in now]


@pytest.mark.slow
def test_the_cli_runs_on_a_lake_on_object_storage_with_the_environment_alone(broker, make_pipeline, object_lake,
                                                                            lake_rows, tmp_path):
    """`entity-assets run` as a deployment runs it: `ENTITY_ASSETS_LAKE` names the bucket or
    container and the store's standard variables (`AWS_*`, `AZURE_*`; no storage options) reach
    delta-rs and the Spark workers' files."""
    root, options = object_lake
    local = make_pipeline(max_messages=120)
    local.produce(_traffic())
    assert all(r.success for r in local.tick_and_run())
    env = {**{k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}, **{k.upper(): v for k, v in options.items()},
           "AWS_EC2_METADATA_DISABLED": "true", "ENTITY_ASSETS_HOME": str(tmp_path / "home"),
           "ENTITY_ASSETS_LAKE": root, "ENTITY_ASSETS_KAFKA_BOOTSTRAP": broker.bootstrap,
           "ENTITY_ASSETS_TOPIC_PREFIX": local.prefix, "ENTITY_ASSETS_SLICE_INTERVAL_SECONDS": "0",
           "ENTITY_ASSETS_SLICE_MAX_MESSAGES": "120", "ENTITY_ASSETS_SLICE_MAX_PER_TASK": "1000",
           "ENTITY_ASSETS_SPARK_MASTER": "local[2]", "ENTITY_ASSETS_SPARK_DRIVER_ROWS": "0"}
    done = subprocess.run([str(Path(sys.executable).parent / "entity-assets"), "run"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert lake_rows(LakeResource(root=root, storage_options=options)) == lake_rows(local.lake)
    # a lake of its own, runs in the project's instance: a daemon's runs elsewhere are not waited for
    assert "if a daemon runs this lake's slices, set DAGSTER_HOME to its instance" in done.stderr
    summary = subprocess.run([str(Path(sys.executable).parent / "entity-assets"), "summary"], env=env,
                             capture_output=True, text=True, timeout=120)
    rows = {line.split()[0]: int(line.split()[1]) for line in summary.stdout.splitlines()[1:]}
    assert summary.returncode == 0 and rows["entity_batches"] == local.engine.row_count("entity_batches") > 0
    assert rows["slice_manifests"] > 0 and "entities" in rows, summary.stdout
