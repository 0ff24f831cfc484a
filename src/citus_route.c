/*-------------------------------------------------------------------------
 *
 * citus_route.c
 *	  Where a call finds a key's record on a Citus cluster, and what a
 *	  transaction that writes it must tell Citus.
 *
 * A call that opens the records goes by the layout (citus.c): to this
 * node's tables where the records are not distributed, which a worker
 * refuses, and to the key's shard where they are, under Citus's shard
 * metadata lock (citus_locks.c), if the shard is placed on this node.
 *
 * In every layout a transaction that writes a record may also write
 * distributed tables through Citus, the in-transaction shape's effect.
 * With one other node written, Citus commits it in one phase, before the
 * local commit, unless it is told that the transaction has a local write
 * of its own: a node that died between the two would keep the effect and
 * lose the claim and the result, and the retry would run the effect
 * again.  So a call that opens the records to write tells Citus, through
 * its Use2PCForCoordinatedTransaction() (a flag of the current
 * transaction, which Citus clears at its end; it does nothing in a
 * transaction that writes no other node; Citus's builds for PostgreSQL 16
 * and later do not export it, and there such a write is refused in a
 * transaction block: tell_citus_local_write).  A record written on a worker
 * for a delegated call is a write Citus itself made, and is committed
 * with the rest of the coordinated transaction, in two phases when it
 * wrote more than one node.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/inval.h"

#include "args.h"
#include "citus.h"
#include "citus_locks.h"
#include "citus_route.h"

/*
 * Citus's Use2PCForCoordinatedTransaction(), looked up once: a C function
 * Citus's builds for PostgreSQL 16 and later do not export (PostgreSQL
 * compiles modules with hidden symbols from 16 on, and Citus does not mark
 * it PGDLLEXPORT): use_2pc_missing says so.
 */
static void (*use_2pc) (void) = NULL;
static bool use_2pc_missing = false;

/*
 * Is this backend one of the connections Citus opens between its nodes
 * (a delegated call, a shard's part of a distributed statement)?  Citus
 * names them so (application_name "citus_internal gpid=...").  Their
 * transactions are parts of the coordinating node's, which commits them.
 */
static bool
citus_internal_backend(void)
{
	const char *name = GetConfigOption("application_name", true, false);

	return name != NULL && strncmp(name, "citus_internal", strlen("citus_internal")) == 0;
}

/* citus_internal_backend(), for the other parts */
bool
idem_citus_internal_backend(void)
{
	return idem_citus_loaded() && citus_internal_backend();
}

/*
 * A write of records in a transaction that may also write other nodes
 * through Citus: make Citus commit those in two phases (see the top).
 * Where this Citus does not let us ask, a transaction block of the
 * coordinating backend is refused: its records and its other nodes'
 * writes could not be committed as one.  An autocommit call, or a part of
 * another node's transaction, needs nothing.
 */
static void
tell_citus_local_write(void)
{
	if (use_2pc == NULL && !use_2pc_missing)
	{
		use_2pc = (void (*) (void))
			load_external_function("citus", "Use2PCForCoordinatedTransaction",
								   false, NULL);
		use_2pc_missing = (use_2pc == NULL);
	}
	if (use_2pc != NULL)
		use_2pc();
	else if (IsTransactionBlock() && !citus_internal_backend())
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idempotency records cannot be written in a transaction block on this Citus node"),
				 errdetail("This build of Citus does not export Use2PCForCoordinatedTransaction(), by which a transaction that writes records here asks Citus to commit the other nodes it writes in two phases; without it a crash between those commits and this node's would keep the effect and lose the record."),
				 errhint("Call idem_begin and idem_finish in transactions of their own, or distribute the records with idem_distribute() and call them through a node that does not hold the key.")));
}

static void
refuse_worker(int32 group)
{
	ereport(ERROR,
			(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
			 errmsg("idempotency records are served by the Citus coordinator, not by a worker"),
			 errdetail("This node is a worker of a Citus cluster (group %d); its own record tables would be a second store, in which a key completed through the coordinator counts as new.",
					   group),
			 errhint("Send calls of the idem_* functions to the coordinator, or distribute the records with idem_distribute().")));
}

/*
 * The hash Citus routes a key's record by: its hash of the distribution
 * column's value -- the key, or the tenant -- by the column type's hash
 * function and collation
 */
static int32
route_hash(RouteCache *rc, const IdemKey *key)
{
	Datum		value;

	idem_key_check_tenant(key, rc->by_tenant ? rc->dist_type : InvalidOid);
	value = rc->by_tenant ? key->tenant : PointerGetDatum(key->key);
	return DatumGetInt32(FunctionCall1Coll(rc->dist_hash, rc->dist_collation, value));
}

/*
 * Point objects->records and objects->results at what this node serves
 * the key from, and say whether the records are distributed.  key NULL:
 * a call for the whole store (see idem_citus_local_parts).  *locked is the
 * shard whose metadata lock the call took (0: none), which
 * idem_citus_unlock_shard gives back.
 */
bool
idem_citus_route(IdemObjects *objects, const IdemKey *key, bool write, int64 *locked)
{
	RouteCache *rc = idem_citus_layout(objects);
	int32		hash;
	ShardRoute *shard;
	int64		shardid;
	bool		moved_while_asleep;	/* or while it waited for the lock */

	*locked = 0;
	if (rc == NULL)
		return false;
	if (!rc->distributed)
	{
		if (rc->group != CITUS_COORDINATOR_GROUP)
			refuse_worker(rc->group);
		if (write)
			tell_citus_local_write();
		return false;
	}
	if (key == NULL)
		return true;

	hash = route_hash(rc, key);
	moved_while_asleep = idem_citus_take_given_back();
	shard = idem_citus_shard_of_hash(rc, hash);
	shardid = shard->shardid;
	/* here before the lock: a move that took it away raced this call */
	moved_while_asleep |= shard->local;
	idem_citus_lock_shard(objects->records, shardid);
	*locked = shardid;
	/* a move that committed while we waited for the lock */
	AcceptInvalidationMessages();
	rc = idem_citus_layout(objects);
	shard = idem_citus_shard_of_hash(rc, hash);
	/*
	 * Not here, but it was before the lock, or a move left its copy here
	 * (Citus routed the call by the placements before the move): the call
	 * raced the move
	 */
	if ((shard->shardid != shardid || !shard->local) &&
		(moved_while_asleep || idem_citus_copy_left_here(objects->records, shardid)))
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("the idempotency record of key \"%s\" moved to another node during the call",
						text_to_cstring(key->key)),
				 errdetail("A shard move of the records took the key's shard %lld off this node (group %d).",
						   (long long) shardid, rc->group),
				 errhint("Retry the call: Citus sends it to the node that holds the key now.")));
	if (shard->shardid != shardid || !shard->local)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("the idempotency record of key \"%s\" is not on this node",
						text_to_cstring(key->key)),
				 errdetail("The records are distributed, and this key's shard %lld has no placement on this node (group %d): Citus did not delegate the call to the node that holds it.",
						   (long long) shardid, rc->group),
				 errhint("Call the idem_* functions as statements of their own with constant arguments, SELECT idem_begin('op', 'key', ...), from the application or inside a transaction block, not with a query's column as the key or from a PL/pgSQL function (unless Citus delegates that function to the tenant's node). A call that raced a shard move can be retried.")));
	objects->records = shard->records;
	if (OidIsValid(objects->results))
		objects->results = shard->results;
	if (write)
		tell_citus_local_write();
	return true;
}

/*
 * The parts of the store this node serves: one IdemObjects per pair of
 * colocated shards placed here, or objects itself where the records are
 * not distributed.  refuse_on_worker: refuse on a worker when they are not
 * (idem_purge is not refused: a worker's own tables are empty).
 */
List *
idem_citus_local_parts(const IdemObjects *objects, bool refuse_on_worker)
{
	RouteCache *rc = idem_citus_layout(objects);
	List	   *parts = NIL;

	if (rc == NULL || !rc->distributed)
	{
		IdemObjects *whole = palloc(sizeof(IdemObjects));

		*whole = *objects;
		if (rc != NULL && refuse_on_worker && rc->group != CITUS_COORDINATOR_GROUP)
			refuse_worker(rc->group);
		return list_make1(whole);
	}
	for (int i = 0; i < rc->nshards; i++)
	{
		IdemObjects *part;

		if (!rc->shards[i].local)
			continue;
		part = palloc(sizeof(IdemObjects));
		*part = *objects;
		part->records = rc->shards[i].records;
		if (OidIsValid(objects->results))
			part->results = rc->shards[i].results;
		parts = lappend(parts, part);
	}
	return parts;
}
