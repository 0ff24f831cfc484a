/*-------------------------------------------------------------------------
 *
 * finish.c
 *	  What the holder of a claim does with it: idem_finish (store the
 *	  response), idem_abort (release the key: errors are not cached),
 *	  idem_renew (extend the lease) and idem_checkpoint (record progress),
 *	  each with the claim's token, which must still hold the key.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"

#include "args.h"
#include "counters.h"
#include "locks.h"
#include "read.h"
#include "reply.h"
#include "write.h"

PG_FUNCTION_INFO_V1(idem_finish);
PG_FUNCTION_INFO_V1(idem_abort);
PG_FUNCTION_INFO_V1(idem_renew);
PG_FUNCTION_INFO_V1(idem_checkpoint);
PG_FUNCTION_INFO_V1(idem_finish_tenant);
PG_FUNCTION_INFO_V1(idem_abort_tenant);
PG_FUNCTION_INFO_V1(idem_renew_tenant);
PG_FUNCTION_INFO_V1(idem_checkpoint_tenant);

typedef enum ClaimAction
{
	CLAIM_FINISH,				/* store the response, start the retention */
	CLAIM_ABORT,				/* release the key: errors are not cached */
	CLAIM_RENEW,				/* extend the lease */
	CLAIM_CHECKPOINT			/* record progress */
} ClaimAction;

/* Write action to the pending record rec, which token holds */
static TM_Result
apply_action(IdemStore *store, const IdemKey *key, ClaimAction action,
			 Jsonb *value, int64 lease, IdemRecord *rec)
{
	TimestampTz now = GetCurrentTimestamp();

	switch (action)
	{
		case CLAIM_FINISH:
			/* a remembered key: until completed_at + remember */
			if (rec->forget_at != 0)
				rec->forget_at = now + (rec->forget_at - rec->created_at);
			rec->completed_at = now;
			rec->expires_at = now + idem_interval_usecs(&rec->ttl, "ttl");
			rec->response = value;
			rec->checkpoint = NULL;
			rec->holder = 0;
			return idem_store_update(store, key, rec);
		case CLAIM_CHECKPOINT:
			rec->checkpoint = value;
			return idem_store_update(store, key, rec);
		case CLAIM_ABORT:
			return idem_store_delete(store, key, rec);
		case CLAIM_RENEW:
			if (lease > idem_interval_usecs(&rec->ttl, "ttl"))
				idem_raise_lease_over_ttl(lease, &rec->ttl);
			rec->expires_at = now + lease;
			return idem_store_update(store, key, rec);
	}
	elog(ERROR, "unknown claim action %d", (int) action);
	pg_unreachable();
}

/*
 * Apply an action to the pending record that token holds.  Returns false,
 * changing nothing, when the token does not hold the key.  *rec is the
 * record as written.
 *
 * A committed claim may have sleepers (locks.c); the key lock orders us
 * with them and they are woken, to find our uncommitted version and wait
 * on our transaction lock instead.  So a version this transaction wrote --
 * its own claim, or one it already renewed -- has no sleepers and cannot be
 * touched by anyone else until we commit: it needs neither the key lock
 * nor a wake-up.  Every write over a committed version keeps that true by
 * waking the sleepers.
 */
static bool
act_on_claim(IdemStore *store, const IdemKey *key, int64 token,
			 ClaimAction action, Jsonb *value, int64 lease, IdemRecord *rec)
{
	bool		locked = false;

	for (;;)
	{
		TM_Result	result;

		if (!idem_store_fetch_claim(store, key, token, rec))
			break;
		if (TransactionIdIsValid(rec->busy_xid))
		{
			if (locked)
				idem_unlock_key(key);
			locked = false;
			idem_wait_for_xact(rec->busy_xid);
			continue;
		}
		if (rec->token != token || !IdemRecordIsPending(rec))
			break;
		/*
		 * A version of ours needs no key lock -- unless this write moves it
		 * to idem_result (a finish or checkpoint in mode 'completed'): look-ups
		 * hold the key lock while they read both tables, and must not see
		 * a move between the two reads.
		 */
		if ((!rec->mine || idem_store_moves(store, rec,
											action == CLAIM_FINISH ||
											action == CLAIM_CHECKPOINT)) &&
			!locked)
		{
			idem_lock_key(key);
			locked = true;
			continue;			/* look again, now in order with waiters */
		}

		/* a version of ours has no sleepers; any other is ours under the key lock */
		Assert(rec->mine || locked);
		Assert(rec->token == token && IdemRecordIsPending(rec));

		result = apply_action(store, key, action, value, lease, rec);
		if (result != TM_Ok)
			continue;			/* changed under us (purged): look again */

		if (locked)
		{
			/* a renew wakes them too: their sleep ends at the old lease end */
			idem_wake_waiters(key);
			idem_unlock_key(key);
		}
		return true;
	}

	if (locked)
		idem_unlock_key(key);
	idem_count(IDEM_COUNT_FENCED, 1);
	return false;
}

/* act_on_claim for an SQL function: a write, so not in read-only mode */
static bool
act_on_claim_for(FunctionCallInfo fcinfo, const char *fname, const IdemKey *key,
				 int64 token, ClaimAction action, Jsonb *response, int64 lease,
				 IdemRecord *rec)
{
	IdemStore	store;
	bool		held;

	PreventCommandIfReadOnly(fname);
	PreventCommandIfParallelMode(fname);

	idem_store_open(&store, fcinfo->flinfo->fn_oid, RowExclusiveLock, key);
	held = act_on_claim(&store, key, token, action, response, lease, rec);
	idem_store_close(&store, false);
	return held;
}

static Datum
finish_call(FunctionCallInfo fcinfo, bool tenant)
{
	IdemKey		key;
	int			a;
	int64		token;
	Jsonb	   *response;
	IdemRecord	rec;
	bool		held;

	idem_check_settings();

	a = idem_key_from_args(fcinfo, &key, tenant);
	token = idem_token_arg(fcinfo, a);
	response = idem_response_arg(fcinfo, a + 1, "response");

	held = act_on_claim_for(fcinfo, "idem_finish()", &key, token, CLAIM_FINISH,
							response, 0, &rec);

	if (!held)
		idem_raise_stale_token(fcinfo->flinfo->fn_oid, &key, token);
	PG_RETURN_VOID();
}

Datum
idem_finish(PG_FUNCTION_ARGS)
{
	return finish_call(fcinfo, false);
}

Datum
idem_finish_tenant(PG_FUNCTION_ARGS)
{
	return finish_call(fcinfo, true);
}

static Datum
abort_call(FunctionCallInfo fcinfo, bool tenant)
{
	IdemKey		key;
	int64		token;
	IdemRecord	rec;
	bool		held;

	idem_check_settings();

	token = idem_token_arg(fcinfo, idem_key_from_args(fcinfo, &key, tenant));

	held = act_on_claim_for(fcinfo, "idem_abort()", &key, token, CLAIM_ABORT,
							NULL, 0, &rec);

	if (held)
		idem_count(IDEM_COUNT_ABORTS, 1);
	PG_RETURN_BOOL(held);
}

Datum
idem_abort(PG_FUNCTION_ARGS)
{
	return abort_call(fcinfo, false);
}

Datum
idem_abort_tenant(PG_FUNCTION_ARGS)
{
	return abort_call(fcinfo, true);
}

/*
 * idem_renew([tenant,] operation, key, token, lease): extend a claim for a
 * long action; returns the new end of the lease.  Waiters keep waiting.
 */
static Datum
renew_call(FunctionCallInfo fcinfo, bool tenant)
{
	IdemKey		key;
	int			a;
	int64		token;
	int64		lease;
	IdemRecord	rec;
	bool		held;

	idem_check_settings();

	a = idem_key_from_args(fcinfo, &key, tenant);
	token = idem_token_arg(fcinfo, a);
	idem_require_arg(fcinfo, a + 1, "lease");
	lease = idem_interval_usecs(PG_GETARG_INTERVAL_P(a + 1), "lease");
	if (lease <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency lease must be positive")));

	held = act_on_claim_for(fcinfo, "idem_renew()", &key, token, CLAIM_RENEW,
							NULL, lease, &rec);

	if (!held)
		idem_raise_stale_token(fcinfo->flinfo->fn_oid, &key, token);
	PG_RETURN_TIMESTAMPTZ(rec.expires_at);
}

Datum
idem_renew(PG_FUNCTION_ARGS)
{
	return renew_call(fcinfo, false);
}

Datum
idem_renew_tenant(PG_FUNCTION_ARGS)
{
	return renew_call(fcinfo, true);
}

/*
 * idem_checkpoint([tenant,] operation, key, token, state): record progress on a
 * pending claim.  If the claim is taken over, the next owner
 * gets status 'recover' with this state.  In durability mode 'completed'
 * the claim moves to the logged idem_result with it, so the checkpoint
 * survives a crash together with its claim.
 */
static Datum
checkpoint_call(FunctionCallInfo fcinfo, bool tenant)
{
	IdemKey		key;
	int			a;
	int64		token;
	Jsonb	   *state;
	IdemRecord	rec;

	idem_check_settings();

	a = idem_key_from_args(fcinfo, &key, tenant);
	token = idem_token_arg(fcinfo, a);
	state = idem_response_arg(fcinfo, a + 1, "state");

	if (!act_on_claim_for(fcinfo, "idem_checkpoint()", &key, token,
						  CLAIM_CHECKPOINT, state, 0, &rec))
		idem_raise_stale_token(fcinfo->flinfo->fn_oid, &key, token);
	PG_RETURN_VOID();
}

Datum
idem_checkpoint(PG_FUNCTION_ARGS)
{
	return checkpoint_call(fcinfo, false);
}

Datum
idem_checkpoint_tenant(PG_FUNCTION_ARGS)
{
	return checkpoint_call(fcinfo, true);
}
