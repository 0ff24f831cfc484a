/*-------------------------------------------------------------------------
 *
 * admin.c
 *	  Administration, not granted to PUBLIC: idem_purge(), and the
 *	  durability mode -- idem_set_durability(), idem_durability() and
 *	  idem_set_logged().
 *
 * The writing ones are SECURITY DEFINER with search_path pinned to
 * pg_catalog in the install script, and name the tables fully qualified,
 * so the caller's search_path reaches nothing that runs with the owner's
 * rights.
 *
 * Durability modes (from version 1.3), per database:
 *
 *	none		idem_record and idem_result unlogged; every record in
 *				idem_record.  Crash recovery and fail-over forget them all.
 *	completed	idem_record (claims) unlogged, idem_result (completed
 *				records) logged: a finish moves its record there in the
 *				finishing transaction.  A committed result survives; a
 *				pending claim may be lost.
 *	all			both logged; every record in idem_record.
 *
 * The mode is the tables' persistence, and a switch also moves the
 * completed records to where the new mode keeps them -- in one transaction
 * under ACCESS EXCLUSIVE locks, so claims wait for it and nothing is lost.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_class_d.h"
#include "catalog/pg_type_d.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"

#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_purge);
PG_FUNCTION_INFO_V1(idem_set_logged);
PG_FUNCTION_INFO_V1(idem_set_durability);
PG_FUNCTION_INFO_V1(idem_durability);

typedef enum IdemDurability
{
	IDEM_DURABILITY_NONE,
	IDEM_DURABILITY_COMPLETED,
	IDEM_DURABILITY_ALL
} IdemDurability;

static const char *const durability_names[] = {"none", "completed", "all"};

static char *
qualified_name(Oid relid)
{
	return quote_qualified_identifier(get_namespace_name(get_rel_namespace(relid)),
									  get_rel_name(relid));
}

/* Run one statement through SPI, which must return status expected */
static uint64
run_sql(const char *query, int nargs, Oid *argtypes, Datum *args, int expected)
{
	int			rc = SPI_execute_with_args(query, nargs, argtypes, args, NULL,
										   false, 0);

	if (rc != expected)
		elog(ERROR, "idempotency: \"%s\" failed: %s", query,
			 SPI_result_code_string(rc));
	return SPI_processed;
}

/* Delete up to max_rows expired records of one table */
static uint64
purge_table(Oid relid, int32 max_rows)
{
	char	   *table = qualified_name(relid);
	Oid			argtypes[1] = {INT4OID};
	Datum		args[1] = {Int32GetDatum(max_rows)};

	return run_sql(psprintf("DELETE FROM %s"
							" WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY("
							"   SELECT ctid FROM %s"
							"    WHERE expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()"
							"    LIMIT $1 FOR UPDATE SKIP LOCKED))",
							table, table),
				   1, argtypes, args, SPI_OK_DELETE);
}

/*
 * Delete up to max_rows expired records: completed ones past their
 * retention and pending ones whose lease lapsed, from idem_result first.
 * Records a concurrent transaction is working on are skipped, not waited
 * for; records claimed by uncommitted transactions are invisible and so
 * never touched.
 */
Datum
idem_purge(PG_FUNCTION_ARGS)
{
	int32		max_rows;
	Oid			result_relid;
	uint64		deleted = 0;

	idem_require_arg(fcinfo, 0, "max_rows");
	max_rows = PG_GETARG_INT32(0);
	if (max_rows < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" must be positive", "max_rows")));

	result_relid = idem_store_result_relid(fcinfo->flinfo->fn_oid);

	SPI_connect();
	if (OidIsValid(result_relid))
		deleted = purge_table(result_relid, max_rows);
	if (deleted < (uint64) max_rows)
		deleted += purge_table(idem_store_relid(fcinfo->flinfo->fn_oid),
							   max_rows - (int32) deleted);
	SPI_finish();

	idem_count(IDEM_COUNT_PURGED, (int64) deleted);
	PG_RETURN_INT64((int64) deleted);
}

/*
 * The mode the tables' persistence makes: 'completed' when the completed
 * records' table is logged and the claims' one is not (as idem_store_open
 * decides where a finish puts a record), otherwise idem_record's
 * persistence alone.
 */
static IdemDurability
current_durability(Oid record_relid, Oid result_relid)
{
	bool		records_logged = get_rel_persistence(record_relid) == RELPERSISTENCE_PERMANENT;

	if (!records_logged && OidIsValid(result_relid) &&
		get_rel_persistence(result_relid) == RELPERSISTENCE_PERMANENT)
		return IDEM_DURABILITY_COMPLETED;
	return records_logged ? IDEM_DURABILITY_ALL : IDEM_DURABILITY_NONE;
}

/*
 * Switch to a mode: lock both tables, move the completed records to the
 * table the mode keeps them in, and set each table's persistence (which
 * rewrites a table whose persistence changes).
 */
static void
set_durability(FunctionCallInfo fcinfo, IdemDurability mode)
{
	Oid			record_relid = idem_store_relid(fcinfo->flinfo->fn_oid);
	Oid			result_relid = idem_store_result_relid(fcinfo->flinfo->fn_oid);
	char	   *records = qualified_name(record_relid);

	SPI_connect();
	if (!OidIsValid(result_relid))
	{
		/* before 1.3: one table */
		run_sql(psprintf("ALTER TABLE %s SET %s", records,
						 mode == IDEM_DURABILITY_NONE ? "UNLOGGED" : "LOGGED"),
				0, NULL, NULL, SPI_OK_UTILITY);
		SPI_finish();
		return;
	}
	else
	{
		char	   *results = qualified_name(result_relid);
		const char *from = mode == IDEM_DURABILITY_COMPLETED ? records : results;
		const char *to = mode == IDEM_DURABILITY_COMPLETED ? results : records;

		run_sql(psprintf("LOCK TABLE %s, %s IN ACCESS EXCLUSIVE MODE",
						 records, results),
				0, NULL, NULL, SPI_OK_UTILITY);
		run_sql(psprintf("WITH moved AS (DELETE FROM %s WHERE completed_at IS NOT NULL RETURNING *)"
						 " INSERT INTO %s SELECT * FROM moved", from, to),
				0, NULL, NULL, SPI_OK_INSERT);
		run_sql(psprintf("ALTER TABLE %s SET %s", results,
						 mode == IDEM_DURABILITY_NONE ? "UNLOGGED" : "LOGGED"),
				0, NULL, NULL, SPI_OK_UTILITY);
		run_sql(psprintf("ALTER TABLE %s SET %s", records,
						 mode == IDEM_DURABILITY_ALL ? "LOGGED" : "UNLOGGED"),
				0, NULL, NULL, SPI_OK_UTILITY);
	}
	SPI_finish();

	/*
	 * Every backend looks at the tables' persistence when it opens them,
	 * after taking its lock on idem_record; make sure that lock brings an
	 * invalidation even when idem_record's persistence did not change.
	 */
	CacheInvalidateRelcacheByRelid(record_relid);
}

static IdemDurability
durability_from_name(const char *name)
{
	for (int m = 0; m < lengthof(durability_names); m++)
		if (pg_strcasecmp(name, durability_names[m]) == 0)
			return (IdemDurability) m;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("unknown durability mode \"%s\"", name),
			 errhint("Use 'none', 'completed' or 'all'.")));
	pg_unreachable();
}

/* idem_set_durability(mode text): switch modes; see the file header */
Datum
idem_set_durability(PG_FUNCTION_ARGS)
{
	idem_require_arg(fcinfo, 0, "mode");
	set_durability(fcinfo, durability_from_name(text_to_cstring(PG_GETARG_TEXT_PP(0))));
	PG_RETURN_VOID();
}

/* idem_durability(): the current mode */
Datum
idem_durability(PG_FUNCTION_ARGS)
{
	IdemDurability mode =
		current_durability(idem_store_relid(fcinfo->flinfo->fn_oid),
						   idem_store_result_relid(fcinfo->flinfo->fn_oid));

	PG_RETURN_TEXT_P(cstring_to_text(durability_names[mode]));
}

/* idem_set_logged(logged): idem_set_durability('all') or ('none') */
Datum
idem_set_logged(PG_FUNCTION_ARGS)
{
	idem_require_arg(fcinfo, 0, "logged");
	set_durability(fcinfo, PG_GETARG_BOOL(0) ? IDEM_DURABILITY_ALL : IDEM_DURABILITY_NONE);
	PG_RETURN_VOID();
}
