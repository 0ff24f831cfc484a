/*-------------------------------------------------------------------------
 *
 * store.c
 *	  Opening and closing the record tables for one call, and the one
 *	  definition of the durability mode their persistence makes.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/dependency.h"
#include "catalog/indexing.h"
#include "catalog/pg_am_d.h"
#include "catalog/pg_class.h"
#include "catalog/pg_collation_d.h"
#include "catalog/pg_depend.h"
#include "catalog/pg_extension_d.h"
#include "catalog/pg_proc_d.h"
#include "catalog/pg_type_d.h"
#include "commands/trigger.h"
#include "executor/executor.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "nodes/execnodes.h"
#include "nodes/makefuncs.h"
#include "parser/parse_func.h"
#include "rewrite/rewriteHandler.h"
#include "storage/bufmgr.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "args.h"
#include "catalog.h"
#include "citus.h"
#include "citus_locks.h"
#include "citus_route.h"
#include "idempotency.h"
#include "shape.h"
#include "store.h"
#include "pg_compat.h"

/*
 * Open one table of the store.  An unlogged table has no data on a
 * standby: a look there (idem_inspect, idem_stats) reads what the standby
 * has -- completed records in a logged idem_result -- and
 * idem_store_note_hidden says what it cannot see.
 */
static void
open_heap(IdemStore *store, int table, Oid relid)
{
	Relation	heap = table_open(relid, store->lockmode);

	if (heap->rd_rel->relpersistence == RELPERSISTENCE_UNLOGGED &&
		RecoveryInProgress())
	{
		if (store->lockmode != AccessShareLock)
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("idempotency records cannot be written during recovery"),
					 errdetail("Table \"%s\" is unlogged: it is not replicated to standbys.",
							   RelationGetRelationName(heap))));
		table_close(heap, store->lockmode);
		store->hidden[table] = true;
		return;
	}
	store->heap[table] = heap;
}

static void
open_index(IdemStore *store, int table)
{
	store->index[table] = idem_shape_open(store->heap[table], store->lockmode,
										  &store->shape[table]);
}

static void
open_table(IdemStore *store, int table, Oid relid)
{
	open_heap(store, table, relid);
	if (store->heap[table] != NULL)
		open_index(store, table);
}

/*
 * Open the tables of objects (the extension's, or one node's shards of
 * them) and their primary keys.
 */
static void
open_objects(IdemStore *store, const IdemObjects *objects, Oid fn_oid,
			 LOCKMODE lockmode)
{
	Oid			relid = objects->records;
	Oid			resultid = objects->results;
	char		records;
	char		results = 0;	/* no idem_result */

	store->extension = objects->extension;
	store->token_seq = objects->token_seq;
	store->epoch_seq = objects->epoch_seq;
	store->lockmode = lockmode;
	store->fn_oid = fn_oid;

	memset(store->heap, 0, sizeof(store->heap));
	memset(store->index, 0, sizeof(store->index));
	memset(store->hidden, 0, sizeof(store->hidden));
	open_table(store, IDEM_RECORDS, relid);
	store->ntables = OidIsValid(resultid) ? 2 : 1;
	store->result_relid = resultid;

	/*
	 * The persistence of both decides the mode.  Our lock on idem_record
	 * keeps it: a switch takes ACCESS EXCLUSIVE locks on both tables, and
	 * invalidates idem_record, whose lock we took after it.
	 */
	records = store->hidden[IDEM_RECORDS] ? RELPERSISTENCE_UNLOGGED :
		store->heap[IDEM_RECORDS]->rd_rel->relpersistence;
	if (OidIsValid(resultid))
		results = idem_catalog_result_logged(resultid) ?
			RELPERSISTENCE_PERMANENT : RELPERSISTENCE_UNLOGGED;
	store->split = idem_tables_mode(records, results) == IDEM_DURABILITY_COMPLETED;
}

/*
 * Open the tables that hold key's record -- on a Citus node with
 * distributed records, this node's shards of them (citus.c) -- and their
 * primary keys: RowExclusiveLock to write, AccessShareLock to only read
 * (which also works on a standby).  key NULL: the whole store, for a call
 * that distributed records refuse or serve by idem_store_parts.
 *
 * idem_result (where the schema has it) is opened and searched in every mode: the
 * durability mode decides only where a write puts a completed record, and
 * a record put there stays findable whatever a DBA does to the tables'
 * persistence by hand.
 */
void
idem_store_open(IdemStore *store, Oid fn_oid, LOCKMODE lockmode, const IdemKey *key)
{
	IdemObjects objects;
	Oid			shell;
	bool		citus = idem_citus_loaded();

	idem_catalog_objects(fn_oid, &objects);
	shell = objects.records;

	/*
	 * On Citus, where the record is is decided under the lock on
	 * idem_record (with distributed records, its shell): idem_distribute()
	 * holds an ACCESS EXCLUSIVE lock on it while it moves the records to
	 * the shards.
	 */
	if (citus)
		LockRelationOid(shell, lockmode);
	store->shard = 0;
	store->distributed = citus &&
		idem_citus_route(&objects, key, lockmode != AccessShareLock, &store->shard);
	if (store->distributed && key == NULL)
		elog(ERROR, "distributed idempotency records opened without a key");
	store->key = key;
	open_objects(store, &objects, fn_oid, lockmode);
	/* (a table hidden during recovery is unlogged: never colocated) */
	if (key != NULL && store->heap[IDEM_RECORDS] != NULL)
		idem_key_check_tenant(key, store->shape[IDEM_RECORDS].tenant_type);
	/* the tables' own lock is the one to keep, or the shell's */
	store->shell = store->distributed ? shell : InvalidOid;
	if (citus && !store->distributed)
		UnlockRelationOid(shell, lockmode);
}

/* Open the tables again, after idem_store_close(store, true) */
void
idem_store_reopen(IdemStore *store)
{
	idem_store_open(store, store->fn_oid, store->lockmode, store->key);
}

/*
 * The parts of the store this node serves, for a call that reads or
 * purges them all: the tables, or with distributed records this node's
 * shards of them, as a List of IdemObjects, each for idem_store_open_part.
 * refuse_worker: refuse, as idem_store_open does, on a Citus worker whose
 * records are served by the coordinator.
 */
List *
idem_store_parts(Oid fn_oid, bool refuse_worker)
{
	IdemObjects objects;

	idem_catalog_objects(fn_oid, &objects);
	return idem_citus_local_parts(&objects, refuse_worker);
}

void
idem_store_open_part(IdemStore *store, Oid fn_oid, LOCKMODE lockmode,
					 const IdemObjects *part)
{
	store->distributed = false;
	store->key = NULL;
	store->shell = InvalidOid;
	store->shard = 0;
	open_objects(store, part, fn_oid, lockmode);
}

/*
 * The durability mode the tables' persistence makes -- the one definition
 * of it: 'completed' when idem_result is logged and idem_record is not
 * (a finish then moves a record to idem_result), otherwise idem_record's
 * persistence alone.  results: idem_result's persistence, 0 without one.
 */
IdemDurability
idem_tables_mode(char records, char results)
{
	if (records != RELPERSISTENCE_PERMANENT && results == RELPERSISTENCE_PERMANENT)
		return IDEM_DURABILITY_COMPLETED;
	return records == RELPERSISTENCE_PERMANENT ? IDEM_DURABILITY_ALL :
		IDEM_DURABILITY_NONE;
}

/*
 * idem_result is opened when a call first needs it: a replay in modes
 * 'none' and 'all' finds its record in idem_record and never does.
 */
void
idem_store_need_heap(IdemStore *store, int table)
{
	Assert(table < store->ntables);
	if (table == IDEM_RESULTS && store->heap[IDEM_RESULTS] == NULL &&
		!store->hidden[IDEM_RESULTS])
		open_heap(store, IDEM_RESULTS, store->result_relid);
}

/* ... with its primary key */
void
idem_store_need_table(IdemStore *store, int table)
{
	idem_store_need_heap(store, table);
	if (store->heap[table] != NULL && store->index[table] == NULL)
		open_index(store, table);
}

/*
 * During recovery: say which records a look could not see (the unlogged
 * tables'), as a NOTICE.
 */
void
idem_store_note_hidden(IdemStore *store)
{
	if (store->hidden[IDEM_RECORDS])
		ereport(NOTICE,
				(errmsg("pending idempotency claims cannot be seen during recovery"),
				 errdetail(store->split ?
						   "Table \"idem_record\" is unlogged: it is not replicated to standbys. Completed records, which are logged, are shown." :
						   "The record tables are unlogged: they are not replicated to standbys, and no record is shown."),
				 errhint("Look on the primary to see every record.")));
}

/*
 * Close the tables and their indexes.  release: give the locks back now
 * rather than at the end of the transaction (a lock the transaction held
 * before the open stays held).
 */
void
idem_store_close(IdemStore *store, bool release)
{
	LOCKMODE	mode = release ? store->lockmode : NoLock;

	for (int t = store->ntables - 1; t >= 0; t--)
	{
		if (store->heap[t] == NULL)
			continue;
		if (store->index[t] != NULL)
			index_close(store->index[t], mode);
		table_close(store->heap[t], mode);
	}
	if (release && OidIsValid(store->shell))
		UnlockRelationOid(store->shell, store->lockmode);
	if (release && store->shard != 0)
	{
		IdemObjects objects;

		idem_catalog_objects(store->fn_oid, &objects);
		idem_citus_unlock_shard(&objects, store->shard);
		store->shard = 0;
	}
}

/*
 * A store opened on a schema without an epoch sequence finds none -- unless
 * an update that adds it committed after the look-up: lock the token sequence as
 * nextval() would, which also takes in that update's invalidations, and
 * look again.
 */
void
idem_store_find_epoch_seq(IdemStore *store)
{
	LockRelationOid(store->token_seq, RowExclusiveLock);
	store->epoch_seq = idem_catalog_member(store->extension, store->token_seq,
										   "idem_token_epoch");
}
