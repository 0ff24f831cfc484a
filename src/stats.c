/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  The records as a DBA looks at them: idem_inspect (one key of the
 *	  calling role) and idem_stats (its records per operation).  The
 *	  server-wide counters are in counters.c.  Every role's records, for a
 *	  monitoring role, are counted by the view idem_monitor, in SQL, by
 *	  the same states: all three name them by idem_record_state (state.c).
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
#include "idempotency.h"
#include "read.h"
#include "state.h"
#include "store.h"

PG_FUNCTION_INFO_V1(idem_inspect);
PG_FUNCTION_INFO_V1(idem_inspect_1_4);
PG_FUNCTION_INFO_V1(idem_inspect_tenant);
PG_FUNCTION_INFO_V1(idem_stats_records);
PG_FUNCTION_INFO_V1(idem_stats_records_1_6);

/*
 * Columns of idem_inspect(), as its SQL definitions declare them: 12, or
 * 9 without checkpoint, takeovers and remembered_until (the definition
 * that only earlier versions' scripts bind)
 */
#define INSPECT_COLS	12
#define INSPECT_COLS_WITHOUT_RECOVERY	9

/* ---- idem_stats: the calling role's records, per operation ---- */

/*
 * The columns of idem_stats_records(): the operation, then a count per
 * state in IdemState's order.  Its SQL definitions: the one bound to
 * idem_stats_records_1_6 has them all; the older ones, bound to
 * idem_stats_records, lack 'unknown' (STATS_COLS_WITH_REMEMBERED) or both
 * it and 'remembered' (STATS_COLS_PLAIN).
 */
#define STATS_COLS			(1 + IDEM_NUM_STATES)
#define STATS_COLS_WITH_REMEMBERED	(STATS_COLS - 1)
#define STATS_COLS_PLAIN	(STATS_COLS - 2)

/* One operation's counts */
typedef struct StatsGroup
{
	text	   *operation;
	int64		counts[IDEM_NUM_STATES];
} StatsGroup;

typedef struct StatsState
{
	TimestampTz now;
	List	   *groups;			/* of StatsGroup, in the order first seen */
	StatsGroup *group;			/* the group being counted, or NULL */
} StatsState;

/*
 * One operation's row, in a definition of natts columns: a definition
 * without 'unknown' counts those claims as pending, as the primary most
 * likely does; one without 'remembered' counts those records as expired.
 */
static void
emit_group(Tuplestorestate *store, TupleDesc tupdesc, StatsGroup *g)
{
	Datum		values[STATS_COLS];
	bool		nulls[STATS_COLS] = {0};
	int64		counts[IDEM_NUM_STATES];
	int			natts = tupdesc->natts;

	memcpy(counts, g->counts, sizeof(counts));
	if (natts < STATS_COLS)
		counts[IDEM_STATE_PENDING] += counts[IDEM_STATE_UNKNOWN];
	if (natts < STATS_COLS_WITH_REMEMBERED)
		counts[IDEM_STATE_EXPIRED] += counts[IDEM_STATE_REMEMBERED];
	values[0] = PointerGetDatum(g->operation);
	for (int i = 1; i < natts; i++)
		values[i] = Int64GetDatum(counts[i - 1]);
	tuplestore_putvalues(store, tupdesc, values, nulls);
}

static bool
same_text(const text *a, const text *b)
{
	return VARSIZE_ANY_EXHDR(a) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(a), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(b)) == 0;
}

/* Count one record in its operation's group, by idem_record_state */
static void
count_record(void *arg, text *operation, const IdemRecord *rec)
{
	StatsState *st = (StatsState *) arg;

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
	st->group->counts[idem_record_state(rec, st->now)]++;
}

/* idem_stats_records() in a definition of ncols columns */
static void
stats_records(FunctionCallInfo fcinfo, int ncols)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemStore	store;
	StatsState	st;
	ListCell   *lc;

	InitMaterializedSRF(fcinfo, 0);
	if (rsinfo->setDesc->natts != ncols)
		elog(ERROR, "idem_stats_records() must return %d columns", ncols);
	memset(&st, 0, sizeof(st));
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
		emit_group(rsinfo->setResult, rsinfo->setDesc, (StatsGroup *) lfirst(lc));
}

/*
 * The definitions before 'unknown': with 'remembered' or without, as the
 * result says (the one entry point they bind)
 */
Datum
idem_stats_records(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE ||
		(tupdesc->natts != STATS_COLS_PLAIN &&
		 tupdesc->natts != STATS_COLS_WITH_REMEMBERED))
		elog(ERROR, "idem_stats_records() must return %d or %d columns",
			 STATS_COLS_PLAIN, STATS_COLS_WITH_REMEMBERED);
	stats_records(fcinfo, tupdesc->natts);
	return (Datum) 0;
}

/* Every state, 'unknown' last */
Datum
idem_stats_records_1_6(PG_FUNCTION_ARGS)
{
	stats_records(fcinfo, STATS_COLS);
	return (Datum) 0;
}

/* ---- idem_inspect: one key of the calling role ---- */

static Datum
inspect_call(FunctionCallInfo fcinfo, bool tenant, int ncols)
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

		if (rsinfo->setDesc->natts != ncols)
			elog(ERROR, "idem_inspect() must return %d columns", ncols);
		values[0] = CStringGetTextDatum(idem_state_name(idem_record_state(&rec, now)));
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
idem_inspect_1_4(PG_FUNCTION_ARGS)
{
	return inspect_call(fcinfo, false, INSPECT_COLS);
}

/* idem_inspect(tenant, operation, key): idem_distribute(colocate_with) makes it */
Datum
idem_inspect_tenant(PG_FUNCTION_ARGS)
{
	return inspect_call(fcinfo, true, INSPECT_COLS);
}

/*
 * The entry point that the SQL definitions of earlier versions' scripts
 * bind, with either list of columns (see idem_begin)
 */
Datum
idem_inspect(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE ||
		(tupdesc->natts != INSPECT_COLS &&
		 tupdesc->natts != INSPECT_COLS_WITHOUT_RECOVERY))
		elog(ERROR, "idem_inspect() must return %d or %d columns",
			 INSPECT_COLS_WITHOUT_RECOVERY, INSPECT_COLS);
	return inspect_call(fcinfo, false, tupdesc->natts);
}
