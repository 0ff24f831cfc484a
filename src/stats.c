/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  What a DBA looks at: idem_inspect (one key), idem_stats (records per
 *	  operation) and the cumulative counters kept in shared memory.
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

#include "idempotency.h"

PG_FUNCTION_INFO_V1(idem_inspect);
PG_FUNCTION_INFO_V1(idem_stats_records);
PG_FUNCTION_INFO_V1(idem_counters);
PG_FUNCTION_INFO_V1(idem_stats_reset);

/* ---- counters in shared memory ---- */

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

/* Called from _PG_init while shared_preload_libraries are being loaded */
void
idem_stats_shmem_init(void)
{
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
 * idem_counters(): one row of cumulative counters since the last
 * reset, for the whole server.
 */
Datum
idem_counters(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;
	Datum		values[IDEM_NUM_COUNTERS + 1];
	bool		nulls[IDEM_NUM_COUNTERS + 1] = {0};

	require_counters();
	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "idem_counters: return type must be a row type");
	if (tupdesc->natts != IDEM_NUM_COUNTERS + 1)
		elog(ERROR, "idem_counters: expected %d columns", IDEM_NUM_COUNTERS + 1);

	for (int i = 0; i < IDEM_NUM_COUNTERS; i++)
	{
		uint64		v = pg_atomic_read_u64(&counters->value[i]);

		if (i == IDEM_COUNT_WAIT_TIME)
			values[i] = Float8GetDatum((double) v / 1000.0);	/* ms */
		else
			values[i] = Int64GetDatum((int64) v);
	}
	values[IDEM_NUM_COUNTERS] =
		TimestampTzGetDatum((TimestampTz) pg_atomic_read_u64(&counters->reset_at));

	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(BlessTupleDesc(tupdesc),
													  values, nulls)));
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

/* ---- idem_stats: the calling role's records, per operation ---- */

typedef struct StatsState
{
	Tuplestorestate *store;
	TupleDesc	tupdesc;
	TimestampTz now;
	text	   *operation;		/* the group being counted, or NULL */
	int64		counts[4];		/* pending, lapsed, completed, expired */
} StatsState;

static void
emit_group(StatsState *st)
{
	Datum		values[5];
	bool		nulls[5] = {0};

	if (st->operation == NULL)
		return;
	values[0] = PointerGetDatum(st->operation);
	for (int i = 0; i < 4; i++)
		values[i + 1] = Int64GetDatum(st->counts[i]);
	tuplestore_putvalues(st->store, st->tupdesc, values, nulls);
}

static void
count_record(void *arg, text *operation, bool pending, TimestampTz expires_at)
{
	StatsState *st = (StatsState *) arg;
	bool		expired = expires_at <= st->now;

	/* records arrive in operation order: a new operation closes a group */
	if (st->operation == NULL ||
		VARSIZE_ANY_EXHDR(st->operation) != VARSIZE_ANY_EXHDR(operation) ||
		memcmp(VARDATA_ANY(st->operation), VARDATA_ANY(operation),
			   VARSIZE_ANY_EXHDR(operation)) != 0)
	{
		emit_group(st);
		st->operation = (text *) PG_DETOAST_DATUM_COPY(PointerGetDatum(operation));
		memset(st->counts, 0, sizeof(st->counts));
	}
	st->counts[(pending ? 0 : 2) + (expired ? 1 : 0)]++;
}

Datum
idem_stats_records(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemStore	store;
	StatsState	st;

	InitMaterializedSRF(fcinfo, 0);
	memset(&st, 0, sizeof(st));
	st.store = rsinfo->setResult;
	st.tupdesc = rsinfo->setDesc;
	st.now = GetCurrentTimestamp();

	idem_store_open(&store, fcinfo->flinfo->fn_oid, AccessShareLock);
	idem_store_scan_role(&store, GetUserId(), count_record, &st);
	idem_store_close(&store, false);
	emit_group(&st);

	return (Datum) 0;
}

/* ---- idem_inspect: one key of the calling role ---- */

Datum
idem_inspect(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemKey		key;
	IdemStore	store;
	IdemRecord	rec;
	bool		found;

	idem_key_from_args(fcinfo, &key);
	InitMaterializedSRF(fcinfo, 0);

	idem_store_open(&store, fcinfo->flinfo->fn_oid, AccessShareLock);
	found = idem_store_fetch(&store, &key, &rec);
	idem_store_close(&store, false);

	if (found)
	{
		TimestampTz now = GetCurrentTimestamp();
		bool		pending = IdemRecordIsPending(&rec);
		bool		expired = rec.expires_at <= now;
		Datum		values[9];
		bool		nulls[9] = {0};

		values[0] = CStringGetTextDatum(pending ? (expired ? "lapsed" : "pending")
										: (expired ? "expired" : "completed"));
		values[1] = Int64GetDatum(rec.token);
		values[2] = PointerGetDatum(rec.fingerprint);
		nulls[2] = (rec.fingerprint == NULL);
		values[3] = TimestampTzGetDatum(rec.created_at);
		values[4] = TimestampTzGetDatum(rec.expires_at);	/* lease end */
		nulls[4] = !pending;
		values[5] = TimestampTzGetDatum(rec.completed_at);
		nulls[5] = pending;
		values[6] = TimestampTzGetDatum(rec.expires_at);	/* retention end */
		nulls[6] = pending;
		values[7] = BoolGetDatum(TransactionIdIsValid(rec.busy_xid) || rec.mine);
		values[8] = PointerGetDatum(rec.response);
		nulls[8] = pending;
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}

	return (Datum) 0;
}
