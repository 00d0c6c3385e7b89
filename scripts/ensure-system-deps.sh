#!/usr/bin/env bash
# Install the system packages the test suite needs, from Debian, when missing:
#   postgresql      the tests start their own throwaway cluster from its binaries
#                   (skipped when ROUNDTABLE_TEST_DATABASE_URL names an existing server)
#   chromium        the browser check of the Temporal UI (driven by playwright)
#   docker-compose  validates docker-compose.yml (Docker itself does not run here)
#   spin, gcc       make proofs: the Spin model checker and the compiler for its verifiers
set -euo pipefail

wanted=()
if [ -z "${ROUNDTABLE_TEST_DATABASE_URL:-}" ] && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  wanted+=(postgresql)
fi
command -v chromium >/dev/null 2>&1 || wanted+=(chromium)
command -v docker-compose >/dev/null 2>&1 || wanted+=(docker-compose)
command -v spin >/dev/null 2>&1 || wanted+=(spin)
command -v gcc >/dev/null 2>&1 || wanted+=(gcc)
[ ${#wanted[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1; then
  SUDO="sudo"
else
  echo "ensure-system-deps: missing ${wanted[*]} and this user cannot install them." >&2
  echo "  Install them with apt-get (or set ROUNDTABLE_TEST_DATABASE_URL for PostgreSQL)." >&2
  exit 1
fi

echo "ensure-system-deps: installing ${wanted[*]} from Debian"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${wanted[@]}"
if [[ " ${wanted[*]} " == *" postgresql "* ]]; then
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || {
    echo "ensure-system-deps: postgresql installed but initdb not found" >&2
    exit 1
  }
fi
