/*-------------------------------------------------------------------------
 *
 * wait.c
 *	  idem_begin's waits for another attempt at the key: for a transaction
 *	  that writes the record, or for a committed claim to be finished,
 *	  aborted or to lapse.  Each is entered holding the key lock and
 *	  returns without it; the caller then looks again.  The sleeping and
 *	  waking themselves are locks.c's.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "storage/proc.h"
#include "utils/rel.h"
#include "utils/timestamp.h"

#include "locks.h"
#include "wait.h"

/* Wait for the transaction that is writing rec (its busy_xid) to end */
void
idem_wait_for_writer(const IdemKey *key, const IdemRecord *rec)
{
	idem_unlock_key(key);
	idem_wait_for_xact(rec->busy_xid);
}

/*
 * Sleep until the committed claim rec is finished, aborted or lapses (its
 * lease ends, or its session), or until *lock_deadline: lock_timeout
 * counts from the first of a call's sleeps, which sets it.
 *
 * The sleep is made without our lock on the tables: a VACUUM FULL queued
 * behind it would hold up the owner's idem_finish, and the deadlock
 * detector cannot see a latch sleep.  (If this transaction locked the
 * tables before this call, the lock stays; the sleep then ends when
 * someone queues behind it.)
 */
void
idem_wait_for_claim(IdemStore *store, const IdemKey *key, const IdemRecord *rec,
					TimestampTz now, TimestampTz *lock_deadline)
{
	Oid			relids[IDEM_NUM_TABLES];
	int			nrelids = 0;

	if (*lock_deadline == 0 && LockTimeout > 0)
		*lock_deadline = TimestampTzPlusMilliseconds(now, LockTimeout);
	for (int t = 0; t < store->ntables; t++)
		if (store->heap[t] != NULL)
			relids[nrelids++] = RelationGetRelid(store->heap[t]);
	idem_store_close(store, true);
	idem_wait_for_wakeup(key, rec->holder, rec->expires_at, *lock_deadline,
						 relids, nrelids);
	idem_store_reopen(store);
}
