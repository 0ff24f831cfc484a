/*-------------------------------------------------------------------------
 *
 * locks.h
 *	  The key lock, waiting and waking, the locks of sessions and switches (locks.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_LOCKS_H
#define IDEM_LOCKS_H

#include "idempotency.h"
#include "storage/lockdefs.h"

extern void idem_lock_key(const IdemKey *key);
extern bool idem_try_lock_key(const IdemKey *key);
extern void idem_lock_key_until_commit(const IdemKey *key);
extern void idem_lock_switch(bool session);
extern void idem_unlock_switch(void);
extern void idem_unlock_key(const IdemKey *key);
extern void idem_wait_for_xact(TransactionId xid);
extern int64 idem_session_holder(void);
extern bool idem_session_alive(int64 holder);
extern void idem_wait_for_wakeup(const IdemKey *key, int64 holder,
								 TimestampTz until,
								 TimestampTz lock_deadline,
								 const Oid *relids, int nrelids);
extern void idem_wake_waiters(const IdemKey *key);

/* What the extension's sleeps show in pg_stat_activity (docs/operations.md) */
typedef enum IdemWaitEvent
{
	IDEM_WAIT_CLAIM,			/* a duplicate, on the claim holding its key */
	IDEM_WAIT_PURGE_MAIN,		/* the purge worker, between runs */
	IDEM_WAIT_PURGE_DELAY,		/* the purge worker, between batches */
	IDEM_WAIT_TOKEN_SYNC_REP,	/* a new token epoch, on synchronous standbys */
	IDEM_NUM_WAIT_EVENTS
} IdemWaitEvent;

extern uint32 idem_wait_event(IdemWaitEvent event);

#endif							/* IDEM_LOCKS_H */
