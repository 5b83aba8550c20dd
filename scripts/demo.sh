#!/usr/bin/env bash
# The whole pipeline on the embedded default: starts the local broker, produces sample traffic
# (the seed's batch, generated batches and a few bad records, which become dead letters), materializes
# every slice through the Dagster job and prints a summary of the lake.
#
#   bash scripts/demo.sh [--patches N] [--entities N] [--devices N] [--partitions N] [--cdc-rows N]
#
# State lives in $ENTITY_ASSETS_HOME (default ./.entity-assets): broker data, Delta lake, and the
# Dagster instance that scripts/ui.sh shows. The broker keeps running afterwards.
set -euo pipefail
# A relative home is the caller's folder's, not the repository's: made absolute before the cd.
case ${ENTITY_ASSETS_HOME:-} in ""|/*) ;; *) ENTITY_ASSETS_HOME=$PWD/$ENTITY_ASSETS_HOME ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh

export ENTITY_ASSETS_HOME=${ENTITY_ASSETS_HOME:-$PWD/.entity-assets}
# Without DAGSTER_HOME, the command takes the same Dagster instance as scripts/ui.sh, so the
# demo's runs show in the UI: $ENTITY_ASSETS_HOME/dagster, with this repository's dagster.yaml.
unset DAGSTER_HOME

status=0
.venv/bin/entity-assets demo "$@" || status=$?

pid_file=$ENTITY_ASSETS_HOME/broker/broker.pid  # written by the broker's start (entity_assets/broker.py)
if [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then
cat <<MSG

The local broker is still running (state in $ENTITY_ASSETS_HOME). Stop it with:
    ENTITY_ASSETS_HOME=$ENTITY_ASSETS_HOME .venv/bin/entity-assets broker stop
MSG
fi
exit $status
