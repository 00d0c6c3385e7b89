#!/usr/bin/env bash
# Make sure PostgreSQL's server binaries are installed. The test suite starts its
# own throwaway cluster from them (tests/pg_cluster.py), so nothing is configured
# here. Skipped when ROUNDTABLE_TEST_DATABASE_URL points at an existing server.
set -euo pipefail

if [ -n "${ROUNDTABLE_TEST_DATABASE_URL:-}" ]; then
  echo "ensure-postgres: using ROUNDTABLE_TEST_DATABASE_URL"
  exit 0
fi
if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1; then
  SUDO="sudo"
else
  echo "ensure-postgres: PostgreSQL is not installed and this user cannot install it." >&2
  echo "  Install Debian's 'postgresql' package, or set ROUNDTABLE_TEST_DATABASE_URL." >&2
  exit 1
fi

echo "ensure-postgres: installing Debian's postgresql package"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends postgresql
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || {
  echo "ensure-postgres: postgresql installed but initdb not found" >&2
  exit 1
}
