/*-------------------------------------------------------------------------
 *
 * forget.c
 *	  idem_forget: one key's record deleted on purpose, by an administrator.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "args.h"
#include "counters.h"
#include "locks.h"
#include "read.h"
#include "state.h"
#include "write.h"

PG_FUNCTION_INFO_V1(idem_forget);
PG_FUNCTION_INFO_V1(idem_forget_tenant);

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
	IdemState	current;
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
		current = idem_record_state(&rec, now);
		state = idem_state_name(current);
		if (current == IDEM_STATE_PENDING && !force)
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
