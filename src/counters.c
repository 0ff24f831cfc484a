/*-------------------------------------------------------------------------
 *
 * counters.c
 *	  Server-wide counters of what the idem_* functions did, in shared
 *	  memory: idem_count() adds to them, idem_counters() (one row, a
 *	  column per counter) and idem_monitor_counters() (a row per
 *	  counter, for monitoring) read them, and idem_stats_reset() starts
 *	  them over.
 *
 * The counters exist only when the library is in shared_preload_libraries
 * (shared memory can be reserved only at server start).  Without it the
 * counting calls are no-ops and reading the counters says so.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/htup_details.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "counters.h"
#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_counters);
PG_FUNCTION_INFO_V1(idem_counters_1_5);
PG_FUNCTION_INFO_V1(idem_monitor_counters);
PG_FUNCTION_INFO_V1(idem_stats_reset);

/*
 * Each counter's name in idem_monitor_counters(), and the factor from the
 * unit it is kept in to the base unit shown there (seconds).  A new counter
 * is its line in IdemCounter and its line here, nothing else: the build
 * fails when a counter at the end of IdemCounter has no line here.
 */
typedef struct CounterDef
{
	const char *name;
	double		scale;
} CounterDef;

static const CounterDef counter_defs[] = {
	[IDEM_COUNT_CLAIMS] = {"claims", 1},
	[IDEM_COUNT_REPLAYS] = {"replays", 1},
	[IDEM_COUNT_WAITS] = {"waits", 1},
	[IDEM_COUNT_WAIT_TIME] = {"wait_seconds", 1e-6},
	[IDEM_COUNT_IN_PROGRESS] = {"in_progress_refusals", 1},
	[IDEM_COUNT_KEY_REUSE] = {"key_reuse_refusals", 1},
	[IDEM_COUNT_TAKEOVERS] = {"takeovers", 1},
	[IDEM_COUNT_FENCED] = {"fencing_refusals", 1},
	[IDEM_COUNT_ABORTS] = {"aborts", 1},
	[IDEM_COUNT_PURGED] = {"purged", 1},
	[IDEM_COUNT_RECOVERIES] = {"recoveries", 1},
	[IDEM_COUNT_EXPIRED] = {"expired_refusals", 1},
	[IDEM_COUNT_FORGOTTEN] = {"forgotten", 1},
};

StaticAssertDecl(lengthof(counter_defs) == IDEM_NUM_COUNTERS,
				 "every IdemCounter needs its line in counter_defs");

/*
 * The columns of each SQL definition of idem_counters(): some counters,
 * then stats_reset.  The definitions before 1.5 bind the symbol
 * idem_counters, which tells them apart by their number of columns: the
 * oldest has the counters of counters_v11, in this order, the next the
 * counters in IdemCounter's order up to forgotten, not included.  The 1.5
 * definition binds idem_counters_1_5: the counters up to forgotten,
 * included.  A counter added later shows in idem_monitor_counters(), and
 * in idem_counters() once a definition of it with the column binds a
 * symbol of its own.
 */
static const IdemCounter counters_v11[] = {
	IDEM_COUNT_CLAIMS, IDEM_COUNT_REPLAYS, IDEM_COUNT_WAITS,
	IDEM_COUNT_WAIT_TIME, IDEM_COUNT_IN_PROGRESS, IDEM_COUNT_KEY_REUSE,
	IDEM_COUNT_TAKEOVERS, IDEM_COUNT_FENCED, IDEM_COUNT_ABORTS,
	IDEM_COUNT_PURGED
};

#define COUNTERS_COLS_1_1	(lengthof(counters_v11) + 1)
#define COUNTERS_COLS_1_4	(IDEM_COUNT_FORGOTTEN + 1)
#define COUNTERS_COLS_1_5	(IDEM_COUNT_FORGOTTEN + 2)

/* idem_monitor_counters(): counter, value */
#define MONITOR_COUNTERS_COLS	2

typedef struct IdemSharedCounters
{
	pg_atomic_uint64 value[IDEM_NUM_COUNTERS];
	pg_atomic_uint64 reset_at;	/* TimestampTz of the last reset */
} IdemSharedCounters;

static IdemSharedCounters *counters = NULL;
static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

static void
counters_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(MAXALIGN(sizeof(IdemSharedCounters)));
}

static void
counters_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	counters = ShmemInitStruct("idempotency counters",
							   sizeof(IdemSharedCounters), &found);
	if (!found)
	{
		for (int i = 0; i < IDEM_NUM_COUNTERS; i++)
			pg_atomic_init_u64(&counters->value[i], 0);
		pg_atomic_init_u64(&counters->reset_at, (uint64) GetCurrentTimestamp());
	}
	LWLockRelease(AddinShmemInitLock);
}

/*
 * Called from _PG_init: the counters' shared memory can be reserved only
 * while shared_preload_libraries are being loaded.
 */
void
idem_counters_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;

	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = counters_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = counters_shmem_startup;
}

void
idem_count(IdemCounter counter, int64 n)
{
	if (counters != NULL)
		pg_atomic_fetch_add_u64(&counters->value[counter], (uint64) n);
}

static void
require_counters(void)
{
	if (counters == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency counters are not available"),
				 errdetail("The counters live in shared memory, which only a library in shared_preload_libraries can have."),
				 errhint("Add idempotency to shared_preload_libraries and restart the server. idem_stats works without it.")));
}

/*
 * idem_counters(): one row of cumulative counters since the last reset,
 * for the whole server, in a definition of ncols columns; the counter of
 * column i is columns[i], or i when columns is NULL
 */
static Datum
counters_row(FunctionCallInfo fcinfo, const IdemCounter *columns, int ncols)
{
	TupleDesc	tupdesc;
	Datum		values[IDEM_NUM_COUNTERS + 1];
	bool		nulls[IDEM_NUM_COUNTERS + 1] = {0};

	require_counters();
	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE ||
		tupdesc->natts != ncols)
		elog(ERROR, "idem_counters() must return %d columns", ncols);
	Assert(ncols <= IDEM_NUM_COUNTERS + 1);

	for (int i = 0; i < ncols - 1; i++)
	{
		IdemCounter c = columns != NULL ? columns[i] : (IdemCounter) i;
		uint64		v = pg_atomic_read_u64(&counters->value[c]);

		if (c == IDEM_COUNT_WAIT_TIME)
			values[i] = Float8GetDatum((double) v / 1000.0);	/* ms */
		else
			values[i] = Int64GetDatum((int64) v);
	}
	values[ncols - 1] =
		TimestampTzGetDatum((TimestampTz) pg_atomic_read_u64(&counters->reset_at));

	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(BlessTupleDesc(tupdesc),
													  values, nulls)));
}

/* The definitions before 1.5, and 1.5's until it is updated */
Datum
idem_counters(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	if (tupdesc->natts == COUNTERS_COLS_1_1)
		return counters_row(fcinfo, counters_v11, COUNTERS_COLS_1_1);
	if (tupdesc->natts == COUNTERS_COLS_1_4)
		return counters_row(fcinfo, NULL, COUNTERS_COLS_1_4);
	return counters_row(fcinfo, NULL, COUNTERS_COLS_1_5);
}

/* The definition with forgotten */
Datum
idem_counters_1_5(PG_FUNCTION_ARGS)
{
	return counters_row(fcinfo, NULL, COUNTERS_COLS_1_5);
}

/*
 * idem_monitor_counters(): a row per counter, in base units, for a
 * monitoring system; every counter there is, so that one added in a later
 * version shows without a change to the SQL definition.
 */
Datum
idem_monitor_counters(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	require_counters();
	InitMaterializedSRF(fcinfo, 0);
	Assert(rsinfo->setDesc->natts == MONITOR_COUNTERS_COLS);

	for (int i = 0; i < IDEM_NUM_COUNTERS; i++)
	{
		Datum		values[MONITOR_COUNTERS_COLS];
		bool		nulls[MONITOR_COUNTERS_COLS] = {0};
		uint64		v = pg_atomic_read_u64(&counters->value[i]);

		/* a counter inserted in the middle of IdemCounter without its line */
		if (counter_defs[i].name == NULL)
			elog(ERROR, "counter %d has no name", i);
		values[0] = CStringGetTextDatum(counter_defs[i].name);
		values[1] = Float8GetDatum((double) v * counter_defs[i].scale);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}

	return (Datum) 0;
}

Datum
idem_stats_reset(PG_FUNCTION_ARGS)
{
	require_counters();
	for (int i = 0; i < IDEM_NUM_COUNTERS; i++)
		pg_atomic_write_u64(&counters->value[i], 0);
	pg_atomic_write_u64(&counters->reset_at, (uint64) GetCurrentTimestamp());
	PG_RETURN_VOID();
}

