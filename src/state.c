/*-------------------------------------------------------------------------
 *
 * state.c
 *	  A record's state, defined once: idem_begin decides by it, and
 *	  idem_inspect, idem_stats, idem_monitor (through idem_record_state())
 *	  and idem_forget report it.
 *
 * A pending claim made with takeover => 'session' lapses when the session
 * that made it ends, which only the lock table of the server where that
 * session runs can tell (locks.c).  A hot standby's lock table never has
 * the primary's sessions in it: there such a claim, within its lease, is
 * 'unknown', never a confident 'pending' or 'lapsed'.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/transam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "locks.h"
#include "state.h"

PG_FUNCTION_INFO_V1(idem_record_state_sql);

static const char *const state_names[IDEM_NUM_STATES] = {
	"pending", "lapsed", "completed", "expired", "remembered", "unknown"
};

const char *
idem_state_name(IdemState state)
{
	Assert(state >= 0 && state < IDEM_NUM_STATES);
	return state_names[state];
}

/*
 * The state of the newest version of a record at now.  A claim another
 * transaction is inserting, or one of our own transaction, is pending
 * whatever its lease says; a committed claim is pending until its lease
 * ends and, made with takeover => 'session', while its session lives.  A
 * completed record is completed within its retention, then remembered
 * until forget_at, then expired.  Only the session check looks beyond
 * *rec, at the lock table; nothing here writes or sleeps.
 */
IdemState
idem_record_state(const IdemRecord *rec, TimestampTz now)
{
	if (!IdemRecordIsPending(rec))
	{
		if (rec->expires_at > now)
			return IDEM_STATE_COMPLETED;
		return rec->forget_at > now ? IDEM_STATE_REMEMBERED : IDEM_STATE_EXPIRED;
	}
	if (rec->mine || rec->uncommitted)
		return IDEM_STATE_PENDING;
	if (rec->expires_at <= now)
		return IDEM_STATE_LAPSED;
	/* a claim being changed counts as live: the caller waits for the change */
	if (rec->holder == 0 || TransactionIdIsValid(rec->busy_xid))
		return IDEM_STATE_PENDING;
	if (RecoveryInProgress())
		return IDEM_STATE_UNKNOWN;
	return idem_session_alive(rec->holder) ? IDEM_STATE_PENDING : IDEM_STATE_LAPSED;
}

/*
 * idem_record_state(xmin, completed_at, expires_at, forget_at, holder, now):
 * the state of a committed version read by SQL (the view idem_monitor),
 * by the definition above.  xmin tells a version of the calling
 * transaction.
 */
Datum
idem_record_state_sql(PG_FUNCTION_ARGS)
{
	IdemRecord	rec;

	if (PG_ARGISNULL(2) || PG_ARGISNULL(5))
		PG_RETURN_NULL();
	memset(&rec, 0, sizeof(rec));
	rec.mine = !PG_ARGISNULL(0) &&
		TransactionIdIsCurrentTransactionId(DatumGetTransactionId(PG_GETARG_DATUM(0)));
	rec.completed_at = PG_ARGISNULL(1) ? 0 : PG_GETARG_TIMESTAMPTZ(1);
	rec.expires_at = PG_GETARG_TIMESTAMPTZ(2);
	rec.forget_at = PG_ARGISNULL(3) ? 0 : PG_GETARG_TIMESTAMPTZ(3);
	rec.holder = PG_ARGISNULL(4) ? 0 : PG_GETARG_INT64(4);
	rec.busy_xid = InvalidTransactionId;
	PG_RETURN_TEXT_P(cstring_to_text(idem_state_name(idem_record_state(&rec,
																	   PG_GETARG_TIMESTAMPTZ(5)))));
}
