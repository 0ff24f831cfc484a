/*-------------------------------------------------------------------------
 *
 * locks.c
 *	  The per-key lock, waiting for another attempt, and waking waiters.
 *
 * Three kinds of waiting, all of them sleeping, none of them polling:
 *
 *	Key lock		An exclusive advisory lock on the key, held only while a
 *					call looks the record up and writes it -- never until
 *					commit, and never while sleeping -- so one transaction
 *					can claim any number of keys without filling the lock
 *					table.  It orders concurrent calls on one key.
 *
 *	Transaction		A record that another transaction is inserting or
 *					changing is waited for on that transaction's own lock
 *					(XactLockTableWait): the waiter wakes the moment it
 *					commits or rolls back, and the deadlock detector sees
 *					the wait.
 *
 *	Committed claim	A claim committed before an external call is held by no
 *					transaction.  A waiter holds a share lock on the key's
 *					"waiter" tag and sleeps on its latch until the claim's
 *					lease ends; idem_finish / idem_abort find the holders of
 *					that tag in the lock table and set their latches.
 *
 * A claim made with takeover => 'session' also names the session that
 * made it (its "holder").  The session is alive while it holds either of
 * two session-level locks on its own tags, taken at its first such claim
 * and kept until it exits: one lock pair however many claims it makes.
 * Two, because no single kind of lock survives everything a live session
 * may do:
 *
 *	Advisory		(user lock method) survives every transaction's end, but
 *					DISCARD ALL and pg_advisory_unlock_all() release it;
 *	Anchor			(default lock method) survives those, but a top-level
 *					abort releases it.
 *
 * Whichever is lost is taken again before the other can go: the advisory
 * lock at the transaction's commit, prepare or abort (before the abort lets
 * the anchor go), the anchor right after an abort has let it go.  A look
 * holds a share lock on the advisory tag while it tests the anchor, so the
 * owner cannot take one back and lose the other in between: if the look
 * finds both free, the session has ended.  Only finishing or aborting ends
 * a live session's claim; DISCARD ALL, RESET ALL, SET ROLE and
 * pg_advisory_unlock_all() do not.
 *
 * A waiter on such a claim also holds a share lock on the session's
 * "session waiter" tag, and an exiting session releases its locks and then
 * sets the latches of those waiters, so they wake at once.  A session that
 * dies without running its exit code (a crashed server) leaves no lock
 * behind either: the lock table does not survive it.
 *
 * All tags live in lock classes of our own (pg_locks.objsubid), so they
 * can never collide with an application's pg_advisory_lock() keys: core
 * uses 1 and 2, Citus 4 to 15.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/xact.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "storage/proc.h"
#include "storage/sinvaladt.h"
#include "utils/resowner.h"
#include "utils/timestamp.h"

#include "citus_locks.h"
#include "idempotency.h"
#include "locks.h"
#include "store.h"
#include "pg_compat.h"

/* Advisory lock classes owned by this extension ('I','K' + 0 / 1) */
#define IDEM_LOCK_CLASS_KEY		0x494B
#define IDEM_LOCK_CLASS_WAITER	0x494C
/* ... + 2 / 3 / 4: a session that holds claims, its waiters, its anchor */
#define IDEM_LOCK_CLASS_SESSION	0x494D
#define IDEM_LOCK_CLASS_SESSION_WAITER	0x494E
#define IDEM_LOCK_CLASS_SESSION_ANCHOR	0x494F
/* ... + 5: a durability switch of this database */
#define IDEM_LOCK_CLASS_SWITCH	0x4950

static void
key_locktag(LOCKTAG *tag, const IdemKey *key, uint16 lock_class)
{
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId,
						 (uint32) (key->hash >> 32), (uint32) key->hash,
						 lock_class);
}

static void
session_locktag(LOCKTAG *tag, int64 holder, uint16 lock_class)
{
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId,
						 (uint32) ((uint64) holder >> 32), (uint32) holder,
						 lock_class);
	/*
	 * The anchor is an advisory tag in the default lock method, whose
	 * session locks only a top-level abort (and exit) releases: DISCARD ALL
	 * and pg_advisory_unlock_all() release the user lock method's alone.
	 */
	if (lock_class == IDEM_LOCK_CLASS_SESSION_ANCHOR)
		tag->locktag_lockmethodid = DEFAULT_LOCKMETHOD;
}

/* Honours lock_timeout, statement_timeout and cancel like any lock wait */
void
idem_lock_key(const IdemKey *key)
{
	LOCKTAG		tag;

	key_locktag(&tag, key, IDEM_LOCK_CLASS_KEY);
	(void) LockAcquire(&tag, ExclusiveLock, false, false);
}

/* The key lock if nobody else holds it; false, without waiting, if not */
bool
idem_try_lock_key(const IdemKey *key)
{
	LOCKTAG		tag;

	key_locktag(&tag, key, IDEM_LOCK_CLASS_KEY);
	return LockAcquire(&tag, ExclusiveLock, false, true) != LOCKACQUIRE_NOT_AVAIL;
}

/*
 * The key lock, held until the transaction ends: an online durability
 * switch moves a record between the tables under it, so that no look-up
 * reads one table before the move commits and the other after.
 */
void
idem_lock_key_until_commit(const IdemKey *key)
{
	LOCKTAG		tag;

	key_locktag(&tag, key, IDEM_LOCK_CLASS_KEY);
	(void) LockAcquire(&tag, ExclusiveLock, false, false);
}

void
idem_unlock_key(const IdemKey *key)
{
	LOCKTAG		tag;

	key_locktag(&tag, key, IDEM_LOCK_CLASS_KEY);
	LockRelease(&tag, ExclusiveLock, false);
}

/*
 * One durability switch at a time in a database: an online one holds this
 * lock across its transactions (session), a one-transaction switch until
 * it commits.
 */
void
idem_lock_switch(bool session)
{
	LOCKTAG		tag;

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, 0, 0, IDEM_LOCK_CLASS_SWITCH);
	(void) LockAcquire(&tag, ExclusiveLock, session, false);
}

/* The online switch's lock, held at session level */
void
idem_unlock_switch(void)
{
	LOCKTAG		tag;

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, 0, 0, IDEM_LOCK_CLASS_SWITCH);
	if (idem_lock_held_by_me(&tag, ExclusiveLock))
		LockRelease(&tag, ExclusiveLock, true);
}

/* Sleep until transaction xid (and all of its subtransactions) ends */
void
idem_wait_for_xact(TransactionId xid)
{
	XactLockTableWait(xid, NULL, NULL, XLTW_None);
}

/*
 * The modes in which this transaction still holds a lock on relation relid
 * (one the functions of this extension take), as a bit mask; *tag is set to
 * the relation's lock tag.
 */
static LOCKMASK
relation_locks_held(Oid relid, LOCKTAG *tag)
{
	static const LOCKMODE modes[] = {AccessShareLock, RowExclusiveLock};
	LOCKMASK	held = 0;

	SET_LOCKTAG_RELATION(*tag, MyDatabaseId, relid);
	for (int i = 0; i < lengthof(modes); i++)
		if (idem_lock_held_by_me(tag, modes[i]))
			held |= LOCKBIT_ON(modes[i]);
	return held;
}

/*
 * Is anyone queued for a lock on the relation that conflicts with ours?
 * (LockHasWaiters cannot say: it knows nothing of fast-path locks, which is
 * how weak relation locks are usually held.)  This copies the lock table,
 * which is only done once per deadlock_timeout by a sleeper that still
 * holds a lock on the record table -- a rare case.
 */
static bool
relation_lock_has_waiters(const LOCKTAG *tag, LOCKMASK held)
{
	LockData   *data = GetLockStatusData();
	LockMethod	method = GetLockTagsMethodTable(tag);
	bool		waiters = false;

	for (int i = 0; i < data->nelements && !waiters; i++)
	{
		LockInstanceData *lock = &data->locks[i];

		if (lock->waitLockMode != NoLock &&
			lock->pid != MyProcPid &&
			memcmp(&lock->locktag, tag, sizeof(LOCKTAG)) == 0 &&
			(method->conflictTab[lock->waitLockMode] & held) != 0)
			waiters = true;
	}
	return waiters;
}

/*
 * Sleep until a finish or abort of the key wakes us, or until "until" (the
 * lease end), whichever comes first.  Called with the key lock held; it is
 * released here, after registering as a waiter, so a finish that takes the
 * key lock next is sure to see us.  The caller has reset its latch before
 * looking at the record, so a wake-up between the look and the sleep is
 * not lost.
 *
 * lock_deadline (0: none) is when lock_timeout expires for this call.
 *
 * The caller gives back its own locks on the store's tables (relids) first.
 * If the transaction still holds one from before, a maintenance command
 * (VACUUM FULL, CLUSTER, idem_set_logged) that queues behind it would also
 * hold up the idem_finish we wait for, in a cycle the deadlock detector
 * cannot see: we are on a latch, not in the lock table.  So the sleep looks
 * at the queue every deadlock_timeout and ends with the deadlock error if
 * anyone waits there.
 */
void
idem_wait_for_wakeup(const IdemKey *key, int64 holder, TimestampTz until,
					 TimestampTz lock_deadline, const Oid *relids, int nrelids)
{
	LOCKTAG		tag;
	LOCKTAG		session_tag;
	LOCKTAG		reltag[IDEM_NUM_TABLES];
	LOCKMASK	held[IDEM_NUM_TABLES];
	bool		any_held = false;
	TimestampTz now = GetCurrentTimestamp();

	if (lock_deadline != 0 && lock_deadline <= now)
		ereport(ERROR,
				(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
				 errmsg("canceling statement due to lock timeout"),
				 errdetail("Another attempt holds the idempotency key.")));
	if (lock_deadline != 0 && lock_deadline < until)
		until = lock_deadline;
	until = idem_citus_wake_by(until);	/* a shard that may move meanwhile */

	Assert(nrelids <= IDEM_NUM_TABLES);
	for (int i = 0; i < nrelids; i++)
	{
		held[i] = relation_locks_held(relids[i], &reltag[i]);
		any_held |= (held[i] != 0);
	}

	key_locktag(&tag, key, IDEM_LOCK_CLASS_WAITER);
	(void) LockAcquire(&tag, AccessShareLock, false, false);
	if (holder != 0)
	{
		/* registered before looking: an exit after the look wakes us */
		session_locktag(&session_tag, holder, IDEM_LOCK_CLASS_SESSION_WAITER);
		(void) LockAcquire(&session_tag, AccessShareLock, false, false);
		if (!idem_session_alive(holder))
			until = now;		/* it has just exited: look again at once */
	}
	idem_unlock_key(key);

	for (;;)
	{
		/* round up: waking a little early would just sleep again */
		long		timeout_ms = (long) ((until - now + 999) / 1000);
		int			rc;

		if (timeout_ms < 1)
			timeout_ms = 1;
		if (any_held && timeout_ms > DeadlockTimeout)
			timeout_ms = DeadlockTimeout;

		if (until <= now)
			break;
		rc = WaitLatch(MyLatch,
					   WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					   timeout_ms,
					   idem_wait_event(IDEM_WAIT_CLAIM));
		now = GetCurrentTimestamp();
		if ((rc & WL_LATCH_SET) || now >= until || !any_held)
			break;
		for (int i = 0; i < nrelids; i++)
		{
			if (held[i] == 0 || !relation_lock_has_waiters(&reltag[i], held[i]))
				continue;
			LockRelease(&tag, AccessShareLock, false);
			if (holder != 0)
				LockRelease(&session_tag, AccessShareLock, false);
			ereport(ERROR,
					(errcode(ERRCODE_T_R_DEADLOCK_DETECTED),
					 errmsg("deadlock detected while waiting for another attempt at an idempotency key"),
					 errdetail("This transaction holds a lock on the record table that another command is waiting for, and the attempt it waits for would need that lock after the command."),
					 errhint("Retry the transaction.")));
		}
	}

	LockRelease(&tag, AccessShareLock, false);
	if (holder != 0)
		LockRelease(&session_tag, AccessShareLock, false);
	CHECK_FOR_INTERRUPTS();
}

/*
 * The wait_event_info of a sleep: a wait event of type Extension with a
 * name of its own where the server has them (PostgreSQL 17), registered on
 * first use -- the names are server-wide, each backend keeps the numbers
 * it got -- and else the one wait event "Extension".
 */
uint32
idem_wait_event(IdemWaitEvent event)
{
	static const char *const names[IDEM_NUM_WAIT_EVENTS] = {
		[IDEM_WAIT_CLAIM] = "IdempotencyClaim",
		[IDEM_WAIT_PURGE_MAIN] = "IdempotencyPurgeMain",
		[IDEM_WAIT_PURGE_DELAY] = "IdempotencyPurgeDelay",
		[IDEM_WAIT_TOKEN_SYNC_REP] = "IdempotencyTokenSyncRep",
	};
	static uint32 info[IDEM_NUM_WAIT_EVENTS];

	Assert(event < IDEM_NUM_WAIT_EVENTS);
	if (info[event] == 0)
		info[event] = idem_wait_event_new(names[event]);
	return info[event];
}

/* ---- sessions (takeover => 'session') ---- */

/* This backend's holder number; 0 until its first 'session' claim */
static int64 my_holder = 0;
/* Set by session_exit: the locks are let go for good */
static bool session_ended = false;

/* Set the latch of every backend holding a share lock on tag: its sleepers */
static void
wake_holders(const LOCKTAG *tag)
{
	VirtualTransactionId *vxid;

	for (vxid = GetLockConflicts(tag, AccessExclusiveLock, NULL);
		 VirtualTransactionIdIsValid(*vxid); vxid++)
	{
		PGPROC	   *proc = IdemVxidGetProc(vxid);

		if (proc != NULL)
			SetLatch(&proc->procLatch);
	}
}

/* Wake the backends sleeping on one of this session's claims */
static void
wake_session_waiters(int64 holder)
{
	LOCKTAG		tag;

	session_locktag(&tag, holder, IDEM_LOCK_CLASS_SESSION_WAITER);
	wake_holders(&tag);
}

/*
 * Take this session's lock of lock_class back if it has lost it.  Nobody
 * else ever takes it exclusively; a look holds it in share mode for a
 * moment without waiting for anything, so the wait here is short and
 * cannot be part of a deadlock.  On the abort path (report_errors false) a
 * full lock table is not reported: the lock is taken at the next chance.
 */
static void
session_lock_keep(uint16 lock_class, bool report_errors)
{
	LOCKTAG		tag;

	session_locktag(&tag, my_holder, lock_class);
	if (!idem_lock_held_by_me(&tag, ExclusiveLock))
		(void) idem_lock_acquire_extended(&tag, ExclusiveLock, true, false,
										  report_errors);
}

/*
 * The advisory lock is taken back at every end of a transaction, before an
 * abort lets the anchor go (ProcReleaseLocks runs after these callbacks).
 */
static void
session_xact_callback(XactEvent event, void *arg)
{
	if (my_holder == 0 || session_ended)
		return;
	switch (event)
	{
		case XACT_EVENT_PRE_COMMIT:
		case XACT_EVENT_PRE_PREPARE:
			session_lock_keep(IDEM_LOCK_CLASS_SESSION, true);
			session_lock_keep(IDEM_LOCK_CLASS_SESSION_ANCHOR, true);
			break;
		case XACT_EVENT_ABORT:
			session_lock_keep(IDEM_LOCK_CLASS_SESSION, false);
			break;
		default:
			break;
	}
}

/* The anchor is taken back as soon as a top-level abort has let it go */
static void
session_release_callback(ResourceReleasePhase phase, bool isCommit,
						 bool isTopLevel, void *arg)
{
	if (my_holder == 0 || session_ended)
		return;
	if (phase == RESOURCE_RELEASE_AFTER_LOCKS && isTopLevel && !isCommit)
		session_lock_keep(IDEM_LOCK_CLASS_SESSION_ANCHOR, false);
}

/*
 * At exit, before PostgreSQL releases the session's locks (a
 * before_shmem_exit callback registered after InitPostgres' runs first):
 * release the session's locks, so that a woken waiter finds the session
 * gone, then wake the waiters.  The transaction that exit then aborts must
 * not take them back.
 */
static void
session_exit(int code, Datum arg)
{
	LOCKTAG		tag;

	if (my_holder == 0)
		return;
	session_ended = true;
	session_locktag(&tag, my_holder, IDEM_LOCK_CLASS_SESSION);
	if (idem_lock_held_by_me(&tag, ExclusiveLock))
		LockRelease(&tag, ExclusiveLock, true);
	session_locktag(&tag, my_holder, IDEM_LOCK_CLASS_SESSION_ANCHOR);
	if (idem_lock_held_by_me(&tag, ExclusiveLock))
		LockRelease(&tag, ExclusiveLock, true);
	wake_session_waiters(my_holder);
}

/*
 * The number that names this session in its 'session' claims: its process
 * ID and the low half of its start time (a process ID is reused, not
 * within the same microsecond of a 71-minute cycle).  Every call makes sure
 * the session holds its locks that say it is alive: a call that could not
 * take them (a full lock table: 53200) fails, and so does its claim, and a
 * later call takes them -- a claim is never made without them.
 */
int64
idem_session_holder(void)
{
	if (my_holder == 0)
	{
		my_holder = (int64) (((uint64) (uint32) MyProcPid << 32) |
							 (uint32) MyStartTimestamp);
		if (my_holder == 0)
			my_holder = 1;
		RegisterXactCallback(session_xact_callback, NULL);
		RegisterResourceReleaseCallback(session_release_callback, NULL);
		before_shmem_exit(session_exit, (Datum) 0);
	}
	session_lock_keep(IDEM_LOCK_CLASS_SESSION, true);
	session_lock_keep(IDEM_LOCK_CLASS_SESSION_ANCHOR, true);
	return my_holder;
}

/*
 * Is the session that made a 'session' claim still connected?  It is while
 * it holds either of its locks.  The share lock on the advisory tag is kept
 * while the anchor is tested: the owner cannot take the advisory lock back
 * meanwhile, so it cannot have let the anchor go after it.
 */
bool
idem_session_alive(int64 holder)
{
	LOCKTAG		advisory;
	LOCKTAG		anchor;
	bool		alive;

	if (holder == my_holder)
		return true;
	session_locktag(&advisory, holder, IDEM_LOCK_CLASS_SESSION);
	if (LockAcquire(&advisory, ShareLock, false, true) == LOCKACQUIRE_NOT_AVAIL)
		return true;
	session_locktag(&anchor, holder, IDEM_LOCK_CLASS_SESSION_ANCHOR);
	alive = (LockAcquire(&anchor, ShareLock, false, true) == LOCKACQUIRE_NOT_AVAIL);
	if (!alive)
		LockRelease(&anchor, ShareLock, false);
	LockRelease(&advisory, ShareLock, false);
	return alive;
}

/*
 * Wake every backend sleeping in idem_wait_for_wakeup on this key.  They
 * look again: a spurious wake-up costs one look-up, a missed one a whole
 * lease, so the caller holds the key lock, which no sleeper holds.
 */
void
idem_wake_waiters(const IdemKey *key)
{
	LOCKTAG		tag;

	key_locktag(&tag, key, IDEM_LOCK_CLASS_WAITER);
	wake_holders(&tag);
}
