/*-------------------------------------------------------------------------
 *
 * claim.c
 *	  idem_begin: the request read from the arguments, the key's record
 *	  looked at under the key lock, and what decide.c decides done --
 *	  claimed, replayed, waited for (wait.c) or refused (reply.c).
 *
 * The key lock is held only between looking and writing; every sleep
 * happens without it.  A replay is answered by a first look without the
 * lock (replay_without_lock says why that is safe).
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/xact.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "storage/latch.h"
#include "utils/timestamp.h"

#include "args.h"
#include "counters.h"
#include "decide.h"
#include "locks.h"
#include "read.h"
#include "reply.h"
#include "tokens.h"
#include "wait.h"
#include "write.h"

PG_FUNCTION_INFO_V1(idem_begin);
PG_FUNCTION_INFO_V1(idem_begin_1_4);
PG_FUNCTION_INFO_V1(idem_begin_tenant);

/*
 * The argument lists of idem_begin's SQL definitions: each entry point below
 * reads one of them.
 */
typedef enum BeginArgs
{
	/* operation, key, fingerprint, in_flight, lease, ttl */
	BEGIN_ARGS_BASIC,
	/* the same, then takeover and remember */
	BEGIN_ARGS_WITH_POLICIES
} BeginArgs;

/*
 * Did this backend's last idem_begin replay?  Replays come in runs -- a
 * client retrying, a wave of retries after an outage -- and so do new
 * keys; the next call starts with the look the last one needed.
 */
static bool last_was_replay = false;

/*
 * A look without the key lock that answers a replay: a live completed
 * record that no other transaction is changing stays as it is until its
 * retention ends (a finish, abort or renew of it writes nothing; purges
 * and takeovers touch only expired records).  False: decide under the
 * lock, looking again.
 */
static bool
replay_without_lock(IdemStore *store, const IdemKey *key,
					const ClaimRequest *req, IdemRecord *rec)
{
	IdemState	state;
	BeginAction action;
	BeginRefusal why;

	if (!idem_store_peek(store, key, rec) ||
		TransactionIdIsValid(rec->busy_xid) || IdemRecordIsPending(rec) ||
		!rec->in_snapshot)
		return false;
	state = idem_record_state(rec, GetCurrentTimestamp());
	if (state != IDEM_STATE_COMPLETED)
		return false;
	action = idem_decide_begin(rec, state, req, &why);
	if (action == BEGIN_REFUSE)
		idem_refuse_begin(why, key, rec, req->fingerprint);
	Assert(action == BEGIN_REPLAY && rec->response != NULL);
	return true;
}

/*
 * Claim the key, whose record (if found) is *rec, expired or lapsed:
 * insert a claim, or update the record to it, with a greater token.
 * Returns false, with the key lock released, when the record changed under
 * us after all (a purge); the caller looks again.  Else *rec is the claim.
 */
static bool
claim_write(IdemStore *store, const IdemKey *key, const ClaimRequest *req,
			bool found, TimestampTz now, IdemRecord *rec)
{
	IdemRecord	claim;

	memset(&claim, 0, sizeof(claim));
	claim.token = found ? idem_next_token_above(store, rec->token) :
		idem_next_token(store);
	claim.fingerprint = req->fingerprint;
	claim.ttl = req->ttl;
	claim.created_at = now;
	claim.expires_at = now + req->lease;
	claim.holder = req->takeover == IDEM_TAKEOVER_SESSION ?
		idem_session_holder() : 0;
	/* until the finish, forget_at - created_at is the remember time */
	claim.forget_at = req->remember > 0 ? now + req->remember : 0;
	if (found && IdemRecordIsPending(rec))
	{
		/* a takeover: the next owner resumes from the checkpoint */
		claim.checkpoint = rec->checkpoint;
		claim.takeovers = rec->takeovers + 1;
	}

	if (!found)
		idem_store_insert(store, key, &claim);
	else
	{
		claim.table = rec->table;
		claim.tid = rec->tid;
		claim.mine = rec->mine;
		if (idem_store_update(store, key, &claim) != TM_Ok)
		{
			idem_unlock_key(key);
			return false;
		}
		if (IdemRecordIsPending(rec))
			idem_count(IDEM_COUNT_TAKEOVERS, 1);
		/* sleepers on the lapsed claim: wait for our transaction now */
		idem_wake_waiters(key);
	}
	idem_unlock_key(key);
	*rec = claim;
	return true;
}

/*
 * The claim loop of idem_begin: look, decide, act, until an answer.
 * *waited_since is set to when it first had to wait for another attempt
 * (0: it never did).
 */
static ClaimStatus
claim_begin(IdemStore *store, const IdemKey *key, const ClaimRequest *req,
			IdemRecord *rec, TimestampTz *waited_since)
{
	TimestampTz lock_deadline = 0;
	bool		have_lock;

	*waited_since = 0;

	/*
	 * After a replay, expect another: answer it without the key lock.
	 * Otherwise, usually nobody else is working on the key: take its lock
	 * at once and decide with one look.  If another call holds the lock,
	 * do not queue behind it for a replay, so that replays of one key
	 * never queue behind each other.
	 */
	if (last_was_replay && replay_without_lock(store, key, req, rec))
		return CLAIM_REPLAY;
	have_lock = idem_try_lock_key(key);
	if (!have_lock && !last_was_replay && replay_without_lock(store, key, req, rec))
		return CLAIM_REPLAY;

	for (;;)
	{
		TimestampTz now;
		bool		found;
		IdemState	state = IDEM_STATE_EXPIRED;
		BeginRefusal why;

		/* reset before looking, so that a wake-up after the look counts */
		ResetLatch(MyLatch);
		if (!have_lock)
		{
			CHECK_FOR_INTERRUPTS();
			idem_lock_key(key);
		}
		have_lock = false;		/* every way out of this iteration unlocks */
		found = idem_store_fetch(store, key, rec);
		now = GetCurrentTimestamp();
		if (found)
			state = idem_record_state(rec, now);

		switch (idem_decide_begin(found ? rec : NULL, state, req, &why))
		{
			case BEGIN_REFUSE:
				idem_refuse_begin(why, key, rec, req->fingerprint);
				break;
			case BEGIN_REPLAY:
				idem_unlock_key(key);
				return CLAIM_REPLAY;
			case BEGIN_WAIT_WRITER:
				if (idem_state_is_live(state) && *waited_since == 0)
					*waited_since = now;
				idem_wait_for_writer(key, rec);
				break;
			case BEGIN_WAIT_CLAIM:
				if (*waited_since == 0)
					*waited_since = now;
				idem_wait_for_claim(store, key, rec, now, &lock_deadline);
				break;
			case BEGIN_CLAIM:
				if (claim_write(store, key, req, found, now, rec))
					return rec->checkpoint != NULL ? CLAIM_RECOVER : CLAIM_NEW;
				break;
		}
	}
}

/*
 * The request from idem_begin's arguments ([tenant,] operation, key,
 * fingerprint, in_flight, lease, ttl [, takeover, remember]), checked.
 * Where the definition has no takeover and remember, they come from their
 * settings.
 */
static void
begin_request(FunctionCallInfo fcinfo, bool tenant, BeginArgs args,
			  IdemKey *key, ClaimRequest *req)
{
	int			a = idem_key_from_args(fcinfo, key, tenant);
	bool		with_policies = (args == BEGIN_ARGS_WITH_POLICIES);
	bool		remember_given = with_policies && !PG_ARGISNULL(a + 5);
	int64		ttl_usecs;

	req->fingerprint = idem_fingerprint_arg(fcinfo, a);
	req->policy = idem_policy_arg(fcinfo, a + 1);
	req->lease = idem_lease_arg(fcinfo, a + 2);
	req->ttl = idem_ttl_arg(fcinfo, a + 3);
	ttl_usecs = idem_interval_usecs(&req->ttl, "ttl");
	req->takeover = idem_takeover_arg(fcinfo, with_policies ? a + 4 : -1);
	req->remember = idem_remember_arg(fcinfo, with_policies ? a + 5 : -1);

	if (req->lease <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency lease must be positive")));
	if (ttl_usecs < IDEM_MIN_TTL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency ttl must be at least 1 minute")));
	if (req->lease > ttl_usecs)
		idem_raise_lease_over_ttl(req->lease, &req->ttl);

	/*
	 * A default from idempotency.remember that is shorter than this call's
	 * ttl adds nothing to it: the key is kept for the ttl, as with 0.  Only
	 * an argument that says so is an error.
	 */
	if (req->remember != 0 && req->remember < ttl_usecs && !remember_given)
		req->remember = 0;
	if (req->remember != 0 && req->remember < ttl_usecs)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency remember must not be shorter than its ttl"),
				 errdetail("A key is remembered from its completion, after its response has been kept for the ttl.")));
}

/* The counters of one idem_begin that answered status */
static void
count_begin(ClaimStatus status, TimestampTz waited_since)
{
	idem_count(status == CLAIM_REPLAY ? IDEM_COUNT_REPLAYS : IDEM_COUNT_CLAIMS, 1);
	if (status == CLAIM_RECOVER)
		idem_count(IDEM_COUNT_RECOVERIES, 1);
	if (waited_since != 0)
	{
		idem_count(IDEM_COUNT_WAITS, 1);
		idem_count(IDEM_COUNT_WAIT_TIME, GetCurrentTimestamp() - waited_since);
	}
}

/* idem_begin, in any of its definitions */
static Datum
begin_call(FunctionCallInfo fcinfo, bool tenant, BeginArgs args)
{
	IdemKey		key;
	ClaimRequest req;
	IdemStore	store;
	IdemRecord	rec;
	ClaimStatus status;
	TimestampTz waited_since;

	idem_check_settings();
	begin_request(fcinfo, tenant, args, &key, &req);
	PreventCommandIfReadOnly("idem_begin()");
	PreventCommandIfParallelMode("idem_begin()");

	idem_store_open(&store, fcinfo->flinfo->fn_oid, RowExclusiveLock, &key);

	/*
	 * A delegated call runs in a backend Citus keeps open for the node it
	 * came from: the session a 'session' claim would follow is not the
	 * caller's.
	 */
	if (store.distributed && req.takeover == IDEM_TAKEOVER_SESSION)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("takeover => 'session' is not available on distributed idempotency records"),
				 errdetail("Citus runs the call in a connection of its own on the node that holds the key, which outlives the calling session or ends before it."),
				 errhint("Use takeover => 'lease' with a lease the attempt renews.")));
	status = claim_begin(&store, &key, &req, &rec, &waited_since);
	idem_store_close(&store, false);

	last_was_replay = (status == CLAIM_REPLAY);
	count_begin(status, waited_since);
	return idem_claim_result(fcinfo, status, &rec);
}

/* idem_begin(operation, key, ..., takeover, remember) */
Datum
idem_begin_1_4(PG_FUNCTION_ARGS)
{
	return begin_call(fcinfo, false, BEGIN_ARGS_WITH_POLICIES);
}

/*
 * idem_begin(tenant, operation, key, ..., takeover, remember), the form
 * idem_distribute(colocate_with) creates
 */
Datum
idem_begin_tenant(PG_FUNCTION_ARGS)
{
	return begin_call(fcinfo, true, BEGIN_ARGS_WITH_POLICIES);
}

/*
 * The entry point that the SQL definitions of earlier versions' scripts
 * bind, with either argument list: the current scripts bind the one of
 * theirs, but a database keeps its definitions until ALTER EXTENSION
 * UPDATE, while the server already loads this library.
 */
Datum
idem_begin(PG_FUNCTION_ARGS)
{
	return begin_call(fcinfo, false,
					  PG_NARGS() > 6 ? BEGIN_ARGS_WITH_POLICIES : BEGIN_ARGS_BASIC);
}
