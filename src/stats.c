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
PG_FUNCTION_INFO_V1(idem_inspect_tenant);
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

/* One operation's counts */
typedef struct StatsGroup
{
	text	   *operation;
	int64		counts[STATS_NUM_COUNTS];
} StatsGroup;

typedef struct StatsState
{
	Tuplestorestate *store;
	TupleDesc	tupdesc;
	TimestampTz now;
	List	   *groups;			/* of StatsGroup, in the order first seen */
	StatsGroup *group;			/* the group being counted, or NULL */
} StatsState;

static void
emit_group(StatsState *st, StatsGroup *g)
{
	Datum		values[STATS_COLS];
	bool		nulls[STATS_COLS] = {0};
	int			natts = st->tupdesc->natts;

	if (natts != STATS_COLS && natts != STATS_COLS_1_1)
		elog(ERROR, "idem_stats_records() must return %d columns", STATS_COLS);
	values[0] = PointerGetDatum(g->operation);
	for (int i = 0; i < natts - 1; i++)
		values[i + 1] = Int64GetDatum(g->counts[i]);
	/* the definition without remembered counts them as expired */
	if (natts == STATS_COLS_1_1)
		values[1 + STATS_EXPIRED] =
			Int64GetDatum(g->counts[STATS_EXPIRED] + g->counts[STATS_REMEMBERED]);
	tuplestore_putvalues(st->store, st->tupdesc, values, nulls);
}

static bool
same_text(const text *a, const text *b)
{
	return VARSIZE_ANY_EXHDR(a) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(a), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(b)) == 0;
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

	/*
	 * Records arrive in operation order, table by table (shard by shard on
	 * a node with distributed records): a new operation starts a group or
	 * goes back to one.
	 */
	if (st->group == NULL || !same_text(st->group->operation, operation))
	{
		ListCell   *lc;

		st->group = NULL;
		foreach(lc, st->groups)
			if (same_text(((StatsGroup *) lfirst(lc))->operation, operation))
				st->group = (StatsGroup *) lfirst(lc);
		if (st->group == NULL)
		{
			st->group = palloc0(sizeof(StatsGroup));
			st->group->operation = (text *) PG_DETOAST_DATUM_COPY(PointerGetDatum(operation));
			st->groups = lappend(st->groups, st->group);
		}
	}
	if (pending)
		state = expired ? STATS_LAPSED : STATS_PENDING;
	else if (!expired)
		state = STATS_COMPLETED;
	else
		state = forget_at > st->now ? STATS_REMEMBERED : STATS_EXPIRED;
	st->group->counts[state]++;
}

Datum
idem_stats_records(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemStore	store;
	StatsState	st;
	ListCell   *lc;

	InitMaterializedSRF(fcinfo, 0);
	memset(&st, 0, sizeof(st));
	st.store = rsinfo->setResult;
	st.tupdesc = rsinfo->setDesc;
	st.now = GetCurrentTimestamp();

	foreach(lc, idem_store_parts(fcinfo->flinfo->fn_oid, true))
	{
		idem_store_open_part(&store, fcinfo->flinfo->fn_oid, AccessShareLock,
							 (IdemObjects *) lfirst(lc));
		idem_store_scan_role(&store, GetUserId(), count_record, &st);
		idem_store_note_hidden(&store);
		idem_store_close(&store, false);
	}
	foreach(lc, st.groups)
		emit_group(&st, (StatsGroup *) lfirst(lc));

	return (Datum) 0;
}

/* ---- idem_inspect: one key of the calling role ---- */

static Datum
inspect_call(FunctionCallInfo fcinfo, bool tenant)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemKey		key;
	IdemStore	store;
	IdemRecord	rec;
	bool		found;

	idem_key_from_args(fcinfo, &key, tenant);
	InitMaterializedSRF(fcinfo, 0);

	idem_store_open(&store, fcinfo->flinfo->fn_oid, AccessShareLock, &key);
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
			elog(ERROR, "idem_inspect() must return %d columns", INSPECT_COLS);
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

Datum
idem_inspect(PG_FUNCTION_ARGS)
{
	return inspect_call(fcinfo, false);
}

/* idem_inspect(tenant, operation, key): idem_distribute(colocate_with) makes it */
Datum
idem_inspect_tenant(PG_FUNCTION_ARGS)
{
	return inspect_call(fcinfo, true);
}
