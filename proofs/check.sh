#!/usr/bin/env bash
# Model-check the write protocol (proofs/lease.pml, see proofs/README.md) with Spin:
#   - the model, and the model with workers frozen inside their tool call, must
#     check clean (no assertion violated, no invalid end state, search complete);
#   - each broken variant must produce a counterexample, which is printed.
# Everything is built in a temporary directory: nothing is left in the tree.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
for tool in spin gcc; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "proofs: $tool is missing (apt-get install spin gcc)" >&2
    exit 1
  }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$here/lease.pml" "$work/"
cd "$work"

failed=0

# build NAME CC-FLAGS SPIN-FLAGS...: generate and compile the verifier.
build() {
  local name=$1 cflags=$2
  shift 2
  rm -f pan pan.* ./*.trail
  if ! spin -a "$@" lease.pml >spin.log 2>&1; then
    echo "FAIL $name: spin could not read the model" >&2
    cat spin.log >&2
    return 1
  fi
  # shellcheck disable=SC2086
  gcc -O2 -w $cflags -DMEMLIM=2048 -o pan pan.c
}

# holds NAME SPIN-FLAGS...: every assertion holds in every reachable state.
holds() {
  local name=$1
  shift
  build "$name" "-DSAFETY -DCOLLAPSE" "$@" || { failed=1; return; }
  ./pan -m10000 >pan.out 2>&1 || true
  if grep -q "errors: 0" pan.out && ! grep -qiE "not completed|too small|out of memory" pan.out; then
    echo "ok   $name ($*):" "$(grep -oE '[0-9]+ states, stored' pan.out)," \
      "$(grep -oE 'depth reached [0-9]+, errors: 0' pan.out)"
  else
    echo "FAIL $name ($*): Spin found a counterexample or could not finish" >&2
    cat pan.out >&2
    [ -f lease.pml.trail ] && spin -t "$@" lease.pml >&2
    failed=1
  fi
}

# fails NAME SPIN-FLAGS...: Spin must find a counterexample; the shortest is printed.
fails() {
  local name=$1
  shift
  build "$name" "-DSAFETY -DREACH" "$@" || { failed=1; return; }
  ./pan -i -m10000 >pan.out 2>&1 || true
  if grep -qE "errors: [1-9]" pan.out && [ -f lease.pml.trail ] &&
    spin -t "$@" lease.pml >trail.out 2>&1 && grep -q "assertion violated" trail.out; then
    echo "ok   $name ($*): counterexample found, as it must be:"
    grep -E "MSC:|text of failed assertion" trail.out | sed -E 's/^ +//; s/^(MSC|spin): //; s/^/       /'
  else
    echo "FAIL $name ($*): no counterexample, but this variant is broken" >&2
    cat pan.out >&2
    failed=1
  fi
}

holds model -DMAXDB=2 -DMAXCRASH=1
holds frozen-call -DFROZEN_CALL -DMAXDB=1 -DMAXCRASH=1
fails lost-lease-keeps-writing -DBUG_LOST_LEASE_KEEPS_WRITING
fails lost-lease-two-writers -DBUG_LOST_LEASE_KEEPS_WRITING -DWRITERS_ONLY
fails keeper-lets-go-at-cancel -DBUG_KEEPER_LETS_GO_AT_CANCEL
fails frozen-call-strict -DFROZEN_CALL -DSTRICT
fails frozen-call-without-fence -DFROZEN_CALL -DNO_FENCE

exit "$failed"
