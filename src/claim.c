/*-------------------------------------------------------------------------
 *
 * claim.c
 *	  The claim logic: idem_begin, idem_finish, idem_abort and idem_renew.
 *
 * A record is the calling role's (operation, key).  It is *live* while
 * another transaction is inserting it, or while it is pending with an
 * unexpired lease, or completed within its retention; anything else counts
 * as absent.  The rules, applied to the newest version of the record under
 * the key lock (locks.c):
 *
 *	absent or expired			claim it: status 'new' with a fresh token, or
 *								'recover' when it takes over a claim that
 *								has a checkpoint
 *	live, other fingerprint		IK422
 *	being changed by another	raise: IK409; wait: sleep on that
 *	transaction					transaction, then look again
 *	pending, ours				IK409 (a transaction never waits on itself)
 *	pending, committed			raise: IK409; wait: sleep until finish,
 *								abort or the lease end, then look again
 *	completed					'replay' -- or 40001 when a REPEATABLE READ
 *								snapshot cannot see that result
 *	completed, past its ttl		IK410: its response is gone,
 *	but remembered				the request must not run again
 *
 * A pending claim made with takeover => 'session' also lapses when the
 * session that made it has ended (locks.c).
 * The key lock is held only between looking and writing; every sleep
 * happens without it.  A replay is answered by a first look without the
 * lock (claim_begin says why that is safe).
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/htup_details.h"
#include "access/xact.h"
#include "common/hashfn.h"
#include "common/int.h"
#include "fmgr.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "storage/proc.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"
#include "utils/typcache.h"

#include "args.h"
#include "claim.h"
#include "counters.h"
#include "idempotency.h"
#include "locks.h"
#include "read.h"
#include "store.h"
#include "tokens.h"
#include "write.h"

PG_FUNCTION_INFO_V1(idem_begin);
PG_FUNCTION_INFO_V1(idem_finish);
PG_FUNCTION_INFO_V1(idem_abort);
PG_FUNCTION_INFO_V1(idem_renew);
PG_FUNCTION_INFO_V1(idem_checkpoint);
PG_FUNCTION_INFO_V1(idem_forget);
PG_FUNCTION_INFO_V1(idem_begin_tenant);
PG_FUNCTION_INFO_V1(idem_finish_tenant);
PG_FUNCTION_INFO_V1(idem_abort_tenant);
PG_FUNCTION_INFO_V1(idem_renew_tenant);
PG_FUNCTION_INFO_V1(idem_checkpoint_tenant);
PG_FUNCTION_INFO_V1(idem_forget_tenant);

typedef enum ClaimStatus
{
	CLAIM_NEW,
	CLAIM_REPLAY,
	CLAIM_RECOVER				/* taken over, with the checkpoint to resume from */
} ClaimStatus;

static const char *const status_names[] = {"new", "replay", "recover"};

/* ---- errors ---- */

/*
 * A fingerprint for a message: hex, whole up to FINGERPRINT_SHOWN_BYTES
 * (a SHA-256 is 32), cut beyond.
 */
#define FINGERPRINT_SHOWN_BYTES	64

static char *
fingerprint_text(const bytea *fp)
{
	Size		len;
	Size		shown;
	char	   *hex;

	if (fp == NULL)
		return "NULL";
	len = VARSIZE_ANY_EXHDR(fp);
	shown = Min(len, FINGERPRINT_SHOWN_BYTES);
	hex = palloc(shown * 2 + 1);
	hex[hex_encode(VARDATA_ANY(fp), shown, hex)] = '\0';
	if (len > shown)
		return psprintf("\\x%s... (%zu bytes)", hex, len);
	return psprintf("\\x%s", hex);
}

static bool
fingerprints_equal(const bytea *a, const bytea *b)
{
	if (a == NULL || b == NULL)
		return a == b;
	return VARSIZE_ANY_EXHDR(a) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(a), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(a)) == 0;
}

static void
check_fingerprint(const IdemKey *key, const IdemRecord *rec, const bytea *fp)
{
	if (fingerprints_equal(rec->fingerprint, fp))
		return;
	idem_count(IDEM_COUNT_KEY_REUSE, 1);
	ereport(ERROR,
			(errcode(ERRCODE_IDEMPOTENCY_KEY_REUSED),
			 errmsg("idempotency key \"%s\" was already used for a different request",
					text_to_cstring(key->key)),
			 errdetail_internal("Stored fingerprint: %s. Request fingerprint: %s.",
					   fingerprint_text(rec->fingerprint),
					   fingerprint_text(fp)),
			 errhint("Use a new key for a new request.")));
}

static void
raise_in_progress(const IdemKey *key, bool ours)
{
	idem_count(IDEM_COUNT_IN_PROGRESS, 1);
	ereport(ERROR,
			(errcode(ERRCODE_IDEMPOTENCY_IN_PROGRESS),
			 errmsg("request with idempotency key \"%s\" is already in progress",
					text_to_cstring(key->key)),
			 ours ?
			 errdetail("This transaction already holds the key for operation \"%s\".",
					   text_to_cstring(key->operation)) :
			 errdetail("Another attempt holds the key for operation \"%s\".",
					   text_to_cstring(key->operation)),
			 ours ? 0 : errhint("Retry after the other attempt has finished.")));
}

/*
 * IK412 for a token that does not hold the key.  The DETAIL says what the
 * key's record shows, looked up once more for the message: no record, a
 * greater token (a later claim, or a token of another key), this claim
 * finished, or a smaller token (one this key never had).
 */
static void
raise_stale_token(FunctionCallInfo fcinfo, const IdemKey *key, int64 token)
{
	IdemStore	store;
	IdemRecord	rec;
	bool		found;
	char	   *detail;

	idem_store_open(&store, fcinfo->flinfo->fn_oid, AccessShareLock, key);
	found = idem_store_fetch(&store, key, &rec);
	idem_store_close(&store, false);

	if (!found)
		detail = psprintf("Role \"%s\" has no record of operation \"%s\" with this key: "
						  "the claim was aborted, rolled back or purged after it expired, "
						  "or the token was never issued for this key.",
						  GetUserNameFromId(key->role, false),
						  text_to_cstring(key->operation));
	else if (rec.token > token)
		detail = psprintf("The key is held by a claim with a greater token, now %s: "
						  "this token's claim was taken over after its lease lapsed, or was aborted, "
						  "or the token was never issued for this key.",
						  IdemRecordIsPending(&rec) ? "pending" : "completed");
	else if (rec.token < token)
		detail = pstrdup("The key's record has a smaller token: "
						 "this token was never issued for this key, "
						 "or the transaction that claimed the key with it rolled back.");
	else if (!IdemRecordIsPending(&rec))
		detail = pstrdup("The claim was finished already: its response is stored.");
	else
		detail = pstrdup("The claim was changed by a concurrent transaction.");

	ereport(ERROR,
			(errcode(ERRCODE_IDEMPOTENCY_STALE_TOKEN),
			 errmsg("token %lld does not hold idempotency key \"%s\"",
					(long long) token, text_to_cstring(key->key)),
			 errdetail_internal("%s", detail)));
}

/* 22023 for a lease longer than the ttl, showing both */
static void
raise_lease_over_ttl(int64 lease, const Interval *ttl)
{
	Interval	lease_iv;

	memset(&lease_iv, 0, sizeof(lease_iv));
	lease_iv.time = lease;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("idempotency lease must not be longer than its ttl"),
			 errdetail("The lease is %s and the ttl is %s.",
					   DatumGetCString(DirectFunctionCall1(interval_out,
														   IntervalPGetDatum(&lease_iv))),
					   DatumGetCString(DirectFunctionCall1(interval_out,
														   IntervalPGetDatum(ttl))))));
}

static void
raise_response_expired(const IdemKey *key, const IdemRecord *rec)
{
	idem_count(IDEM_COUNT_EXPIRED, 1);
	ereport(ERROR,
			(errcode(ERRCODE_IDEMPOTENCY_RESPONSE_EXPIRED),
			 errmsg("request with idempotency key \"%s\" was completed, and its stored response has expired",
					text_to_cstring(key->key)),
			 errdetail("It was completed at %s; its response was kept until %s, the key is remembered until %s.",
					   pstrdup(timestamptz_to_str(rec->completed_at)),
					   pstrdup(timestamptz_to_str(rec->expires_at)),
					   pstrdup(timestamptz_to_str(rec->forget_at))),
			 errhint("Do not run the request again; use a new key for a new request.")));
}

/* ---- idem_begin ---- */

/*
 * Live: another transaction is inserting it, or it is pending in ours, or
 * it is within its lease / retention -- and, for a committed claim made
 * with takeover => 'session', the session that made it is still there.
 * Anything else counts as absent.
 */
static bool
record_is_live(const IdemRecord *rec, TimestampTz now)
{
	if (IdemRecordIsPending(rec) && (rec->mine || rec->uncommitted))
		return true;
	if (rec->expires_at <= now)
		return false;
	if (IdemRecordIsPending(rec) && rec->holder != 0 &&
		!TransactionIdIsValid(rec->busy_xid))
		return idem_session_alive(rec->holder);
	return true;
}

/* Completed, past its retention, and still remembered */
static bool
record_is_remembered(const IdemRecord *rec, TimestampTz now)
{
	return !IdemRecordIsPending(rec) && rec->expires_at <= now &&
		rec->forget_at > now;
}

/* What idem_begin was asked for */
typedef struct ClaimRequest
{
	bytea	   *fingerprint;
	IdemInFlightPolicy policy;
	IdemTakeover takeover;
	int64		lease;
	Interval	ttl;
	int64		remember;		/* 0: off */
} ClaimRequest;

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
replay_without_lock(IdemStore *store, const IdemKey *key, bytea *fingerprint,
					IdemRecord *rec)
{
	if (!idem_store_peek(store, key, rec) ||
		TransactionIdIsValid(rec->busy_xid) || IdemRecordIsPending(rec) ||
		!rec->in_snapshot || !record_is_live(rec, GetCurrentTimestamp()))
		return false;
	check_fingerprint(key, rec, fingerprint);
	Assert(rec->response != NULL);
	return true;
}

/*
 * The claim loop of idem_begin.  *waited_since is set to when it first had
 * to wait (0: it never did).
 */
static ClaimStatus
claim_begin(IdemStore *store, const IdemKey *key, const ClaimRequest *req,
			IdemRecord *rec, TimestampTz *waited_since)
{
	TimestampTz lock_deadline = 0;
	bytea	   *fingerprint = req->fingerprint;
	IdemInFlightPolicy policy = req->policy;
	bool		have_lock;

	*waited_since = 0;

	/*
	 * After a replay, expect another: answer it without the key lock.
	 * Otherwise, usually nobody else is working on the key: take its lock
	 * at once and decide with one look.  If another call holds the lock,
	 * do not queue behind it for a replay, so that replays of one key
	 * never queue behind each other.
	 */
	if (last_was_replay && replay_without_lock(store, key, fingerprint, rec))
		return CLAIM_REPLAY;
	have_lock = idem_try_lock_key(key);
	if (!have_lock && !last_was_replay &&
		replay_without_lock(store, key, fingerprint, rec))
		return CLAIM_REPLAY;

	for (;;)
	{
		IdemRecord	claim;
		TimestampTz now;
		bool		found;
		Oid			relids[IDEM_NUM_TABLES];
		int			nrelids;

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

		if (found && record_is_live(rec, now))
		{
			check_fingerprint(key, rec, fingerprint);

			if (TransactionIdIsValid(rec->busy_xid))
			{
				/* another transaction is claiming, finishing or aborting it */
				if (policy == IDEM_IN_FLIGHT_RAISE)
					raise_in_progress(key, false);
				idem_unlock_key(key);
				if (*waited_since == 0)
					*waited_since = now;
				idem_wait_for_xact(rec->busy_xid);
				continue;
			}

			if (!IdemRecordIsPending(rec))
			{
				if (!rec->in_snapshot)
					ereport(ERROR,
							(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
							 errmsg("could not serialize access due to a concurrent request with idempotency key \"%s\"",
									text_to_cstring(key->key)),
							 errdetail("Its result was committed after this transaction's snapshot was taken."),
							 errhint("Retry the transaction: the retry will replay the result.")));
				idem_unlock_key(key);
				return CLAIM_REPLAY;
			}

			/* pending: held by us, or by a committed claim with a live lease */
			if (rec->mine)
				raise_in_progress(key, true);
			if (policy == IDEM_IN_FLIGHT_RAISE)
				raise_in_progress(key, false);
			if (*waited_since == 0)
				*waited_since = now;
			if (lock_deadline == 0 && LockTimeout > 0)
				lock_deadline = TimestampTzPlusMilliseconds(now, LockTimeout);

			/*
			 * Sleep without our lock on the table: a VACUUM FULL queued
			 * behind it would hold up the owner's idem_finish, and the
			 * deadlock detector cannot see a latch sleep.  (If this
			 * transaction locked the table before this call, the lock
			 * stays; the sleep then ends when someone queues behind it.)
			 */
			nrelids = 0;
			for (int t = 0; t < store->ntables; t++)
				if (store->heap[t] != NULL)
					relids[nrelids++] = RelationGetRelid(store->heap[t]);
			idem_store_close(store, true);
			idem_wait_for_wakeup(key, rec->holder, rec->expires_at,
								 lock_deadline, relids, nrelids);
			idem_store_reopen(store);
			continue;
		}

		if (found && TransactionIdIsValid(rec->busy_xid))
		{
			/* an expired record that is being purged or taken over */
			idem_unlock_key(key);
			idem_wait_for_xact(rec->busy_xid);
			continue;
		}

		if (found && record_is_remembered(rec, now))
		{
			check_fingerprint(key, rec, fingerprint);
			raise_response_expired(key, rec);
		}

		/* absent or expired: claim it */
		memset(&claim, 0, sizeof(claim));
		claim.token = found ? idem_next_token_above(store, rec->token) :
			idem_next_token(store);
		claim.fingerprint = fingerprint;
		claim.ttl = req->ttl;
		claim.created_at = now;
		claim.completed_at = 0;
		claim.expires_at = now + req->lease;
		claim.response = NULL;
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
				/* changed under us after all (by a purge): look again */
				idem_unlock_key(key);
				continue;
			}
			if (IdemRecordIsPending(rec))
				idem_count(IDEM_COUNT_TAKEOVERS, 1);
			/* sleepers on the lapsed claim: wait for our transaction now */
			idem_wake_waiters(key);
		}
		idem_unlock_key(key);
		*rec = claim;
		return claim.checkpoint != NULL ? CLAIM_RECOVER : CLAIM_NEW;
	}
}

static Oid	result_fn_oid = InvalidOid;
static Oid	result_type = InvalidOid;

/*
 * idem_begin([tenant,] operation, key, fingerprint, in_flight, lease, ttl
 *			  [, takeover, remember]): the SQL function of a schema without
 * takeover and remember has the first six arguments only.  The tenant
 * form is the one idem_distribute(colocate_with) creates.
 */
static Datum
begin_call(FunctionCallInfo fcinfo, bool tenant)
{
	IdemKey		key;
	int			a;				/* the argument after the key */
	ClaimRequest req;
	int64		ttl_usecs;
	IdemStore	store;
	IdemRecord	rec;
	ClaimStatus status;
	TimestampTz waited_since;
	TupleDesc	tupdesc;
	HeapTuple	result;
	Datum		values[3];
	bool		nulls[3] = {false, false, false};

	idem_check_settings();

	a = idem_key_from_args(fcinfo, &key, tenant);
	req.fingerprint = idem_fingerprint_arg(fcinfo, a);
	req.policy = idem_policy_arg(fcinfo, a + 1);

	req.lease = idem_lease_arg(fcinfo, a + 2);
	req.ttl = idem_ttl_arg(fcinfo, a + 3);
	ttl_usecs = idem_interval_usecs(&req.ttl, "ttl");
	req.takeover = idem_takeover_arg(fcinfo, a + 4);
	req.remember = idem_remember_arg(fcinfo, a + 5);

	if (req.lease <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency lease must be positive")));
	if (ttl_usecs < IDEM_MIN_TTL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency ttl must be at least 1 minute")));
	if (req.lease > ttl_usecs)
		raise_lease_over_ttl(req.lease, &req.ttl);
	/*
	 * A default from idempotency.remember that is shorter than this call's
	 * ttl adds nothing to it: the key is kept for the ttl, as with 0.  Only
	 * an argument that says so is an error.
	 */
	if (req.remember != 0 && req.remember < ttl_usecs &&
		(PG_NARGS() <= a + 5 || PG_ARGISNULL(a + 5)))
		req.remember = 0;
	if (req.remember != 0 && req.remember < ttl_usecs)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency remember must not be shorter than its ttl"),
				 errdetail("A key is remembered from its completion, after its response has been kept for the ttl.")));

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
	idem_count(status == CLAIM_REPLAY ? IDEM_COUNT_REPLAYS : IDEM_COUNT_CLAIMS, 1);
	if (status == CLAIM_RECOVER)
		idem_count(IDEM_COUNT_RECOVERIES, 1);
	if (waited_since != 0)
	{
		idem_count(IDEM_COUNT_WAITS, 1);
		idem_count(IDEM_COUNT_WAIT_TIME, GetCurrentTimestamp() - waited_since);
	}

	/*
	 * The result type, idem_claim: its OID is looked up once per backend
	 * (a FROM-clause call gets a fresh FmgrInfo at every execution, so
	 * fn_extra would not keep it), its descriptor comes from the type cache.
	 */
	if (fcinfo->flinfo->fn_oid != result_fn_oid)
	{
		result_type = get_func_rettype(fcinfo->flinfo->fn_oid);
		result_fn_oid = fcinfo->flinfo->fn_oid;
	}
	tupdesc = lookup_rowtype_tupdesc(result_type, -1);

	values[0] = CStringGetTextDatum(status_names[status]);
	if (status == CLAIM_REPLAY)
	{
		nulls[1] = true;
		values[2] = JsonbPGetDatum(rec.response);
	}
	else
	{
		values[1] = Int64GetDatum(rec.token);
		/* 'recover': the state to resume from */
		values[2] = JsonbPGetDatum(rec.checkpoint);
		nulls[2] = (rec.checkpoint == NULL);
	}
	result = heap_form_tuple(tupdesc, values, nulls);
	ReleaseTupleDesc(tupdesc);
	PG_RETURN_DATUM(HeapTupleGetDatum(result));
}

/* ---- idem_finish, idem_abort, idem_renew, idem_checkpoint ---- */

typedef enum ClaimAction
{
	CLAIM_FINISH,				/* store the response, start the retention */
	CLAIM_ABORT,				/* release the key: errors are not cached */
	CLAIM_RENEW,				/* extend the lease */
	CLAIM_CHECKPOINT			/* record progress */
} ClaimAction;

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
		TimestampTz now;
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

		now = GetCurrentTimestamp();
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
				result = idem_store_update(store, key, rec);
				break;
			case CLAIM_CHECKPOINT:
				rec->checkpoint = value;
				result = idem_store_update(store, key, rec);
				break;
			case CLAIM_ABORT:
				result = idem_store_delete(store, key, rec);
				break;
			case CLAIM_RENEW:
				if (lease > idem_interval_usecs(&rec->ttl, "ttl"))
					raise_lease_over_ttl(lease, &rec->ttl);
				rec->expires_at = now + lease;
				result = idem_store_update(store, key, rec);
				break;
			default:
				elog(ERROR, "unknown claim action %d", (int) action);
		}

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

/*
 * act_on_claim for an SQL function: a write, so not in read-only mode nor
 * in a parallel operation
 */
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

Datum
idem_begin(PG_FUNCTION_ARGS)
{
	return begin_call(fcinfo, false);
}

Datum
idem_begin_tenant(PG_FUNCTION_ARGS)
{
	return begin_call(fcinfo, true);
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
		raise_stale_token(fcinfo, &key, token);
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
		raise_stale_token(fcinfo, &key, token);
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
		raise_stale_token(fcinfo, &key, token);
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

/* ---- idem_forget ---- */

/*
 * A record's state as idem_begin would take it: "pending", "lapsed" (the
 * next claim takes it over: its lease is over, or its session has ended),
 * "completed", "remembered" or "expired"
 */
const char *
idem_record_state(const IdemRecord *rec, TimestampTz now)
{
	if (IdemRecordIsPending(rec))
		return record_is_live(rec, now) ? "pending" : "lapsed";
	if (rec->expires_at > now)
		return "completed";
	return record_is_remembered(rec, now) ? "remembered" : "expired";
}

/*
 * idem_forget([tenant,] operation, key, role, force): delete one role's record of a
 * key on purpose -- a support team's way out of a stored response that is
 * wrong.  The next idem_begin of the key gets 'new', with a token greater
 * than the forgotten one, and a duplicate waiting on the key wakes to it.
 * A pending claim that a live attempt holds is refused (IK409) unless
 * force: its finish then fails with IK412, as after a takeover.  A record
 * another transaction is writing cannot be forgotten until it commits.
 * Returns the state the record was in, or NULL when there was none.
 */
static Datum
forget_call(FunctionCallInfo fcinfo, bool tenant)
{
	IdemKey		key;
	int			a;
	IdemStore	store;
	IdemRecord	rec;
	const char *state = NULL;
	bool		force;

	a = tenant ? 3 : 2;			/* role, force: after the key */
	idem_require_arg(fcinfo, a, "role");
	idem_require_arg(fcinfo, a + 1, "force");
	idem_key_from_args(fcinfo, &key, tenant);
	key.role = get_role_oid(NameStr(*PG_GETARG_NAME(a)), false);
	idem_key_hash(&key);
	force = PG_GETARG_BOOL(a + 1);

	PreventCommandIfReadOnly("idem_forget()");
	PreventCommandIfParallelMode("idem_forget()");
	idem_lock_key(&key);
	idem_store_open(&store, fcinfo->flinfo->fn_oid, RowExclusiveLock, &key);
	for (;;)
	{
		TimestampTz now = GetCurrentTimestamp();

		if (!idem_store_fetch(&store, &key, &rec))
			break;
		if (TransactionIdIsValid(rec.busy_xid) && !rec.mine)
			ereport(ERROR,
					(errcode(ERRCODE_IDEMPOTENCY_IN_PROGRESS),
					 errmsg("idempotency key \"%s\" is being written by another transaction",
							text_to_cstring(key.key)),
					 errhint("Forget it once that transaction has ended.")));
		state = idem_record_state(&rec, now);
		if (strcmp(state, "pending") == 0 && !force)
			ereport(ERROR,
					(errcode(ERRCODE_IDEMPOTENCY_IN_PROGRESS),
					 errmsg("idempotency key \"%s\" is held by a live attempt",
							text_to_cstring(key.key)),
					 errdetail("Its claim (token %lld) is pending until %s.",
							   (long long) rec.token, timestamptz_to_str(rec.expires_at)),
					 errhint("Pass force => true to forget it anyway: the attempt's finish then fails with IK412.")));
		if (idem_store_delete(&store, &key, &rec) == TM_Ok)
			break;
		/* changed under us (a purge): look again */
		state = NULL;
	}
	if (state != NULL)
	{
		idem_wake_waiters(&key);
		idem_count(IDEM_COUNT_FORGOTTEN, 1);
	}
	idem_store_close(&store, false);
	idem_unlock_key(&key);

	if (state == NULL)
		PG_RETURN_NULL();
	PG_RETURN_TEXT_P(cstring_to_text(state));
}

Datum
idem_forget(PG_FUNCTION_ARGS)
{
	return forget_call(fcinfo, false);
}

Datum
idem_forget_tenant(PG_FUNCTION_ARGS)
{
	return forget_call(fcinfo, true);
}
