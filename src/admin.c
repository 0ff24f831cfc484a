/*-------------------------------------------------------------------------
 *
 * admin.c
 *	  idem_purge() and idem_set_logged(): administration, not granted to
 *	  PUBLIC.
 *
 * Both are SECURITY DEFINER with search_path pinned to pg_catalog in the
 * install script, and name the record table fully qualified, so the
 * caller's search_path reaches nothing that runs with the owner's rights.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type_d.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"

#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_purge);
PG_FUNCTION_INFO_V1(idem_set_logged);

static char *
record_table_name(FunctionCallInfo fcinfo)
{
	Oid			relid = idem_store_relid(fcinfo->flinfo->fn_oid);

	return quote_qualified_identifier(get_namespace_name(get_rel_namespace(relid)),
									  get_rel_name(relid));
}

/*
 * Delete up to max_rows expired records: completed ones past their
 * retention and pending ones whose lease lapsed.  Records a concurrent
 * transaction is working on are skipped, not waited for; records claimed
 * by uncommitted transactions are invisible and so never touched.
 */
Datum
idem_purge(PG_FUNCTION_ARGS)
{
	int32		max_rows;
	char	   *table;
	char	   *query;
	Oid			argtypes[1] = {INT4OID};
	Datum		args[1];
	uint64		deleted;
	int			rc;

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("max_rows must not be null")));
	max_rows = PG_GETARG_INT32(0);
	if (max_rows < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("max_rows must be positive")));

	table = record_table_name(fcinfo);
	query = psprintf("DELETE FROM %s"
					 " WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY("
					 "   SELECT ctid FROM %s"
					 "    WHERE expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()"
					 "    LIMIT $1 FOR UPDATE SKIP LOCKED))",
					 table, table);
	args[0] = Int32GetDatum(max_rows);

	SPI_connect();
	rc = SPI_execute_with_args(query, 1, argtypes, args, NULL, false, 0);
	if (rc != SPI_OK_DELETE)
		elog(ERROR, "idempotency: purge failed: %s", SPI_result_code_string(rc));
	deleted = SPI_processed;
	SPI_finish();

	idem_count(IDEM_COUNT_PURGED, (int64) deleted);
	PG_RETURN_INT64((int64) deleted);
}

/*
 * Switch the record table between unlogged (fast, emptied by crash
 * recovery, absent on standbys) and logged (crash-safe, replicated).  This
 * rewrites the table under an ACCESS EXCLUSIVE lock.
 */
Datum
idem_set_logged(PG_FUNCTION_ARGS)
{
	bool		logged;
	char	   *query;
	int			rc;

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("argument \"logged\" of idem_set_logged must not be null")));
	logged = PG_GETARG_BOOL(0);

	query = psprintf("ALTER TABLE %s SET %s", record_table_name(fcinfo),
					 logged ? "LOGGED" : "UNLOGGED");

	SPI_connect();
	rc = SPI_execute(query, false, 0);
	if (rc != SPI_OK_UTILITY)
		elog(ERROR, "idempotency: ALTER TABLE failed: %s", SPI_result_code_string(rc));
	SPI_finish();

	PG_RETURN_VOID();
}
