/*-------------------------------------------------------------------------
 *
 * admin.c
 *	  Administration, not granted to PUBLIC: idem_purge(), and the
 *	  durability mode -- idem_set_durability(), idem_durability(),
 *	  idem_set_logged() and the online switch idem_set_durability_online();
 *	  and what keeps the mode and the records whole where PostgreSQL takes
 *	  the tables (version 1.4): the mode recorded for pg_dump (idem_mode and
 *	  its trigger), restored records settled where the mode keeps them, and
 *	  the guard against publications that would take the tables unasked.
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
 *				records, and claims with a checkpoint) logged: a finish
 *				moves its record there in the finishing transaction.  A
 *				committed result survives; a pending claim without a
 *				checkpoint may be lost.
 *	all			both logged; records in idem_record (an online switch may
 *				leave completed ones in idem_result: both are logged).
 *
 * The mode is the tables' persistence, and a switch also moves the
 * completed records to where the new mode keeps them: idem_set_durability
 * in one transaction under ACCESS EXCLUSIVE locks, so claims wait for it
 * and nothing is lost; idem_set_durability_online in committed batches,
 * each record under its key lock, and a short locked step per table whose
 * persistence changes.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "catalog/pg_class_d.h"
#include "catalog/pg_type_d.h"
#include "commands/event_trigger.h"
#include "commands/extension.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "nodes/parsenodes.h"
#include "storage/lmgr.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"

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

static IdemDurability durability_from_name(const char *name);

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
	bool		remembers = get_attnum(relid, "forget_at") != InvalidAttrNumber;
	char	   *table = qualified_name(relid);
	Oid			argtypes[1] = {INT4OID};
	Datum		args[1] = {Int32GetDatum(max_rows)};

	uint64		n;

	if (!remembers)
		return run_sql(psprintf("DELETE FROM %s"
								" WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY("
								"   SELECT ctid FROM %s"
								"    WHERE expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()"
								"    LIMIT $1 FOR UPDATE SKIP LOCKED))",
								table, table),
					   1, argtypes, args, SPI_OK_DELETE);

	/*
	 * Version 1.4: a remembered key loses its response at the end of its
	 * retention and the row at the end of remembering (a pending claim's
	 * forget_at is not an end yet: see claim.c).  A lapsed claim that has a
	 * checkpoint is what its next owner resumes from: it stays for the
	 * claim's ttl, the clients' retry window, after it was made.
	 */
	n = run_sql(psprintf("DELETE FROM %s"
						 " WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY("
						 "   SELECT ctid FROM %s"
						 "    WHERE expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()"
						 "      AND CASE WHEN completed_at IS NULL"
						 "               THEN checkpoint IS NULL"
						 "                 OR created_at OPERATOR(pg_catalog.+) ttl"
						 "                    OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()"
						 "               ELSE forget_at IS NULL"
						 "                 OR forget_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()"
						 "          END"
						 "    LIMIT $1 FOR UPDATE SKIP LOCKED))",
						 table, table),
				1, argtypes, args, SPI_OK_DELETE);
	if (n < (uint64) max_rows)
		(void) run_sql(psprintf("UPDATE %s SET response = NULL"
								" WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY("
								"   SELECT ctid FROM %s"
								"    WHERE expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()"
								"      AND completed_at IS NOT NULL AND response IS NOT NULL"
								"      AND forget_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()"
								"    LIMIT $1 FOR UPDATE SKIP LOCKED))",
								table, table),
					   1, argtypes, args, SPI_OK_UPDATE);
	return n;
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
	Oid			record_relid;
	Oid			result_relid;
	uint64		deleted = 0;

	idem_require_arg(fcinfo, 0, "max_rows");
	max_rows = PG_GETARG_INT32(0);
	if (max_rows < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" must be positive", "max_rows")));

	record_relid = idem_store_relid(fcinfo->flinfo->fn_oid);
	result_relid = idem_store_result_relid(fcinfo->flinfo->fn_oid);

	/*
	 * Lock the tables in the order everything else does, idem_record
	 * first: a switch that holds idem_record and waits for idem_result
	 * must not find us holding idem_result and waiting for idem_record.
	 */
	LockRelationOid(record_relid, RowExclusiveLock);
	if (OidIsValid(result_relid))
		LockRelationOid(result_relid, RowExclusiveLock);

	SPI_connect();
	if (OidIsValid(result_relid))
		deleted = purge_table(result_relid, max_rows);
	if (deleted < (uint64) max_rows)
		deleted += purge_table(record_relid, max_rows - (int32) deleted);
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
current_durability(Oid fn_oid)
{
	Oid			record_relid = idem_store_relid(fn_oid);
	Oid			result_relid = idem_store_result_relid(fn_oid);
	bool		records_logged = get_rel_persistence(record_relid) == RELPERSISTENCE_PERMANENT;

	if (!records_logged && OidIsValid(result_relid) &&
		get_rel_persistence(result_relid) == RELPERSISTENCE_PERMANENT)
		return IDEM_DURABILITY_COMPLETED;
	return records_logged ? IDEM_DURABILITY_ALL : IDEM_DURABILITY_NONE;
}

/*
 * The strongest mode that idem_mode allows: the mode of its row.  No row
 * (a new installation's 'completed', or no table yet) sets no bound.
 */
static IdemDurability
recorded_durability(Oid fn_oid)
{
	Oid			relid = idem_store_table(fn_oid, "idem_mode");
	IdemDurability mode = IDEM_DURABILITY_ALL;

	if (!OidIsValid(relid))
		return mode;
	SPI_connect();
	if (run_sql(psprintf("SELECT durability FROM %s", qualified_name(relid)),
				0, NULL, NULL, SPI_OK_SELECT) > 0)
		mode = durability_from_name(SPI_getvalue(SPI_tuptable->vals[0],
												 SPI_tuptable->tupdesc, 1));
	SPI_finish();
	return mode;
}

/*
 * The mode the database promises: the one the tables' persistence makes,
 * unless idem_mode records a weaker one.  An online switch records the
 * weaker of its two modes before it moves a record, and its target only
 * once every record is where the target keeps it, so that a switch cut
 * short promises no more than its storage holds.  (A switch between
 * 'completed' and 'all' needs no such record: every step of it keeps what
 * the tables' persistence promises.)
 */
static IdemDurability
promised_durability(Oid fn_oid)
{
	return Min(current_durability(fn_oid), recorded_durability(fn_oid));
}

/* Both tables, against every other session, until the transaction ends */
static void
lock_tables(const char *records, const char *results)
{
	run_sql(psprintf("LOCK TABLE %s, %s IN ACCESS EXCLUSIVE MODE", records, results),
			0, NULL, NULL, SPI_OK_UTILITY);
}

/*
 * Move the records that belong in the other table: to idem_result
 * (to_results) the completed ones and the claims that have a checkpoint
 * (both must survive a crash in mode 'completed'), back to idem_record
 * all of them.  Only our columns are named: each table may have columns
 * of the DBA's own.  Every row deleted must be inserted: a trigger that
 * skips either write is an error, not a lost record.
 */
static void
move_records(const char *from, const char *to, bool to_results, bool has_1_4)
{
	const char *cols = has_1_4 ?
		"role_id, operation, key, token, fingerprint, ttl, created_at, completed_at,"
		" expires_at, response, holder, checkpoint, takeovers, forget_at" :
		"role_id, operation, key, token, fingerprint, ttl, created_at, completed_at,"
		" expires_at, response";
	const char *which = !to_results ? "true" : has_1_4 ?
		"completed_at IS NOT NULL OR checkpoint IS NOT NULL" :
		"completed_at IS NOT NULL";
	bool		isnull;
	int64		deleted,
				inserted;

	int64		changed;

	/* what was deleted must be what was inserted, row for row */
	run_sql(psprintf("WITH moved AS (DELETE FROM %s WHERE %s RETURNING %s),"
					 " ins AS (INSERT INTO %s (%s) SELECT %s FROM moved RETURNING %s)"
					 " SELECT (SELECT pg_catalog.count(*) FROM moved),"
					 " (SELECT pg_catalog.count(*) FROM ins),"
					 " (SELECT pg_catalog.count(*) FROM"
					 "   (SELECT %s FROM moved EXCEPT ALL SELECT %s FROM ins) AS changed)",
					 from, which, cols, to, cols, cols, cols, cols, cols),
			0, NULL, NULL, SPI_OK_SELECT);
	deleted = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	inserted = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
	changed = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 3, &isnull));
	if (deleted != inserted || changed != 0)
		ereport(ERROR,
				(errcode(ERRCODE_TRIGGERED_ACTION_EXCEPTION),
				 errmsg("a trigger on table %s skipped or changed %lld of the %lld records moved there",
						to, (long long) Max(deleted - inserted, changed), (long long) deleted),
				 errhint("Triggers on the idempotency tables must return the row they are given, with the extension's columns unchanged.")));
	run_sql(psprintf("SELECT 1 FROM %s WHERE %s LIMIT 1", from, which),
			0, NULL, NULL, SPI_OK_SELECT);
	if (SPI_processed != 0)
		ereport(ERROR,
				(errcode(ERRCODE_TRIGGERED_ACTION_EXCEPTION),
				 errmsg("a trigger on table %s kept records from being moved out of it", from),
				 errhint("Triggers on the idempotency tables must return the row they are given.")));
}

/*
 * Set while this backend switches modes or settles records: the triggers
 * on the tables (idem_mode_restored, idem_settle) then stay out of the
 * way of the statements it runs itself.
 */
static bool switching = false;

/*
 * The durability row (version 1.4): what a dump carries of the mode.  The
 * mode a new installation starts in, 'completed', is no row at all, so
 * that a restore's CREATE EXTENSION and a logical replication subscriber's
 * initial copy find nothing to collide with.
 */
static void
record_mode(Oid fn_oid, IdemDurability mode)
{
	Oid			relid = idem_store_table(fn_oid, "idem_mode");
	char	   *table;
	Oid			argtypes[1] = {TEXTOID};
	Datum		args[1];

	if (!OidIsValid(relid))
		return;					/* before version 1.4 */
	table = qualified_name(relid);
	args[0] = CStringGetTextDatum(durability_names[mode]);
	run_sql(psprintf("DELETE FROM %s", table), 0, NULL, NULL, SPI_OK_DELETE);
	if (mode != IDEM_DURABILITY_COMPLETED)
		run_sql(psprintf("INSERT INTO %s (durability) VALUES ($1)", table),
				1, argtypes, args, SPI_OK_INSERT);
}

/*
 * Switch to a mode: lock both tables, move the completed records to the
 * table the mode keeps them in, and set each table's persistence (which
 * rewrites a table whose persistence changes).  The caller is connected to
 * SPI and has set switching.
 */
static void
switch_tables(Oid fn_oid, IdemDurability mode)
{
	Oid			record_relid = idem_store_relid(fn_oid);
	Oid			result_relid = idem_store_result_relid(fn_oid);
	char	   *records = qualified_name(record_relid);

	if (!OidIsValid(result_relid))
	{
		/* before 1.3: one table */
		run_sql(psprintf("ALTER TABLE %s SET %s", records,
						 mode == IDEM_DURABILITY_NONE ? "UNLOGGED" : "LOGGED"),
				0, NULL, NULL, SPI_OK_UTILITY);
		return;
	}
	else
	{
		char	   *results = qualified_name(result_relid);
		const char *from = mode == IDEM_DURABILITY_COMPLETED ? records : results;
		const char *to = mode == IDEM_DURABILITY_COMPLETED ? results : records;

		lock_tables(records, results);
		move_records(from, to, mode == IDEM_DURABILITY_COMPLETED,
					 get_attnum(record_relid, "checkpoint") != InvalidAttrNumber);
		run_sql(psprintf("ALTER TABLE %s SET %s", results,
						 mode == IDEM_DURABILITY_NONE ? "UNLOGGED" : "LOGGED"),
				0, NULL, NULL, SPI_OK_UTILITY);
		run_sql(psprintf("ALTER TABLE %s SET %s", records,
						 mode == IDEM_DURABILITY_ALL ? "LOGGED" : "UNLOGGED"),
				0, NULL, NULL, SPI_OK_UTILITY);
	}

	/*
	 * Every backend looks at the tables' persistence when it opens them,
	 * after taking its lock on idem_record; make sure that lock brings an
	 * invalidation even when idem_record's persistence did not change.
	 */
	CacheInvalidateRelcacheByRelid(record_relid);
}

/*
 * Run fn(fn_oid, mode) connected to SPI with switching set, whatever
 * happens.
 */
static void
while_switching(void (*fn) (Oid, IdemDurability), Oid fn_oid, IdemDurability mode)
{
	bool		was = switching;

	switching = true;
	PG_TRY();
	{
		SPI_connect();
		fn(fn_oid, mode);
		SPI_finish();
	}
	PG_FINALLY();
	{
		switching = was;
	}
	PG_END_TRY();
}

static void check_publications(bool only_this_command);

/*
 * idem_set_durability.  Run by the install and update scripts too, which
 * then check that no publication takes the tables they create.
 */
static void
set_durability_and_record(Oid fn_oid, IdemDurability mode)
{
	idem_lock_switch(false);
	switch_tables(fn_oid, mode);
	record_mode(fn_oid, mode);
	if (creating_extension)
		check_publications(false);
}

static void
set_durability(FunctionCallInfo fcinfo, IdemDurability mode)
{
	while_switching(set_durability_and_record, fcinfo->flinfo->fn_oid, mode);
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

/*
 * idem_durability(): the mode the database promises.  While the tables
 * have a stronger one, an online switch has not finished, or was cut short.
 */
Datum
idem_durability(PG_FUNCTION_ARGS)
{
	Oid			fn_oid = fcinfo->flinfo->fn_oid;
	IdemDurability tables = current_durability(fn_oid);
	IdemDurability mode = Min(tables, recorded_durability(fn_oid));

	if (mode != tables)
		ereport(NOTICE,
				(errmsg("a switch of durability mode has not finished"),
				 errdetail("The tables are set for mode '%s', but records may not all be where that mode keeps them yet.",
						   durability_names[tables]),
				 errhint("A switch that was cut short is finished by calling idem_set_durability_online (or idem_set_durability) again with the mode wanted.")));
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

/* ---- restoring a dump (version 1.4) ---- */

/*
 * Even when the tables are set for the mode already, records a switch cut
 * short left in the other table are moved where the mode keeps them.
 */
static void
switch_to(Oid fn_oid, IdemDurability mode)
{
	idem_lock_switch(false);
	switch_tables(fn_oid, mode);
}

/* An inserted row replaces any other: the table has at most one */
static void
restore_mode(Oid fn_oid, IdemDurability mode)
{
	run_sql(psprintf("DELETE FROM %s",
					 qualified_name(idem_store_table(fn_oid, "idem_mode"))),
			0, NULL, NULL, SPI_OK_DELETE);
	switch_to(fn_oid, mode);
}

/*
 * idem_mode_restored: BEFORE INSERT OR UPDATE trigger on idem_mode.  A
 * row written by anything but idem_set_durability -- pg_restore loading a
 * dump, a DBA -- switches to the mode it names.
 */
PG_FUNCTION_INFO_V1(idem_mode_restored);

Datum
idem_mode_restored(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	HeapTuple	row;
	bool		isnull;
	Datum		d;

	if (!CALLED_AS_TRIGGER(fcinfo) || !TRIGGER_FIRED_FOR_ROW(trigdata->tg_event))
		elog(ERROR, "idempotency: idem_mode_restored must be a row trigger");
	row = TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event) ?
		trigdata->tg_newtuple : trigdata->tg_trigtuple;
	if (switching)
		return PointerGetDatum(row);

	d = heap_getattr(row, 1, RelationGetDescr(trigdata->tg_relation), &isnull);
	if (isnull)
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("durability mode must not be null")));
	while_switching(TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event) ? switch_to : restore_mode,
					fcinfo->flinfo->fn_oid,
					durability_from_name(TextDatumGetCString(d)));
	return PointerGetDatum(row);
}

static void
settle(Oid fn_oid, IdemDurability mode)
{
	Oid			record_relid = idem_store_relid(fn_oid);
	Oid			result_relid = idem_store_result_relid(fn_oid);
	char	   *records = qualified_name(record_relid);
	char	   *results = qualified_name(result_relid);

	/* no look-up may read one table before the move and the other after */
	lock_tables(records, results);
	if (mode == IDEM_DURABILITY_COMPLETED)
		move_records(records, results, true, true);
	else
		move_records(results, records, false, true);
}

/*
 * idem_settle: AFTER INSERT statement trigger on both tables.  Records
 * inserted by SQL -- a dump being restored, from any earlier version and
 * any mode -- are moved to where the current mode keeps them, so that a
 * completed record restored into a database in mode 'completed' is in the
 * logged table.  The idem_* functions' own writes do not fire statement
 * triggers.
 */
PG_FUNCTION_INFO_V1(idem_settle);

Datum
idem_settle(PG_FUNCTION_ARGS)
{
	if (!CALLED_AS_TRIGGER(fcinfo))
		elog(ERROR, "idempotency: idem_settle must be a trigger");
	if (!switching)
		while_switching(settle, fcinfo->flinfo->fn_oid,
						current_durability(fcinfo->flinfo->fn_oid));
	return PointerGetDatum(NULL);
}

/* ---- publications (version 1.4) ---- */

bool		idem_publish_records = false;

/*
 * A publication that takes one of the extension's logged tables without
 * naming it -- FOR ALL TABLES, or FOR TABLES IN SCHEMA of the extension's
 * schema -- sends its changes to subscribers that may not have the
 * extension, whose apply worker then stops on the missing table, and every
 * table of the application stops replicating with it.  Refuse that,
 * unless idempotency.publish_records says the subscribers have the
 * extension.
 */
static void
check_publications(bool only_this_command)
{
	char	   *pubname;
	char	   *relname;

	if (idem_publish_records)
		return;
	SPI_connect();
	run_sql(psprintf("SELECT pt.pubname::pg_catalog.text, pt.tablename::pg_catalog.text"
			"  FROM pg_catalog.pg_publication_tables pt"
			"  JOIN pg_catalog.pg_publication p ON p.pubname OPERATOR(pg_catalog.=) pt.pubname"
			"  JOIN pg_catalog.pg_namespace n ON n.nspname OPERATOR(pg_catalog.=) pt.schemaname"
			"  JOIN pg_catalog.pg_class c ON c.relnamespace OPERATOR(pg_catalog.=) n.oid"
			"   AND c.relname OPERATOR(pg_catalog.=) pt.tablename"
			"  JOIN pg_catalog.pg_depend d ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass"
			"   AND d.objid OPERATOR(pg_catalog.=) c.oid AND d.deptype OPERATOR(pg_catalog.=) 'e'"
			"  JOIN pg_catalog.pg_extension e ON e.oid OPERATOR(pg_catalog.=) d.refobjid"
			"   AND e.extname OPERATOR(pg_catalog.=) 'idempotency'"
			" WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel pr"
			"                    WHERE pr.prpubid OPERATOR(pg_catalog.=) p.oid"
			"                      AND pr.prrelid OPERATOR(pg_catalog.=) c.oid)"
			"%s ORDER BY 1, 2 LIMIT 1",
			only_this_command ?
			"   AND p.oid OPERATOR(pg_catalog.=) ANY ("
			"       SELECT CASE c.classid"
			"              WHEN 'pg_catalog.pg_publication'::pg_catalog.regclass THEN c.objid"
			"              WHEN 'pg_catalog.pg_publication_rel'::pg_catalog.regclass THEN"
			"                (SELECT prpubid FROM pg_catalog.pg_publication_rel"
			"                  WHERE oid OPERATOR(pg_catalog.=) c.objid)"
			"              WHEN 'pg_catalog.pg_publication_namespace'::pg_catalog.regclass THEN"
			"                (SELECT pnpubid FROM pg_catalog.pg_publication_namespace"
			"                  WHERE oid OPERATOR(pg_catalog.=) c.objid)"
			"              END"
			"         FROM pg_catalog.pg_event_trigger_ddl_commands() c)" : ""),
			0, NULL, NULL, SPI_OK_SELECT);
	if (SPI_processed == 0)
	{
		SPI_finish();
		return;
	}
	pubname = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
	relname = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2);
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("publication \"%s\" would publish the idempotency table \"%s\"",
					pubname, relname),
			 errdetail("A subscriber without the idempotency extension stops applying every table of the publication when it receives a change of this table."),
			 errhint("Publish the application's tables or schemas by name. If every subscriber has the extension installed (a blue-green upgrade), SET idempotency.publish_records = on and run the command again.")));
}

/*
 * idem_publication_guard: event trigger at the end of CREATE/ALTER
 * PUBLICATION: that publication is checked; at the end of ALTER TABLE
 * (which may move a table into a schema published FOR TABLES IN SCHEMA),
 * every publication.  The install and update
 * scripts check every publication (set_durability_and_record).  idem_mode
 * is always logged, so a publication that takes the extension's tables
 * without naming them always takes it: a later durability switch that
 * makes idem_result logged adds no publication to check.
 */
PG_FUNCTION_INFO_V1(idem_publication_guard);

Datum
idem_publication_guard(PG_FUNCTION_ARGS)
{
	EventTriggerData *trigdata = (EventTriggerData *) fcinfo->context;

	if (!CALLED_AS_EVENT_TRIGGER(fcinfo))
		elog(ERROR, "idempotency: idem_publication_guard must be an event trigger");
	/* ALTER TABLE ... SET SCHEMA may take a table into a published schema */
	check_publications(trigdata->tag != CMDTAG_ALTER_TABLE);
	PG_RETURN_VOID();
}

void
idem_admin_init(void)
{
	DefineCustomBoolVariable("idempotency.publish_records",
							 "Allow publications that take the extension's tables without naming them.",
							 "Set it only when every subscriber has the idempotency extension installed.",
							 &idem_publish_records,
							 false,
							 PGC_USERSET,
							 0,
							 NULL, NULL, NULL);
}

/* ---- online switch (version 1.4) ---- */

/*
 * One step of an online switch: drain table "from" into the other table
 * (every record if all, else those that must survive a crash) in batches
 * of batch records, each its own transaction; then, under ACCESS
 * EXCLUSIVE locks, move what the last batches left and give "from" its
 * new persistence -- a rewrite of a table that now holds few records.
 */
/*
 * Move records out of table "from" (all, or what must survive a crash) in
 * committed batches of batch records, until a batch finds none.
 */
static void
drain(Oid fn_oid, int from, bool all, int64 batch)
{
	IdemStore	store;
	int64		moved;

	do
	{
		PushActiveSnapshot(GetTransactionSnapshot());
		idem_store_open(&store, fn_oid, RowExclusiveLock);
		moved = idem_store_move_batch(&store, from, all, batch);
		idem_store_close(&store, false);
		PopActiveSnapshot();
		SPI_commit();
	} while (moved > 0);
}

static void
drain_and_flip(Oid fn_oid, int from, bool all, bool logged, int64 batch)
{
	IdemStore	store;
	Oid			relid = from == IDEM_RECORDS ? idem_store_relid(fn_oid) :
		idem_store_result_relid(fn_oid);

	Assert(OidIsValid(relid));

	drain(fn_oid, from, all, batch);

	lock_tables(qualified_name(idem_store_relid(fn_oid)),
				qualified_name(idem_store_result_relid(fn_oid)));
	/* a snapshot taken once we hold the locks sees every finished write */
	PushActiveSnapshot(GetTransactionSnapshot());
	idem_store_open(&store, fn_oid, AccessExclusiveLock);
	(void) idem_store_move_batch(&store, from, all, PG_INT64_MAX);
	idem_store_close(&store, false);
	run_sql(psprintf("ALTER TABLE %s SET %s", qualified_name(relid),
					 logged ? "LOGGED" : "UNLOGGED"),
			0, NULL, NULL, SPI_OK_UTILITY);
	CacheInvalidateRelcacheByRelid(idem_store_relid(fn_oid));
	PopActiveSnapshot();
	SPI_commit();
}

/* Record mode in idem_mode in a transaction of its own */
static void
record_mode_now(Oid fn_oid, IdemDurability mode)
{
	PushActiveSnapshot(GetTransactionSnapshot());
	while_switching(record_mode, fn_oid, mode);
	PopActiveSnapshot();
	SPI_commit();
}

/*
 * CALL idem_set_durability_online(mode, batch_size): switch modes without
 * holding claims up.  Each table whose persistence changes is first
 * drained into the other table in committed batches (claims meanwhile find
 * records in either table), then switched in a short transaction.  The
 * order keeps every completed record at least as safe as the modes on
 * either side of a step promise: a table is made logged before records
 * move into it, and records move out of a table before it is made
 * unlogged.  In mode 'all' completed records may stay in idem_result:
 * both tables are logged.
 */
PG_FUNCTION_INFO_V1(idem_set_durability_online);

static void switch_online(Oid fn_oid, IdemDurability target, bool want_result_logged,
						  bool want_record_logged, int64 batch);

Datum
idem_set_durability_online(PG_FUNCTION_ARGS)
{
	Oid			fn_oid = fcinfo->flinfo->fn_oid;
	IdemDurability target;
	int64		batch;
	bool		want_result_logged,
				want_record_logged;

	if (fcinfo->context == NULL || !IsA(fcinfo->context, CallContext) ||
		castNode(CallContext, fcinfo->context)->atomic)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_TRANSACTION_TERMINATION),
				 errmsg("idem_set_durability_online must be called by CALL outside a transaction block"),
				 errhint("Inside a transaction, idem_set_durability switches in one step, holding claims up while it moves the records.")));
	idem_require_arg(fcinfo, 0, "mode");
	idem_require_arg(fcinfo, 1, "batch_size");
	target = durability_from_name(text_to_cstring(PG_GETARG_TEXT_PP(0)));
	batch = PG_GETARG_INT32(1);
	if (batch < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" must be positive", "batch_size")));
	if (!OidIsValid(idem_store_result_relid(fn_oid)))
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("an online switch needs version 1.4 of the extension"),
				 errhint("Update the extension: ALTER EXTENSION idempotency UPDATE.")));

	want_result_logged = target != IDEM_DURABILITY_NONE;
	want_record_logged = target == IDEM_DURABILITY_ALL;

	/* one switch at a time, across its transactions */
	idem_lock_switch(true);
	PG_TRY();
	{
		SPI_connect_ext(SPI_OPT_NONATOMIC);
		/* promise the weaker mode until every record has moved */
		record_mode_now(fn_oid, Min(promised_durability(fn_oid), target));
		switch_online(fn_oid, target, want_result_logged, want_record_logged, batch);
		record_mode_now(fn_oid, target);
		SPI_finish();
	}
	PG_FINALLY();
	{
		idem_unlock_switch();
	}
	PG_END_TRY();
	PG_RETURN_VOID();
}

/*
 * The steps of an online switch, until the tables' persistence is the
 * target's and every record is where the target keeps it.
 */
static void
switch_online(Oid fn_oid, IdemDurability target, bool want_result_logged,
			  bool want_record_logged, int64 batch)
{
	for (;;)
	{
		Oid			record_relid = idem_store_relid(fn_oid);
		Oid			result_relid = idem_store_result_relid(fn_oid);
		bool		record_logged = get_rel_persistence(record_relid) == RELPERSISTENCE_PERMANENT;
		bool		result_logged = get_rel_persistence(result_relid) == RELPERSISTENCE_PERMANENT;

		if (want_result_logged && !result_logged)
			drain_and_flip(fn_oid, IDEM_RESULTS, true, true, batch);
		else if (!want_record_logged && record_logged)
			drain_and_flip(fn_oid, IDEM_RECORDS, false, false, batch);
		else if (want_record_logged && !record_logged)
			drain_and_flip(fn_oid, IDEM_RECORDS, false, true, batch);
		else if (!want_result_logged && result_logged)
			drain_and_flip(fn_oid, IDEM_RESULTS, true, false, batch);
		else
			break;
	}
	/* in mode 'completed', what must survive a crash goes to idem_result */
	if (target == IDEM_DURABILITY_COMPLETED)
		drain(fn_oid, IDEM_RECORDS, false, batch);
}
