#!/usr/bin/env bash
# The test command: sets everything up, then runs the whole CPU suite.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-hf || exit 1
# The layering rule (each package imports only from the ones below it) and the lint and format.
lint=0
.venv/bin/lint-imports --no-cache --no-logo || lint=1
.venv/bin/ruff check . || lint=1
.venv/bin/ruff format --check . || lint=1
# Two workers (CI has 2 cores; XLA:CPU compiles on one thread each), a test file per worker so a
# module's fixtures and compiled programs are built once. JSPEC_TEST_WORKERS=0: one process.
.venv/bin/python -m pytest -q -n "${JSPEC_TEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
# pytest exits 5 when it collected no tests: that is a failure of the suite, say so plainly.
if [ $rc -eq 5 ]; then echo "run_tests: no tests were collected" >&2; exit 1; fi
[ $lint -ne 0 ] && echo "run_tests: lint-imports or ruff failed (see above)" >&2 && exit 1
exit $rc
