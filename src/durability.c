/*-------------------------------------------------------------------------
 *
 * durability.c
 *	  The durability modes and the switches between them:
 *	  idem_set_durability(), idem_durability(), idem_set_logged() and the
 *	  online switch idem_set_durability_online().
 *
 * Durability modes, per database:
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
 * The tables' persistence makes the mode (idem_store_tables_mode), and a
 * switch also moves the records to where the new mode keeps them, through
 * the store's verified writes: idem_set_durability in one transaction under
 * ACCESS EXCLUSIVE locks, so claims wait for it and nothing is lost;
 * idem_set_durability_online in committed batches, each record under its
 * key lock, and a short locked step per table whose persistence changes.
 * idem_mode records the mode for pg_dump, and bounds the mode a database
 * promises while an online switch is under way or was cut short.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_class_d.h"
#include "catalog/pg_type_d.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "nodes/parsenodes.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"

#include "args.h"
#include "catalog.h"
#include "citus.h"
#include "durability.h"
#include "idempotency.h"
#include "locks.h"
#include "publication.h"
#include "sql.h"
#include "store.h"
#include "write.h"

PG_FUNCTION_INFO_V1(idem_set_logged);
PG_FUNCTION_INFO_V1(idem_set_durability);
PG_FUNCTION_INFO_V1(idem_durability);

static const char *const durability_names[] = {"none", "completed", "all"};

/* The mode the tables' persistence makes (idem_tables_mode) */
static IdemDurability
current_durability(Oid fn_oid)
{
	Oid			result_relid = idem_catalog_result_relid(fn_oid);

	return idem_tables_mode(get_rel_persistence(idem_catalog_record_relid(fn_oid)),
							OidIsValid(result_relid) ? get_rel_persistence(result_relid) : 0);
}

/*
 * The strongest mode that idem_mode allows: the mode of its row.  No row
 * (a new installation's 'completed', or no table yet) sets no bound.
 */
static IdemDurability
recorded_durability(Oid fn_oid)
{
	Oid			relid = idem_catalog_table(fn_oid, "idem_mode");
	IdemDurability mode = IDEM_DURABILITY_ALL;

	if (!OidIsValid(relid))
		return mode;
	SPI_connect();
	if (idem_run_sql(psprintf("SELECT durability FROM %s", idem_qualified_name(relid)),
				0, NULL, NULL, SPI_OK_SELECT) > 0)
		mode = idem_durability_from_name(SPI_getvalue(SPI_tuptable->vals[0],
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
	idem_run_sql(psprintf("LOCK TABLE %s, %s IN ACCESS EXCLUSIVE MODE", records, results),
			0, NULL, NULL, SPI_OK_UTILITY);
}

/*
 * Move what belongs in the other table, through the store's verified
 * writes, with both tables locked in ACCESS EXCLUSIVE mode: to idem_result
 * (to_results) the completed records and the claims that have a
 * checkpoint (both must survive a crash in mode 'completed'), back to
 * idem_record all of them.  A record written earlier in this transaction
 * (a restore's COPY) moves too.
 */
static void
move_all(Oid fn_oid, bool to_results)
{
	IdemStore	store;

	CommandCounterIncrement();
	PushActiveSnapshot(GetLatestSnapshot());
	idem_store_open(&store, fn_oid, AccessExclusiveLock, NULL);
	(void) idem_store_move_batch(&store, to_results ? IDEM_RECORDS : IDEM_RESULTS,
								 !to_results, PG_INT64_MAX);
	idem_store_close(&store, false);
	PopActiveSnapshot();
}

/*
 * Set while this backend switches modes or settles records: the triggers
 * on the tables (idem_mode_restored, idem_settle) then stay out of the
 * way of the statements it runs itself.
 */
static bool switching = false;

/*
 * The durability row: what a dump carries of the mode.  The
 * mode a new installation starts in, 'completed', is no row at all, so
 * that a restore's CREATE EXTENSION and a logical replication subscriber's
 * initial copy find nothing to collide with.
 */
static void
record_mode(Oid fn_oid, IdemDurability mode)
{
	Oid			relid = idem_catalog_table(fn_oid, "idem_mode");
	char	   *table;
	Oid			argtypes[1] = {TEXTOID};
	Datum		args[1];

	if (!OidIsValid(relid))
		return;					/* a schema without idem_mode records no mode */
	table = idem_qualified_name(relid);
	args[0] = CStringGetTextDatum(durability_names[mode]);
	idem_run_sql(psprintf("DELETE FROM %s", table), 0, NULL, NULL, SPI_OK_DELETE);
	if (mode != IDEM_DURABILITY_COMPLETED)
		idem_run_sql(psprintf("INSERT INTO %s (durability) VALUES ($1)", table),
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
	Oid			record_relid = idem_catalog_record_relid(fn_oid);
	Oid			result_relid = idem_catalog_result_relid(fn_oid);
	char	   *records = idem_qualified_name(record_relid);

	if (!OidIsValid(result_relid))
	{
		/* a schema without idem_result: one table */
		idem_run_sql(psprintf("ALTER TABLE %s SET %s", records,
						 mode == IDEM_DURABILITY_NONE ? "UNLOGGED" : "LOGGED"),
				0, NULL, NULL, SPI_OK_UTILITY);
		return;
	}
	else
	{
		char	   *results = idem_qualified_name(result_relid);

		lock_tables(records, results);
		move_all(fn_oid, mode == IDEM_DURABILITY_COMPLETED);
		idem_run_sql(psprintf("ALTER TABLE %s SET %s", results,
						 mode == IDEM_DURABILITY_NONE ? "UNLOGGED" : "LOGGED"),
				0, NULL, NULL, SPI_OK_UTILITY);
		idem_run_sql(psprintf("ALTER TABLE %s SET %s", records,
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
/*
 * Distributed records stay in mode 'all' (docs/scaling-out.md): Citus moves
 * a shard by logical replication, which carries no unlogged table.
 */
static void
refuse_distributed(void)
{
	ereport(ERROR,
			(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
			 errmsg("the durability mode of distributed idempotency records cannot be switched"),
			 errdetail("Distributed records are kept in mode 'all' on every node: Citus moves shards by logical replication, which carries no unlogged table.")));
}

static void
while_switching(void (*fn) (Oid, IdemDurability), Oid fn_oid, IdemDurability mode)
{
	bool		was = switching;

	if (idem_citus_distributed(idem_catalog_record_relid(fn_oid)))
	{
		if (mode == IDEM_DURABILITY_ALL)
			return;
		refuse_distributed();
	}
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
		idem_check_publications(false);
}

static void
set_durability(FunctionCallInfo fcinfo, IdemDurability mode)
{
	while_switching(set_durability_and_record, fcinfo->flinfo->fn_oid, mode);
}

IdemDurability
idem_durability_from_name(const char *name)
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
	set_durability(fcinfo, idem_durability_from_name(text_to_cstring(PG_GETARG_TEXT_PP(0))));
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

/* ---- what restore.c's triggers ask for ---- */

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
replace_mode(Oid fn_oid, IdemDurability mode)
{
	idem_run_sql(psprintf("DELETE FROM %s",
					 idem_qualified_name(idem_catalog_table(fn_oid, "idem_mode"))),
			0, NULL, NULL, SPI_OK_DELETE);
	switch_to(fn_oid, mode);
}

static void
settle_records(Oid fn_oid, IdemDurability mode)
{
	Oid			record_relid = idem_catalog_record_relid(fn_oid);
	Oid			result_relid = idem_catalog_result_relid(fn_oid);
	char	   *records = idem_qualified_name(record_relid);
	char	   *results = idem_qualified_name(result_relid);

	/* no look-up may read one table before the move and the other after */
	lock_tables(records, results);
	move_all(fn_oid, mode == IDEM_DURABILITY_COMPLETED);
}

/*
 * A row written into idem_mode by anything but a switch: switch to the mode
 * it names (replace: an inserted row, which replaces any other).
 */
void
idem_durability_restore(Oid fn_oid, IdemDurability mode, bool replace)
{
	while_switching(replace ? replace_mode : switch_to, fn_oid, mode);
}

/* Records inserted by SQL: move them to where the current mode keeps them */
void
idem_durability_settle(Oid fn_oid)
{
	while_switching(settle_records, fn_oid, current_durability(fn_oid));
}

/* Is this backend switching modes or settling records itself? */
bool
idem_durability_switching(void)
{
	return switching;
}

/* ---- the online switch ---- */

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
		idem_store_open(&store, fn_oid, RowExclusiveLock, NULL);
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
	Oid			relid = from == IDEM_RECORDS ? idem_catalog_record_relid(fn_oid) :
		idem_catalog_result_relid(fn_oid);

	Assert(OidIsValid(relid));

	drain(fn_oid, from, all, batch);

	lock_tables(idem_qualified_name(idem_catalog_record_relid(fn_oid)),
				idem_qualified_name(idem_catalog_result_relid(fn_oid)));
	/* a snapshot taken once we hold the locks sees every finished write */
	PushActiveSnapshot(GetTransactionSnapshot());
	idem_store_open(&store, fn_oid, AccessExclusiveLock, NULL);
	(void) idem_store_move_batch(&store, from, all, PG_INT64_MAX);
	idem_store_close(&store, false);
	idem_run_sql(psprintf("ALTER TABLE %s SET %s", idem_qualified_name(relid),
					 logged ? "LOGGED" : "UNLOGGED"),
			0, NULL, NULL, SPI_OK_UTILITY);
	CacheInvalidateRelcacheByRelid(idem_catalog_record_relid(fn_oid));
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
	target = idem_durability_from_name(text_to_cstring(PG_GETARG_TEXT_PP(0)));
	if (idem_citus_distributed(idem_catalog_record_relid(fn_oid)))
	{
		if (target == IDEM_DURABILITY_ALL)
			PG_RETURN_VOID();
		refuse_distributed();
	}
	batch = PG_GETARG_INT32(1);
	if (batch < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" must be positive", "batch_size")));
	if (!OidIsValid(idem_catalog_result_relid(fn_oid)))
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("an online switch needs table idem_result, which this schema of the extension lacks"),
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
		Oid			record_relid = idem_catalog_record_relid(fn_oid);
		Oid			result_relid = idem_catalog_result_relid(fn_oid);
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
