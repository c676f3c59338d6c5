#!/usr/bin/env bash
# The project's test command: makes .venv if needed, installs the project with its test extras, and runs
# pytest (every async test on asyncio and trio). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then "$PYTHON" -m venv .venv; fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
.venv/bin/python -m pytest "$@"
