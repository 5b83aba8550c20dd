#!/usr/bin/env bash
# Idempotent set-up of a clone: a Python 3.11 virtualenv in .venv with the project installed
# (editable, with the dev and local extras, at the versions of constraints.txt). Re-installs only
# when pyproject.toml or constraints.txt changed since the last install (a hash stamp in .venv).
# Needs no network but the package registries.
#
#   bash scripts/setup.sh            other scripts call it first; safe to run any time
#   bash scripts/setup.sh --test     also the test-only servers that come from npm (Azurite)
#   PYTHON=/path/to/python3.11 bash scripts/setup.sh   choose the interpreter of a new venv
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
STAMP=$VENV/.entity-assets-install.sha256
# the Azure storage emulator of tests/test_object_store.py, in $VENV/azurite, with every dependency
# locked (its own ranges float): installed again when the lock changes
azurite=$(cat scripts/azurite/package.json scripts/azurite/package-lock.json | sha256sum | cut -d' ' -f1)

supported() { "$1" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 13)))' 2>/dev/null; }

find_python() {
    local candidate
    for candidate in ${PYTHON:-} python3.11 python3.12 python3; do
        if command -v "$candidate" >/dev/null 2>&1 && supported "$candidate"; then
            command -v "$candidate"
            return 0
        fi
    done
    echo "setup: no Python 3.11 or 3.12 found (set PYTHON=/path/to/python3.11)" >&2
    return 1
}

# One set-up at a time (two scripts started together must not pip-install into one venv at once):
# the lock is beside the venv, which `venv --clear` empties.
exec 9>"$VENV.setup-lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

# A venv without pip is half made (ensurepip failed: Debian's python3-venv was missing): made again.
if ! { [ -x "$VENV/bin/python" ] && supported "$VENV/bin/python" \
        && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; }; then
    python=$(find_python)
    echo "setup: creating $VENV with $python ($("$python" --version 2>&1))"
    "$python" -m venv --clear "$VENV"
fi

wanted=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
installed=$(cat "$STAMP" 2>/dev/null || true)
if [ "$wanted" != "$installed" ] || [ ! -x "$VENV/bin/entity-assets" ] \
    || ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("entity-assets")' 2>/dev/null; then
    echo "setup: installing the project into $VENV (pyproject.toml or constraints.txt changed, or first install)"
    "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet -c constraints.txt -e '.[dev,local]'
    echo "$wanted" > "$STAMP"
fi

if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
    echo "setup: warning: no java on PATH and no JAVA_HOME; Spark needs a JDK (17)" >&2
fi

if [ "${1:-}" = "--test" ]; then
    if ! command -v npm >/dev/null 2>&1; then
        echo "setup: warning: no npm on PATH; the Azure lake tests will be skipped (under CI, fail)" >&2
    elif [ "$(cat "$VENV/azurite/.version" 2>/dev/null || true)" != "$azurite" ]; then
        echo "setup: installing Azurite into $VENV/azurite (npm, scripts/azurite/package-lock.json)"
        mkdir -p "$VENV/azurite"
        cp scripts/azurite/package.json scripts/azurite/package-lock.json "$VENV/azurite/"
        npm ci --no-fund --no-audit --loglevel=error --prefix "$VENV/azurite" >/dev/null
        echo "$azurite" > "$VENV/azurite/.version"
    fi
fi
