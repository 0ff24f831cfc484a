/*-------------------------------------------------------------------------
 *
 * decide.c
 *	  What idem_begin does with the newest version of a key's record: the
 *	  record, its state (state.c) and the request in, the action out.
 *	  Nothing here reads, writes, locks or sleeps: claim.c looks, calls
 *	  idem_decide_begin, and acts.
 *
 * The rules, for a record in each state:
 *
 *	none, expired, lapsed		claim it: status 'new' with a fresh token, or
 *								'recover' when it takes over a claim that
 *								has a checkpoint
 *	live, other fingerprint		IK422
 *	being written by another	raise: IK409; wait: wait for that
 *	transaction					transaction, then look again
 *	pending, ours				IK409 (a transaction never waits on itself)
 *	pending, committed			raise: IK409; wait: sleep until finish,
 *								abort or the lease end, then look again
 *	completed					'replay' -- or 40001 when a REPEATABLE READ
 *								snapshot cannot see that result
 *	remembered					IK410 (IK422 for another fingerprint): its
 *								response is gone, the request must not run
 *								again
 *
 * An expired or lapsed record that another transaction is writing (a purge,
 * a takeover) is waited for, then looked at again.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/transam.h"

#include "decide.h"

/* NULL equals only NULL */
bool
idem_fingerprints_equal(const bytea *a, const bytea *b)
{
	if (a == NULL || b == NULL)
		return a == b;
	return VARSIZE_ANY_EXHDR(a) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(a), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(a)) == 0;
}

static BeginAction
refuse(BeginRefusal why, BeginRefusal *refusal)
{
	*refusal = why;
	return BEGIN_REFUSE;
}

/*
 * The action for record rec (NULL: the key has none) in state, on request
 * req.  *refusal says why for BEGIN_REFUSE, else REFUSE_NONE.
 */
BeginAction
idem_decide_begin(const IdemRecord *rec, IdemState state,
				  const ClaimRequest *req, BeginRefusal *refusal)
{
	bool		raise = (req->policy == IDEM_IN_FLIGHT_RAISE);
	bool		writer = rec != NULL && TransactionIdIsValid(rec->busy_xid);

	*refusal = REFUSE_NONE;
	if (rec == NULL)
		return BEGIN_CLAIM;

	if (!idem_state_is_live(state))
	{
		if (writer)
			return BEGIN_WAIT_WRITER;	/* being purged or taken over */
		if (state != IDEM_STATE_REMEMBERED)
			return BEGIN_CLAIM;
		if (!idem_fingerprints_equal(rec->fingerprint, req->fingerprint))
			return refuse(REFUSE_KEY_REUSED, refusal);
		return refuse(REFUSE_RESPONSE_EXPIRED, refusal);
	}

	if (!idem_fingerprints_equal(rec->fingerprint, req->fingerprint))
		return refuse(REFUSE_KEY_REUSED, refusal);
	if (writer)
		return raise ? refuse(REFUSE_IN_PROGRESS, refusal) : BEGIN_WAIT_WRITER;
	if (!IdemRecordIsPending(rec))
		return rec->in_snapshot ? BEGIN_REPLAY :
			refuse(REFUSE_NOT_IN_SNAPSHOT, refusal);
	if (rec->mine)
		return refuse(REFUSE_IN_PROGRESS_OURS, refusal);
	return raise ? refuse(REFUSE_IN_PROGRESS, refusal) : BEGIN_WAIT_CLAIM;
}
