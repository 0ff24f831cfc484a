#!/bin/sh
# Run this folder's pg_regress test against a running server, from here:
#   PG_BINDIR=/usr/lib/postgresql/15/bin portable/test/run.sh [pg_regress options]
# (as a superuser that can create a database; --host/--port as for psql)
set -eu
cd "$(dirname "$0")"
bindir=${PG_BINDIR:-$(pg_config --bindir)}
regress=$("$bindir/pg_config" --pkglibdir)/pgxs/src/test/regress/pg_regress
exec "$regress" --bindir="$bindir" --inputdir=. --outputdir="${OUTPUT_DIR:-.}" \
	--dbname=idempotency_portable "$@" portable
