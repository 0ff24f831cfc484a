/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  The records as a DBA looks at them: idem_inspect (one key of the
 *	  calling role) and idem_stats (its records per operation).  The
 *	  server-wide counters are in counters.c.  Every role's records, for a
 *	  monitoring role, are counted by the view idem_monitor, in SQL, by
 *	  the same states.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/htup_details.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "args.h"
#include "claim.h"
#include "idempotency.h"
#include "read.h"
#include "store.h"

PG_FUNCTION_INFO_V1(idem_inspect);
PG_FUNCTION_INFO_V1(idem_stats_records);

/*
 * Columns of idem_stats_records() and of idem_inspect(), as the SQL of each
 * schema declares them: idem_inspect has 9 or 12 (checkpoint, takeovers
 * and remembered_until last), idem_stats_records 5 or 6 (remembered last).
 */
#define STATS_COLS_1_1	5
#define STATS_COLS		6
#define INSPECT_COLS_1_1	9
#define INSPECT_COLS	12

/* ---- idem_stats: the calling role's records, per operation ---- */

/* The states idem_stats counts, in the order of its columns */
typedef enum StatsCount
{
	STATS_PENDING,
	STATS_LAPSED,
	STATS_COMPLETED,
	STATS_EXPIRED,
	STATS_REMEMBERED,
	STATS_NUM_COUNTS
} StatsCount;

typedef struct StatsState
{
	Tuplestorestate *store;
	TupleDesc	tupdesc;
	TimestampTz now;
	text	   *operation;		/* the group being counted, or NULL */
	int64		counts[STATS_NUM_COUNTS];
} StatsState;

static void
emit_group(StatsState *st)
{
	Datum		values[STATS_COLS];
	bool		nulls[STATS_COLS] = {0};
	int			natts = st->tupdesc->natts;

	if (natts != STATS_COLS && natts != STATS_COLS_1_1)
		elog(ERROR, "idempotency: idem_stats_records() must return %d columns", STATS_COLS);
	if (st->operation == NULL)
		return;
	values[0] = PointerGetDatum(st->operation);
	for (int i = 0; i < natts - 1; i++)
		values[i + 1] = Int64GetDatum(st->counts[i]);
	/* the definition without remembered counts them as expired */
	if (natts == STATS_COLS_1_1)
		values[1 + STATS_EXPIRED] =
			Int64GetDatum(st->counts[STATS_EXPIRED] + st->counts[STATS_REMEMBERED]);
	tuplestore_putvalues(st->store, st->tupdesc, values, nulls);
}

/*
 * A record's state, as idem_inspect names it: a completed record past its
 * retention is remembered until forget_at, then expired (README, "When a
 * worker dies")
 */
static void
count_record(void *arg, text *operation, bool pending, TimestampTz expires_at,
			 TimestampTz forget_at)
{
	StatsState *st = (StatsState *) arg;
	bool		expired = expires_at <= st->now;
	StatsCount	state;

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
	if (pending)
		state = expired ? STATS_LAPSED : STATS_PENDING;
	else if (!expired)
		state = STATS_COMPLETED;
	else
		state = forget_at > st->now ? STATS_REMEMBERED : STATS_EXPIRED;
	st->counts[state]++;
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
	idem_store_note_hidden(&store);
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
	idem_store_note_hidden(&store);
	idem_store_close(&store, false);

	if (found)
	{
		TimestampTz now = GetCurrentTimestamp();
		bool		pending = IdemRecordIsPending(&rec);
		Datum		values[INSPECT_COLS];
		bool		nulls[INSPECT_COLS] = {0};

		if (rsinfo->setDesc->natts != INSPECT_COLS &&
			rsinfo->setDesc->natts != INSPECT_COLS_1_1)
			elog(ERROR, "idempotency: idem_inspect() must return %d columns", INSPECT_COLS);
		values[0] = CStringGetTextDatum(idem_record_state(&rec, now));
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
		nulls[8] = (rec.response == NULL);
		/* the last checkpoint, takeovers, the end of remembering */
		values[9] = PointerGetDatum(rec.checkpoint);
		nulls[9] = (rec.checkpoint == NULL);
		values[10] = Int32GetDatum(rec.takeovers);
		values[11] = TimestampTzGetDatum(rec.forget_at);
		nulls[11] = pending || rec.forget_at == 0;
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}

	return (Datum) 0;
}
