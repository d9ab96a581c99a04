#!/usr/bin/env bash
# A GPU plan longer than one device call. The first call starts the plan detached (setsid), so
# it outlives the call; that call and each later one wait up to $WAIT_S seconds, print the log's
# tail and copy the results packed so far (gpu_session.sh's tar) into $OUT. Later calls must come
# before the warm machine's idle release, or the plan and its results are gone.
#   JSPEC_COMMIT=<hash> bash benchmarks/gpu_plan.sh 'bash benchmarks/gpu_session.sh STEP...; ...'
# The argument is one shell line; every gpu_session.sh in it shares one results folder.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${JSPEC_COMMIT:?set JSPEC_COMMIT to this checkout s HEAD}"
PLAN=${PLAN_DIR:-/tmp/jspec_plan}
WAIT_S=${WAIT_S:-560}
if [ ! -e "$PLAN/started" ]; then
  mkdir -p "$PLAN/out" "$PLAN/results"
  : >"$PLAN/started"
  JSPEC_COMMIT=$JSPEC_COMMIT OUT=$PLAN/out RESULTS=$PLAN/results \
    setsid bash -c "$1; touch '$PLAN/done'" >"$PLAN/log" 2>&1 </dev/null &
  echo "plan started: $1"
else
  echo "plan already running (started $(stat -c %y "$PLAN/started"))"
fi
end=$((SECONDS + WAIT_S))
# The packed results are copied on every pass, so a call cut off by its own limit (a WAIT_S
# longer than the device time left) still brings back what the plan had packed.
while [ ! -e "$PLAN/done" ] && [ $SECONDS -lt $end ]; do
  sleep 5
  cp "$PLAN/out/gpu_results.tar.gz" "${OUT:-/tmp}/" 2>/dev/null
done
tail -n "${TAIL:-60}" "$PLAN/log"
if [ -e "$PLAN/done" ]; then echo "plan: done"; else echo "plan: still running, call again now"; fi
cp "$PLAN/out/gpu_results.tar.gz" "${OUT:-/tmp}/" 2>/dev/null || echo "no results packed yet"
