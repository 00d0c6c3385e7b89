#!/bin/sh
# Create (or upgrade) Temporal's schemas on PostgreSQL. Runs in the
# temporalio/admin-tools image, which ships temporal-sql-tool and the schema
# files; safe to run again (create-database tolerates an existing database,
# update-schema applies only what is missing).
set -eu
: "${POSTGRES_HOST:=postgresql}" "${POSTGRES_PORT:=5432}" "${POSTGRES_USER:?}" "${POSTGRES_PASSWORD:?}"
SCHEMA_DIR=${SCHEMA_DIR:-/etc/temporal/schema/postgresql/v12}

for db in temporal temporal_visibility; do
  tool="temporal-sql-tool --plugin postgres12 --ep $POSTGRES_HOST -p $POSTGRES_PORT \
    -u $POSTGRES_USER --pw $POSTGRES_PASSWORD --db $db"
  $tool create-database || true
  $tool setup-schema -v 0.0 || true
  if [ "$db" = temporal ]; then dir=temporal; else dir=visibility; fi
  $tool update-schema -d "$SCHEMA_DIR/$dir/versioned"
done
echo "temporal schemas are up to date"
