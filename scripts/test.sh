#!/usr/bin/env bash
# Set-up, then the test suite. Arguments go to pytest: bash scripts/test.sh -k ingest -x
# The tests start their own broker (on a free port) and SparkSession, and stop them at the end.
# Exit status: pytest's; "no tests collected" (5) is a failure too.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --test

status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "test.sh: pytest collected no tests: failing" >&2
fi
exit $status
