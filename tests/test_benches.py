"""The benches still run: each at a small N, to its machine-readable last line.

Their figures are read by people (bench/README.md), never asserted here; what is checked is that
a change to the code did not break a bench, and that the last line carries the keys the README
documents. Each bench starts its own broker and SparkSession, so these are marked slow.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def bench(args: list[str], timeout: float = 200) -> subprocess.CompletedProcess:
    """A bench run, ended as Ctrl-C would past `timeout`: it stops the broker it started, which a
    kill (subprocess.run's timeout) would leave running in a session of its own. The test's own
    timeout (300 s) would end the test first, the bench left running."""
    with subprocess.Popen([sys.executable, str(REPO / "bench" / args[0]), *args[1:]], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                out, err = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
            pytest.fail(f"{args[0]} ran past {timeout:g} s: {err[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.mark.slow
@pytest.mark.parametrize(("args", "keys"), [
    (["bench_ingest.py", "--n", "5000"], {"n", "per_s", "rows", "dead", "peak_driver_mb"}),
    (["bench_ingest.py", "--n", "3100", "--cdc", "debezium"], {"n", "per_s", "rows", "dead", "cdc"}),
    (["bench_ingest.py", "--n", "3100", "--cdc", "qlik", "--schema-topic", "named"],
     {"n", "per_s", "rows", "dead", "cdc", "schema_topic"}),
    (["bench_pipeline.py", "--n", "5000"], {"n", "per_s", "reference_per_s", "ratio", "peak_driver_mb", "fixed_100_s"}),
    (["bench_pipeline.py", "--n", "5000", "--graph", "--devices", "100"],
     {"n", "per_s", "reference_per_s", "ratio", "peak_driver_mb", "fixed_100_s", "graph", "devices",
      *(f"{step}_s" for step in ("ingest", "devices", "entity_patches", "apply_patches", "learn_schemas",
                                 "zone_changes", "changes_by_device", "device_notifications"))}),
    (["bench_floor.py", "--n", "5000"], {"n", "reference_per_s", "ceiling", "floor_cpu_s", "publish_broker_cpu_s"}),
    (["bench_floor.py", "--n", "5000", "--graph", "--devices", "100"], {"n", "ceiling", "graph", "devices", "published"}),
    (["bench_slices.py", "--n", "2000", "--slices", "1"], {"n", "median_s", "rewritten_rows", "peak_driver_mb"}),
    (["bench_tasks.py", "--n", "2000", "--rounds", "1"], {"n", "explode_us", "fold_us", "copy_us"}),
    (["bench_commits.py", "--n", "50", "--commits", "2"], {"n", "log_files", "engine_ms", "default_ms"}),
], ids=["ingest", "ingest-cdc", "ingest-qlik-schema-topic", "pipeline", "pipeline-graph", "floor", "floor-graph",
        "slices", "tasks", "commits"])
def test_a_bench_runs_to_its_key_value_line(args, keys):
    done = bench(args)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(pair.split("=", 1) for pair in done.stdout.strip().splitlines()[-1].split())
    assert keys <= figures.keys(), sorted(figures)
    assert int(figures["n"]) - int(args[args.index("--n") + 1]) == ("qlik" in args)  # and its metadata message


@pytest.mark.slow
def test_the_pipeline_bench_runs_on_a_cluster_and_leaves_none_of_its_topics(broker):
    """`--cluster`: the bench's topics on a broker it did not start (here the session's), under a
    prefix of their own, deleted at the end; the last line says which broker it measured."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    before = set(admin.list_topics(timeout=30).topics)
    done = bench(["bench_pipeline.py", "--n", "2000", "--cluster", broker.bootstrap])
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(pair.split("=", 1) for pair in done.stdout.strip().splitlines()[-1].split())
    assert figures["broker"] == "cluster" and figures["n"] == "2000"
    assert "deleted" in done.stdout and "topics entity-assets-bench-" in done.stdout
    deadline = time.monotonic() + 30  # a broker may list a deleted topic for a moment
    while (left := set(admin.list_topics(timeout=30).topics) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left
