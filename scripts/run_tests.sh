#!/usr/bin/env bash
# The test command: sets everything up, then runs the whole CPU suite.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-hf || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
# pytest exits 5 when it collected no tests: that is a failure of the suite, say so plainly.
if [ $rc -eq 5 ]; then echo "run_tests: no tests were collected" >&2; exit 1; fi
exit $rc
