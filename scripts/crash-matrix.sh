#!/usr/bin/env bash
# The crash matrix of issue 9: runs the real `behest serve` binary against an in-test fake
# OpenAI provider and HTTP tools, kills it with SIGKILL at five points of multi-step tool runs
# (right after POST /runs, mid model stream, between iterations, mid tool, right after a tool
# result), restarts it on the same database, and checks that every run ends, that no event is
# lost or duplicated, that no tool ran twice and that the session histories are valid; also
# `recovery = "fail"` and a SIGTERM drain mid-stream. One summary line per scenario.
#
# SQLite always; PostgreSQL too when BEHEST_TEST_POSTGRES_URL is set, e.g.
#   BEHEST_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/postgres \
#   BEHEST_TEST_REQUIRE_POSTGRES=1 scripts/crash-matrix.sh
# Extra arguments filter the tests by name, e.g. `scripts/crash-matrix.sh postgres::`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${BEHEST_TEST_POSTGRES_URL:-}" ]; then
  echo "crash-matrix: BEHEST_TEST_POSTGRES_URL is unset: SQLite only" >&2
fi
exec cargo test --test it restart:: -- --skip agents_restart --nocapture --test-threads=1 "$@"
