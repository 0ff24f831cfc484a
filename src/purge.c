/*-------------------------------------------------------------------------
 *
 * purge.c
 *	  Deleting expired records: idem_purge(), and the background workers
 *	  that call it.
 *
 * With idempotency in shared_preload_libraries, one worker per database
 * named in idempotency.databases wakes every idempotency.purge_interval and
 * calls idem_purge(idempotency.purge_batch_size) in its own short
 * transaction, batch after batch (idempotency.purge_delay apart), until a
 * batch comes back short.  Each batch locks only the rows it deletes and
 * skips rows others are working on, so concurrent claims never wait for it
 * for long.  A database without the extension is skipped.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_type_d.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "tcop/tcopprot.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/varlena.h"

#include "args.h"
#include "catalog.h"
#include "citus.h"
#include "counters.h"
#include "idempotency.h"
#include "locks.h"
#include "purge.h"
#include "sql.h"
#include "store.h"

PG_FUNCTION_INFO_V1(idem_purge);

/* Delete up to max_rows expired records of one table */
static uint64
purge_table(Oid relid, int32 max_rows)
{
	bool		remembers = get_attnum(relid, "forget_at") != InvalidAttrNumber;
	char	   *table = idem_qualified_name(relid);
	Oid			argtypes[1] = {INT4OID};
	Datum		args[1] = {Int32GetDatum(max_rows)};

	uint64		n;

	if (!remembers)
		return idem_run_sql(psprintf("DELETE FROM %s"
								" WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY("
								"   SELECT ctid FROM %s"
								"    WHERE expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()"
								"    LIMIT $1 FOR UPDATE SKIP LOCKED))",
								table, table),
					   1, argtypes, args, SPI_OK_DELETE);

	/*
	 * A remembered key loses its response at the end of its
	 * retention and the row at the end of remembering (a pending claim's
	 * forget_at is not an end yet: see claim.c).  A lapsed claim that has a
	 * checkpoint is what its next owner resumes from: it stays for the
	 * claim's ttl, the clients' retry window, after it was made.
	 */
	n = idem_run_sql(psprintf("DELETE FROM %s"
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
		(void) idem_run_sql(psprintf("UPDATE %s SET response = NULL"
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
 * Delete up to max_rows expired records of one part of the store.
 *
 * Lock the tables in the order everything else does, idem_record first: a
 * switch that holds idem_record and waits for idem_result must not find us
 * holding idem_result and waiting for idem_record.
 */
static uint64
purge_part(const IdemObjects *part, int32 max_rows)
{
	uint64		deleted = 0;

	LockRelationOid(part->records, RowExclusiveLock);
	if (OidIsValid(part->results))
		LockRelationOid(part->results, RowExclusiveLock);

	SPI_connect();
	if (OidIsValid(part->results))
		deleted = purge_table(part->results, max_rows);
	if (deleted < (uint64) max_rows)
		deleted += purge_table(part->records, max_rows - (int32) deleted);
	SPI_finish();
	return deleted;
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
	uint64		deleted = 0;
	ListCell   *lc;

	idem_require_arg(fcinfo, 0, "max_rows");
	max_rows = PG_GETARG_INT32(0);
	if (max_rows < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" must be positive", "max_rows")));

	/*
	 * The tables, or on a node with distributed records this node's shards
	 * of them, which Citus lets us change only when told so.
	 */
	foreach(lc, idem_store_parts(fcinfo->flinfo->fn_oid, false))
	{
		IdemObjects *part = (IdemObjects *) lfirst(lc);
		int			nest = NewGUCNestLevel();

		if (deleted >= (uint64) max_rows)
			break;
		if (idem_citus_distributed(idem_catalog_record_relid(fcinfo->flinfo->fn_oid)))
			(void) set_config_option("citus.enable_manual_changes_to_shards", "on",
									 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
									 true, 0, false);
		deleted += purge_part(part, max_rows - (int32) deleted);
		AtEOXact_GUC(true, nest);
	}

	idem_count(IDEM_COUNT_PURGED, (int64) deleted);
	PG_RETURN_INT64((int64) deleted);
}

/* ---- the workers ---- */

/* The settings, which only this file reads */
static int	idem_purge_interval_s = 60;
static int	idem_purge_batch_size = 1000;
static int	idem_purge_delay_ms = 10;
static char *idem_purge_databases = NULL;

/* idempotency.databases: a comma-separated list of names */
static bool
check_databases(char **newval, void **extra, GucSource source)
{
	char	   *names = pstrdup(*newval);
	List	   *databases;
	bool		ok = SplitIdentifierString(names, ',', &databases);

	if (!ok)
		GUC_check_errdetail("List syntax is invalid.");
	list_free(databases);
	pfree(names);
	return ok;
}

static void
register_workers(void)
{
	char	   *names = pstrdup(idem_purge_databases);
	List	   *databases;
	ListCell   *lc;

	/* checked by check_databases */
	if (!SplitIdentifierString(names, ',', &databases))
		elog(ERROR, "invalid list syntax in idempotency.databases");

	foreach(lc, databases)
	{
		const char *dbname = (const char *) lfirst(lc);
		BackgroundWorker worker;

		memset(&worker, 0, sizeof(worker));
		worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
		worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
		worker.bgw_restart_time = 10;
		snprintf(worker.bgw_library_name, BGW_MAXLEN, "idempotency");
		snprintf(worker.bgw_function_name, BGW_MAXLEN, "idem_purge_worker_main");
		snprintf(worker.bgw_name, BGW_MAXLEN, "idempotency purge worker for database %s", dbname);
		snprintf(worker.bgw_type, BGW_MAXLEN, "idempotency purge worker");
		strlcpy(worker.bgw_extra, dbname, BGW_EXTRALEN);
		RegisterBackgroundWorker(&worker);
	}
}

/*
 * Define the purge settings, and start the workers when preloaded; called
 * from _PG_init.
 */
void
idem_purge_init(void)
{
	DefineCustomIntVariable("idempotency.purge_interval",
							"Time between runs of the purge worker.",
							"Only used when idempotency is in shared_preload_libraries.",
							&idem_purge_interval_s,
							60,
							1,
							INT_MAX / 1000,
							PGC_SIGHUP,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.purge_batch_size",
							"Records the purge worker deletes per transaction.",
							NULL,
							&idem_purge_batch_size,
							1000,
							1,
							1000000,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.purge_delay",
							"Pause of the purge worker between two full batches.",
							"Spreads the purge of a large backlog so that it does not take a CPU from the load.",
							&idem_purge_delay_ms,
							10,
							0,
							10000,
							PGC_SIGHUP,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	/*
	 * The workers' databases can change only at server start, so that setting
	 * exists only when preloaded -- as do the workers and the shared memory
	 * of the counters.
	 */
	if (process_shared_preload_libraries_in_progress)
	{
		DefineCustomStringVariable("idempotency.databases",
								   "Databases the purge worker keeps clean (comma-separated).",
								   "Only used when idempotency is in shared_preload_libraries.",
								   &idem_purge_databases,
								   "postgres",
								   PGC_POSTMASTER,
								   0,
								   check_databases, NULL, NULL);
		register_workers();
	}
}

/*
 * One batch in one transaction.  Returns the number of records deleted, or
 * -1 when the extension is not installed in this database.
 */
static int64
purge_one_batch(void)
{
	int64		deleted = -1;
	int			rc;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	SPI_connect();
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, "idempotency: purging expired records");

	rc = SPI_execute("SELECT n.nspname FROM pg_catalog.pg_extension e"
					 " JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) e.extnamespace"
					 " WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency'",
					 true, 1);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "extension look-up failed: %s",
			 SPI_result_code_string(rc));

	if (SPI_processed == 1)
	{
		char	   *schema = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
		char	   *query = psprintf("SELECT %s.idem_purge($1)", quote_identifier(schema));
		Oid			argtypes[1] = {INT4OID};
		Datum		args[1] = {Int32GetDatum(idem_purge_batch_size)};
		bool		isnull;

		rc = SPI_execute_with_args(query, 1, argtypes, args, NULL, false, 1);
		if (rc != SPI_OK_SELECT)
			elog(ERROR, "idem_purge failed: %s",
				 SPI_result_code_string(rc));
		deleted = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
											  SPI_tuptable->tupdesc, 1, &isnull));
	}

	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	pgstat_report_activity(STATE_IDLE, NULL);
	return deleted;
}

/* when the next purge is due; the interval may change with a reload */
static TimestampTz
next_purge_after(TimestampTz last_run)
{
	return TimestampTzPlusMilliseconds(last_run, (int64) idem_purge_interval_s * 1000);
}

void
idem_purge_worker_main(Datum arg)
{
	char		dbname[BGW_EXTRALEN];
	TimestampTz last_run;

	strlcpy(dbname, MyBgworkerEntry->bgw_extra, sizeof(dbname));

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();
	BackgroundWorkerInitializeConnection(dbname, NULL, 0);

	last_run = GetCurrentTimestamp();
	for (;;)
	{
		long		sleep_ms;

		/*
		 * The latch is also set by reloads and by catch-up on shared
		 * invalidations: only the clock decides when to purge.
		 */
		sleep_ms = (long) ((next_purge_after(last_run) - GetCurrentTimestamp() + 999) / 1000);
		if (sleep_ms > 0)
		{
			(void) WaitLatch(MyLatch,
							 WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
							 sleep_ms,
							 idem_wait_event(IDEM_WAIT_PURGE_MAIN));
			ResetLatch(MyLatch);
		}
		CHECK_FOR_INTERRUPTS();

		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
		}
		if (GetCurrentTimestamp() < next_purge_after(last_run))
			continue;

		/*
		 * Batch after batch until one comes back short, pausing between
		 * them so that a large backlog does not take a CPU from the load.
		 */
		for (;;)
		{
			int64		deleted = purge_one_batch();

			if (deleted < idem_purge_batch_size)
				break;
			if (idem_purge_delay_ms > 0)
			{
				(void) WaitLatch(MyLatch,
								 WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
								 idem_purge_delay_ms,
								 idem_wait_event(IDEM_WAIT_PURGE_DELAY));
				ResetLatch(MyLatch);
			}
			CHECK_FOR_INTERRUPTS();
		}
		last_run = GetCurrentTimestamp();
	}
}
