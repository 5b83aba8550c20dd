"""Spark's Python worker daemon, started warm (`spark.python.daemon.module`, local masters).

Spark puts its `pyspark.zip` first on the workers' path, and Python keeps no bytecode for zip
imports, so every forked worker compiled pyspark's worker modules again, and then imported the
task modules (pyarrow, pydantic, confluent-kafka): over a second per worker, paid by the first
tasks of every run. This daemon puts the same pyspark, installed in site-packages with its
bytecode, first, and imports the worker and the task modules once before it forks workers.
It keeps them for the server's life: a server started before an upgrade would run the old code,
so `spark start` restarts it and runs refuse it (entity_assets/spark_connect.py).
pyarrow imports pandas on its first conversion of Python objects (about 0.3 CPU-s): that too
happens here, once, not in every forked worker.

pyspark's worker runs a full `gc.collect()` after every task: about 30 ms over the objects of
those modules alone, which are never garbage. They are frozen before the fork, so a worker's
collection visits only what its tasks made. A task allocates millions of short-lived objects
(rows, documents) and few cycles, and the full collection after it reclaims those: collecting
the young generation every 50,000 allocations instead of 700 saves 2-4% of a task body's CPU
(bench/bench_tasks.py).
"""

import gc
import sys


def main() -> None:
    zips = [p for p in sys.path if p.endswith(".zip") and ("pyspark" in p or "py4j" in p)]
    sys.path[:] = [p for p in sys.path if p not in zips] + zips

    import pyspark.worker  # noqa: F401
    from pyspark.daemon import manager

    import entity_assets.fold  # noqa: F401  (the task bodies; ingest's too)
    import entity_assets.ingest  # noqa: F401
    import pyarrow

    pyarrow.array([])  # loads pyarrow's pandas shim (see above)

    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    manager()


if __name__ == "__main__":
    main()
