/*-------------------------------------------------------------------------
 *
 * citus.c
 *	  What a Citus cluster makes of this node: where a key's record is, and
 *	  what a transaction that writes it must tell Citus.
 *
 * Citus creates the extension on every node of a cluster, so every node
 * has record tables of its own.  Two layouts keep one record per key:
 *
 * Records on the coordinator (the tables are not distributed: as
 * CREATE EXTENSION leaves them).  Every call that opens the records
 * refuses on a node that Citus has made a worker (its pg_dist_local_group
 * is not the coordinator's group, 0): answering there would keep a second
 * store, in which a key completed through the coordinator is new.
 *
 * Distributed records (after idem_distribute(), docs/scaling-out.md).
 * idem_record and idem_result are hash-distributed by key, colocated, and
 * the idem_* functions that take a key are distributed functions whose
 * calls Citus delegates to the node holding the key's shard.  There the
 * C code opens that node's shards of the two tables instead of the
 * tables: idem_citus_route() finds the shard whose hash range holds the
 * key (Citus's hash of the text key, which is what it routes by), takes
 * Citus's shard metadata lock in share mode, as its own writers do -- a
 * shard move takes it exclusively before it switches the shard to its new
 * node, so a move waits for our transaction and then carries our write
 * along -- and checks that the shard's placement is on this node.  A call
 * that was not delegated (inside PL/pgSQL, with a key that is not a
 * constant, or through a node that routes by stale metadata) therefore
 * fails with a clear error on the wrong node, rather than answering from
 * a shard that is not the key's: a source shard outlives its move until
 * Citus drops it.  Calls for the whole store (idem_purge, idem_stats) read
 * this node's shards: every node purges its own.
 *
 * In both layouts a transaction that writes a record may also write
 * distributed tables through Citus, the in-transaction shape's effect.
 * With one other node written, Citus commits it in one phase, before the
 * local commit, unless it is told that the transaction has a local write
 * of its own: a node that died between the two would keep the effect and
 * lose the claim and the result, and the retry would run the effect
 * again.  So a call that opens the records to write tells Citus, through
 * its Use2PCForCoordinatedTransaction() (a flag of the current
 * transaction, which Citus clears at its end; it does nothing in a
 * transaction that writes no other node).  A record written on a worker
 * for a delegated call is a write Citus itself made, and is committed
 * with the rest of the coordinated transaction, in two phases when it
 * wrote more than one node.
 *
 * Citus refuses to run unless it is in shared_preload_libraries, so a
 * backend without its settings is on no Citus node, and pays one look-up
 * of a setting.  A Citus node reads its catalogs at each call: the
 * coordinator may add this node, distribute the records or move a shard
 * while our sessions live.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/skey.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "catalog/namespace.h"
#include "catalog/pg_collation_d.h"
#include "catalog/pg_namespace_d.h"
#include "commands/extension.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"

#include "catalog.h"
#include "citus.h"

/* The coordinator's group: a node Citus has not added to a cluster has it too */
#define CITUS_COORDINATOR_GROUP 0

/* Citus's functions, looked up once */
static void (*use_2pc) (void) = NULL;
static void (*lock_shard_metadata) (int64 shardid, LOCKMODE mode) = NULL;

/* Is this a node of a Citus cluster, as far as this database goes? */
static bool
on_citus(void)
{
	return GetConfigOption("citus.version", true, false) != NULL &&
		!creating_extension && OidIsValid(get_extension_oid("citus", true));
}

/* One of Citus's catalogs (or their indexes) in pg_catalog */
static Oid
citus_catalog(const char *name)
{
	Oid			relid = get_relname_relid(name, PG_CATALOG_NAMESPACE);

	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("Citus catalog \"%s\" is missing", name)));
	return relid;
}

/* A column of one of Citus's catalogs */
static AttrNumber
citus_column(Oid catalog, const char *name)
{
	AttrNumber	att = get_attnum(catalog, name);

	if (att == InvalidAttrNumber)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("Citus catalog \"%s\" has no column \"%s\"",
						get_rel_name(catalog), name)));
	return att;
}

/*
 * The group of this node, from Citus's pg_dist_local_group.  It is empty
 * while a PostgreSQL upgrade of the node is being finished.
 */
static int32
local_group(void)
{
	Relation	rel;
	SysScanDesc scan;
	HeapTuple	tuple;
	int32		group = CITUS_COORDINATOR_GROUP;
	bool		found = false;

	rel = table_open(citus_catalog("pg_dist_local_group"), AccessShareLock);
	scan = systable_beginscan(rel, InvalidOid, false, NULL, 0, NULL);
	tuple = systable_getnext(scan);
	if (HeapTupleIsValid(tuple))
	{
		bool		isnull;
		Datum		value = heap_getattr(tuple, 1, RelationGetDescr(rel), &isnull);

		if (!isnull)
			group = DatumGetInt32(value);
		found = true;
	}
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	if (!found)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency records cannot be used while Citus is being upgraded"),
				 errdetail("pg_dist_local_group is empty, so this node does not know whether it is the coordinator."),
				 errhint("Run citus_finish_pg_upgrade() first.")));
	return group;
}

/* Is relid a distributed table (a row of pg_dist_partition)? */
static bool
is_distributed(Oid relid)
{
	Relation	rel;
	SysScanDesc scan;
	ScanKeyData skey;
	bool		found;

	ScanKeyInit(&skey, 1, BTEqualStrategyNumber, F_OIDEQ, ObjectIdGetDatum(relid));
	rel = table_open(citus_catalog("pg_dist_partition"), AccessShareLock);
	scan = systable_beginscan(rel, citus_catalog("pg_dist_partition_logical_relid_index"),
							  true, NULL, 1, &skey);
	found = HeapTupleIsValid(systable_getnext(scan));
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return found;
}

/* Call fn for each shard of relid, with its id and hash range */
typedef bool (*ShardCallback) (int64 shardid, int32 min, int32 max, void *arg);

static void
for_each_shard(Oid relid, ShardCallback fn, void *arg)
{
	Relation	rel;
	SysScanDesc scan;
	ScanKeyData skey;
	HeapTuple	tuple;

	Oid			catalog = citus_catalog("pg_dist_shard");

	/* by name: the catalog has dropped columns */
	AttrNumber	logicalrelid = citus_column(catalog, "logicalrelid");
	AttrNumber	shardid_att = citus_column(catalog, "shardid");
	AttrNumber	min_att = citus_column(catalog, "shardminvalue");
	AttrNumber	max_att = citus_column(catalog, "shardmaxvalue");

	ScanKeyInit(&skey, logicalrelid, BTEqualStrategyNumber, F_OIDEQ, ObjectIdGetDatum(relid));
	rel = table_open(catalog, AccessShareLock);
	scan = systable_beginscan(rel, citus_catalog("pg_dist_shard_logical_relid_index"),
							  true, NULL, 1, &skey);
	while (HeapTupleIsValid(tuple = systable_getnext(scan)))
	{
		TupleDesc	desc = RelationGetDescr(rel);
		bool		nullmin,
					nullmax,
					isnull;
		int64		shardid = DatumGetInt64(heap_getattr(tuple, shardid_att, desc, &isnull));
		Datum		min = heap_getattr(tuple, min_att, desc, &nullmin);
		Datum		max = heap_getattr(tuple, max_att, desc, &nullmax);

		if (nullmin || nullmax)
			continue;
		if (fn(shardid,
			   pg_strtoint32(TextDatumGetCString(min)),
			   pg_strtoint32(TextDatumGetCString(max)), arg))
			break;
	}
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
}

/* Has shardid a placement in group (this node's)? */
static bool
placed_on(int64 shardid, int32 group)
{
	Relation	rel;
	SysScanDesc scan;
	ScanKeyData skey[2];
	bool		found;

	Oid			catalog = citus_catalog("pg_dist_placement");

	/* heap attribute numbers, which systable_beginscan maps to the index's */
	ScanKeyInit(&skey[0], citus_column(catalog, "shardid"), BTEqualStrategyNumber,
				F_INT8EQ, Int64GetDatum(shardid));
	ScanKeyInit(&skey[1], citus_column(catalog, "groupid"), BTEqualStrategyNumber,
				F_INT4EQ, Int32GetDatum(group));
	rel = table_open(catalog, AccessShareLock);
	scan = systable_beginscan(rel, citus_catalog("placement_shardid_groupid_unique_index"),
							  true, NULL, 2, skey);
	found = HeapTupleIsValid(systable_getnext(scan));
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return found;
}

/* The shard holding one hash value */
typedef struct ShardOfHash
{
	int32		hash;
	int64		shardid;
} ShardOfHash;

static bool
match_hash(int64 shardid, int32 min, int32 max, void *arg)
{
	ShardOfHash *s = (ShardOfHash *) arg;

	if (s->hash < min || s->hash > max)
		return false;
	s->shardid = shardid;
	return true;
}

static int64
shard_of_hash(Oid relid, int32 hash)
{
	ShardOfHash s = {hash, 0};

	for_each_shard(relid, match_hash, &s);
	if (s.shardid == 0)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("no shard of \"%s\" holds hash value %d", get_rel_name(relid), hash)));
	return s.shardid;
}

/* The shard's relation on this node: the table's name and _shardid */
static Oid
shard_relid(Oid relid, int64 shardid)
{
	char	   *name = psprintf("%s_" INT64_FORMAT, get_rel_name(relid), shardid);
	Oid			shard = get_relname_relid(name, get_rel_namespace(relid));

	if (!OidIsValid(shard))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("shard \"%s\" is placed on this node but does not exist", name)));
	return shard;
}

static void
tell_citus_local_write(void)
{
	if (use_2pc == NULL)
		use_2pc = (void (*) (void))
			load_external_function("citus", "Use2PCForCoordinatedTransaction",
								   true, NULL);
	use_2pc();
}

/*
 * Point objects->records and objects->results at what this node serves
 * the key from, and say whether the records are distributed.  key NULL:
 * a call for the whole store (see idem_citus_local_parts).
 */
bool
idem_citus_route(IdemObjects *objects, const text *key, bool write)
{
	int32		group;
	int32		hash;
	int64		shardid;

	if (!on_citus())
		return false;
	group = local_group();
	if (!is_distributed(objects->records))
	{
		if (group != CITUS_COORDINATOR_GROUP)
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("idempotency records are served by the Citus coordinator, not by a worker"),
					 errdetail("This node is a worker of a Citus cluster (group %d); its own record tables would be a second store, in which a key completed through the coordinator counts as new.",
							   group),
					 errhint("Send calls of the idem_* functions to the coordinator, or distribute the records with idem_distribute().")));
		if (write)
			tell_citus_local_write();
		return false;
	}
	if (key == NULL)
		return true;

	/* the shard Citus routes the key to: its hash of the text, any collation */
	hash = DatumGetInt32(DirectFunctionCall1Coll(hashtext, C_COLLATION_OID,
												 PointerGetDatum(key)));
	shardid = shard_of_hash(objects->records, hash);
	if (lock_shard_metadata == NULL)
		lock_shard_metadata = (void (*) (int64, LOCKMODE))
			load_external_function("citus", "LockShardDistributionMetadata",
								   true, NULL);
	lock_shard_metadata(shardid, ShareLock);
	if (!placed_on(shardid, group))
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("the idempotency record of key \"%s\" is not on this node",
						text_to_cstring(key)),
				 errdetail("The records are distributed, and this key's shard " INT64_FORMAT " has no placement on this node (group %d): Citus did not delegate the call to the node that holds it.",
						   shardid, group),
				 errhint("Call the idem_* functions as statements of their own with constant operation and key, SELECT idem_begin('op', 'key', ...), from the application or inside a transaction block, not from a PL/pgSQL function or with a query's column as the key. A call that raced a shard move can be retried.")));
	objects->records = shard_relid(objects->records, shardid);
	if (OidIsValid(objects->results))
		objects->results = shard_relid(objects->results,
									   shard_of_hash(objects->results, hash));
	if (write)
		tell_citus_local_write();
	return true;
}

/* The local parts of the store: shard pairs collected by index */
typedef struct LocalParts
{
	int32		group;
	List	   *shards;			/* of int64 shard ids */
	List	   *mins;			/* and the least hash value of each */
} LocalParts;

static bool
collect_local(int64 shardid, int32 min, int32 max, void *arg)
{
	LocalParts *p = (LocalParts *) arg;

	if (placed_on(shardid, p->group))
	{
		int64	   *id = palloc(sizeof(int64));

		*id = shardid;
		p->shards = lappend(p->shards, id);
		p->mins = lappend_int(p->mins, min);
	}
	return false;
}

/*
 * The parts of the store this node serves: one IdemObjects per pair of
 * colocated shards placed here, or objects itself where the records are
 * not distributed.  refuse_worker: refuse on a worker when they are not
 * (idem_purge is not refused: a worker's own tables are empty).
 */
List *
idem_citus_local_parts(const IdemObjects *objects, bool refuse_worker)
{
	LocalParts	p;
	List	   *parts = NIL;
	ListCell   *sc,
			   *mc;

	if (!on_citus() || !is_distributed(objects->records))
	{
		IdemObjects *whole = palloc(sizeof(IdemObjects));

		*whole = *objects;
		if (refuse_worker)
			(void) idem_citus_route(whole, NULL, false);	/* refuses on a worker */
		return list_make1(whole);
	}
	memset(&p, 0, sizeof(p));
	p.group = local_group();
	for_each_shard(objects->records, collect_local, &p);
	forboth(sc, p.shards, mc, p.mins)
	{
		IdemObjects *part = palloc(sizeof(IdemObjects));
		int64		shardid = *(int64 *) lfirst(sc);

		*part = *objects;
		part->records = shard_relid(objects->records, shardid);
		if (OidIsValid(objects->results))
			part->results = shard_relid(objects->results,
										shard_of_hash(objects->results, lfirst_int(mc)));
		parts = lappend(parts, part);
	}
	return parts;
}

/* Are the records distributed, on a node of a Citus cluster? */
bool
idem_citus_distributed(Oid records)
{
	return on_citus() && is_distributed(records);
}
