#!/usr/bin/env bash
# The Dagster UI (webserver and daemon) on the code location, with the project's instance.
#
#   bash scripts/ui.sh            http://127.0.0.1:3000
#   PORT=3100 bash scripts/ui.sh
#
# Uses the same $ENTITY_ASSETS_HOME (default ./.entity-assets) as scripts/demo.sh and the CLI.
# Unless $ENTITY_ASSETS_SPARK_MASTER names a Spark, the runs connect to a local Spark Connect
# server that this starts (port $ENTITY_ASSETS_SPARK_CONNECT_PORT, default 15002; restarted when it
# started on an earlier install's code) and leaves running, like the broker:
# `.venv/bin/entity-assets spark stop` ends it.
set -euo pipefail
# A relative home is the caller's folder's, made absolute before the cd: Dagster refuses a relative DAGSTER_HOME.
case ${ENTITY_ASSETS_HOME:-} in ""|/*) ;; *) ENTITY_ASSETS_HOME=$PWD/$ENTITY_ASSETS_HOME ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh

export ENTITY_ASSETS_HOME=${ENTITY_ASSETS_HOME:-$PWD/.entity-assets}
export ENTITY_ASSETS_KAFKA_BOOTSTRAP=${ENTITY_ASSETS_KAFKA_BOOTSTRAP:-127.0.0.1:${ENTITY_ASSETS_BROKER_PORT:-29092}}
export DAGSTER_HOME=$ENTITY_ASSETS_HOME/dagster
mkdir -p "$DAGSTER_HOME"
# One warm Spark for every run: a run of a slice over SparkResource.driver_rows would spend
# 7-11 s starting a JVM of its own (entity_assets/spark_connect.py).
if [ -z "${ENTITY_ASSETS_SPARK_MASTER:-}" ]; then
    ENTITY_ASSETS_SPARK_MASTER=$(.venv/bin/entity-assets spark start)
    export ENTITY_ASSETS_SPARK_MASTER
fi
# this repository's dagster.yaml, unless the copy there was made the user's (entity_assets/cli.py)
.venv/bin/python -c 'import sys, pathlib; from entity_assets.cli import instance_config
instance_config(pathlib.Path(sys.argv[1]))' "$DAGSTER_HOME"
# The lake pool's limit (dagster.yaml, entity_assets/partitions.py) set before the daemon starts:
# a limit that only dagster.yaml's default gives is created by the first dequeue that sees the pool,
# which does not apply it yet, so the runs queued before it would all start at once.
.venv/bin/dagster instance concurrency set entity-assets-lake 1 >/dev/null

# Stop with Ctrl-C, or `kill <pid of this script>` (SIGTERM) when it runs in the background.
# A background job of a non-interactive shell starts with SIGINT ignored, and `dagster dev`
# maps SIGTERM to the SIGINT handler, so it would ignore both: reset SIGINT before the exec.
# It runs in $DAGSTER_HOME: from the project folder, `dagster dev` would warn that the
# dagster.yaml there is not used, although its copy in $DAGSTER_HOME is.
# `dagster dev` warns that `dg dev` supersedes it; dg loads projects declared in dg.toml and
# pyproject's [tool.dg] (and needs dagster-dg-cli and its dependencies), while this location is
# the workspace.yaml that `dagster dev`, `dagster-webserver` and `dagster-daemon` all load:
# that one warning is filtered, nothing else.
export PYTHONWARNINGS="ignore:Function \`dev_command\` is superseded${PYTHONWARNINGS:+,$PYTHONWARNINGS}"
root=$PWD
cd "$DAGSTER_HOME"
exec "$root/.venv/bin/python" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' \
    "$root/.venv/bin/dagster" dev -w "$root/workspace.yaml" -h 127.0.0.1 -p "${PORT:-3000}"
