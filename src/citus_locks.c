/*-------------------------------------------------------------------------
 *
 * citus_locks.c
 *	  Citus's shard metadata lock on a key's shard: taken as Citus's own
 *	  writers take it, and given back while a duplicate sleeps.
 *
 * A shard move takes the lock exclusively before it switches the shard to
 * its new node, so a move waits for a call that holds it in share mode,
 * and then carries the call's write along.  A duplicate that sleeps
 * waiting for another attempt gives it back while it sleeps, so that
 * neither a move nor the other attempt's finish queues behind it, and
 * wakes within a second to look again where its key is.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "access/xact.h"
#include "catalog/pg_class.h"
#include "catalog/pg_type_d.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "storage/lock.h"
#include "utils/array.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "citus.h"
#include "citus_locks.h"

/*
 * The classes of Citus's shard metadata locks (advisory locks):
 * ADV_LOCKTAG_CLASS_CITUS_SHARD_METADATA, by shard, and
 * ADV_LOCKTAG_CLASS_CITUS_COLOCATED_SHARDS_METADATA, by colocation group
 * and shard index, which a hash-distributed table's shards use
 */
#define CITUS_SHARD_METADATA_LOCK_CLASS 4
#define CITUS_COLOCATED_SHARDS_METADATA_LOCK_CLASS 8

/*
 * Citus's lock_shard_metadata(), looked up once: its SQL-callable
 * function, exported by every build
 */
static PGFunction lock_shard_metadata = NULL;

/* the call gave back its shard's lock to sleep (idem_citus_unlock_shard) */
static bool shard_given_back = false;

/* how long a sleep that gave back its shard's lock lasts at most: a move may take the shard away meanwhile */
#define SHARD_SLEEP_MS 1000

/* Citus's shard metadata lock on shardid in share mode, as its writers take it */
void
idem_citus_lock_shard(Oid shell, int64 shardid)
{
	Datum		id = Int64GetDatum(shardid);
	ArrayType  *ids = construct_array(&id, 1, INT8OID, sizeof(int64), FLOAT8PASSBYVAL,
									  TYPALIGN_DOUBLE);
	HeapTuple	tuple;
	Oid			owner;
	Oid			save_userid;
	int			save_sec_context;

	if (lock_shard_metadata == NULL)
		lock_shard_metadata = load_external_function("citus", "lock_shard_metadata",
													 true, NULL);
	tuple = SearchSysCache1(RELOID, ObjectIdGetDatum(shell));
	if (!HeapTupleIsValid(tuple))
		elog(ERROR, "cache lookup failed for relation %u", shell);
	owner = ((Form_pg_class) GETSTRUCT(tuple))->relowner;
	ReleaseSysCache(tuple);

	/* Citus lets the table's owner take it: the extension's, as for its functions */
	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(owner, save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	PG_TRY();
	{
		DirectFunctionCall2(lock_shard_metadata, Int32GetDatum(ShareLock),
							PointerGetDatum(ids));
	}
	PG_FINALLY();
	{
		SetUserIdAndSecContext(save_userid, save_sec_context);
	}
	PG_END_TRY();
}

/*
 * Give back the shard metadata lock idem_citus_route took for a call, as
 * a waiting duplicate does while it sleeps (claim.c): a shard move
 * queues for the lock in exclusive mode, and the owner's idem_finish
 * would queue behind the move, for as long as the duplicate sleeps --
 * until the owner's lease ends.  The call takes it again, and looks
 * again where the key is, when it wakes.  A lock the transaction took for
 * an earlier call, which may have written the shard, stays.
 */
void
idem_citus_unlock_shard(const IdemObjects *objects, int64 shardid)
{
	RouteCache *rc = idem_citus_layout(objects);
	LOCKTAG		tag;
	int			index = -1;

	/*
	 * Citus's SetLocktagForShardDistributionMetadata: a shard of a
	 * hash-distributed table in a colocation group is locked by the group
	 * and its index among the group's shards, in the order of their ranges
	 * (as rc->shards)
	 */
	for (int i = 0; rc != NULL && i < rc->nshards; i++)
		if (rc->shards[i].shardid == shardid)
			index = i;
	if (index < 0 || rc->colocation == 0)
		SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) (shardid >> 32), (uint32) shardid,
							 CITUS_SHARD_METADATA_LOCK_CLASS);
	else
		SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) index, (uint32) rc->colocation,
							 CITUS_COLOCATED_SHARDS_METADATA_LOCK_CLASS);
	LockRelease(&tag, ShareLock, false);
	shard_given_back = true;
}

/*
 * The end of a sleep that would end at until: sooner if the call gave back
 * its shard's lock to sleep, so that it notices a move of the shard (which
 * takes the key's wake-ups to another node) within a second, not at the
 * end of the lease it waits for.  Waking early only makes it look again.
 */
TimestampTz
idem_citus_wake_by(TimestampTz until)
{
	TimestampTz soon;

	if (!shard_given_back)
		return until;
	soon = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), SHARD_SLEEP_MS);
	return Min(until, soon);
}

/*
 * Did the call give back its shard's lock to sleep (since it last asked)?
 * Asking forgets it.
 */
bool
idem_citus_take_given_back(void)
{
	bool		given_back = shard_given_back;

	shard_given_back = false;
	return given_back;
}

/* At the end of each transaction: no call has given back its shard's lock */
static void
forget_given_back(XactEvent event, void *arg)
{
	shard_given_back = false;
}

/*
 * Called from _PG_init where Citus is loaded: forget at the end of each
 * transaction that a call gave back its shard's lock
 */
void
idem_citus_locks_init(void)
{
	RegisterXactCallback(forget_given_back, NULL);
}
