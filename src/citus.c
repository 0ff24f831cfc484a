/*-------------------------------------------------------------------------
 *
 * citus.c
 *	  What a Citus cluster makes of this node: where a key's record is, and
 *	  what a transaction that writes it must tell Citus.
 *
 * Citus creates the extension on every node of a cluster, so every node
 * has record tables of its own.  Three layouts keep one record per key:
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
 * Records colocated with a tenant's table (after
 * idem_distribute(colocate_with)).  As distributed records, but
 * distributed by their column "tenant", in the colocation group of a table
 * distributed by the tenant, and the functions' tenant forms are delegated
 * by the tenant: the route hashes the tenant, by its type's hash function,
 * and a record is on the node of its tenant's rows.
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
 * transaction that writes no other node; Citus's builds for PostgreSQL 16
 * and later do not export it, and there such a write is refused in a
 * transaction block: tell_citus_local_write).  A record written on a worker
 * for a delegated call is a write Citus itself made, and is committed
 * with the rest of the coordinated transaction, in two phases when it
 * wrote more than one node.
 *
 * Citus refuses to run unless it is in shared_preload_libraries, so a
 * backend without its settings is on no Citus node, and pays one look-up
 * of a setting.  A Citus node reads the layout -- its group, whether the
 * records are distributed, their shards' ranges and placements -- from
 * Citus's catalogs once, and again after Citus invalidates it: the
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
#include "nodes/primnodes.h"
#include "nodes/readfuncs.h"
#include "access/xact.h"
#include "catalog/pg_class.h"
#include "catalog/pg_type_d.h"
#include "miscadmin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/inval.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/syscache.h"
#include "utils/typcache.h"

#include "args.h"
#include "catalog.h"
#include "citus.h"

/* The coordinator's group: a node Citus has not added to a cluster has it too */
#define CITUS_COORDINATOR_GROUP 0

/*
 * Citus's functions, looked up once.  Use2PCForCoordinatedTransaction() is
 * a C function Citus's builds for PostgreSQL 16 and later do not export
 * (PostgreSQL compiles modules with hidden symbols from 16 on, and Citus
 * does not mark it PGDLLEXPORT): use_2pc_missing says so.
 * lock_shard_metadata() is Citus's SQL-callable function, exported by
 * every build.
 */
static void (*use_2pc) (void) = NULL;
static bool use_2pc_missing = false;
static PGFunction lock_shard_metadata = NULL;

/* Is Citus loaded in this backend (it must be preloaded, or it refuses)? */
bool
idem_citus_loaded(void)
{
	return GetConfigOption("citus.version", true, false) != NULL;
}

/* Is this a node of a Citus cluster, as far as this database goes? */
static bool
on_citus(void)
{
	return idem_citus_loaded() && !creating_extension &&
		OidIsValid(get_extension_oid("citus", true));
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

/*
 * Is relid a distributed table (a row of pg_dist_partition)?  If it is and
 * column is not NULL, *column is its distribution column (NULL for a table
 * that has none, a reference table), as Citus keeps it: a Var.
 */
static bool
distribution_of(Oid relid, Var **column)
{
	Relation	rel;
	SysScanDesc scan;
	ScanKeyData skey;
	HeapTuple	tuple;
	bool		found;
	Oid			catalog = citus_catalog("pg_dist_partition");

	ScanKeyInit(&skey, citus_column(catalog, "logicalrelid"), BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(relid));
	rel = table_open(catalog, AccessShareLock);
	scan = systable_beginscan(rel, citus_catalog("pg_dist_partition_logical_relid_index"),
							  true, NULL, 1, &skey);
	tuple = systable_getnext(scan);
	found = HeapTupleIsValid(tuple);
	if (found && column != NULL)
	{
		bool		isnull;
		Datum		partkey = heap_getattr(tuple, citus_column(catalog, "partkey"),
										   RelationGetDescr(rel), &isnull);
		Node	   *node = isnull ? NULL : stringToNode(TextDatumGetCString(partkey));

		if (node != NULL && !IsA(node, Var))
			elog(ERROR, "the distribution column of \"%s\" is not a column",
				 get_rel_name(relid));
		*column = (Var *) node;
	}
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

/* The shard relation on this node: the table's name and _shardid */
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

/*
 * What this node knows of the records' layout, read from Citus's catalogs
 * once and kept until Citus invalidates it: Citus sends a relcache
 * invalidation of a distributed table when its shards or their placements
 * change, and of pg_dist_local_group when the node's group does.  A call
 * takes Citus's metadata lock on its shard and then reads invalidations,
 * so it decides by the placements a move committed while it waited.
 */
typedef struct ShardRoute
{
	int32		min;			/* its hash range */
	int32		max;
	int64		shardid;		/* of idem_record's shard */
	int64		result_shardid; /* of idem_result's, the same range */
	bool		local;			/* placed on this node */
	Oid			records;		/* the shards' relations, when local */
	Oid			results;
} ShardRoute;

typedef struct RouteCache
{
	bool		valid;
	Oid			records;		/* idem_record, the cache's key */
	Oid			results;
	Oid			local_group_rel;	/* pg_dist_local_group */
	int32		group;
	bool		distributed;
	bool		by_tenant;		/* distributed by a tenant, not by key */
	Oid			dist_type;		/* the distribution column's type */
	Oid			dist_collation; /* ... and collation */
	FmgrInfo   *dist_hash;		/* its type's hash function (the type cache's) */
	int			nshards;
	ShardRoute *shards;			/* by range, in CacheMemoryContext */
} RouteCache;

static RouteCache route = {0};
static uint64 route_invalidations = 0;

/* A relcache invalidation of relid (InvalidOid: of all): idempotency.c */
void
idem_citus_forget(Oid relid)
{
	if (!route.valid)
		return;
	if (relid == InvalidOid || relid == route.records || relid == route.results ||
		relid == route.local_group_rel)
	{
		route.valid = false;
		route_invalidations++;
	}
}

/* the ranges of one table's shards, by their least value */
typedef struct ShardList
{
	int			n;
	int			size;
	ShardRoute *items;
} ShardList;

static bool
collect_shard(int64 shardid, int32 min, int32 max, void *arg)
{
	ShardList  *l = (ShardList *) arg;

	if (l->n == l->size)
	{
		l->size = l->size * 2 + 16;
		l->items = l->items ? repalloc(l->items, l->size * sizeof(ShardRoute)) :
			palloc(l->size * sizeof(ShardRoute));
	}
	memset(&l->items[l->n], 0, sizeof(ShardRoute));
	l->items[l->n].min = min;
	l->items[l->n].max = max;
	l->items[l->n].shardid = shardid;
	l->n++;
	return false;
}

static int
compare_ranges(const void *a, const void *b)
{
	int32		ma = ((const ShardRoute *) a)->min;
	int32		mb = ((const ShardRoute *) b)->min;

	return ma < mb ? -1 : (ma > mb ? 1 : 0);
}

static void
build_route(const IdemObjects *objects)
{
	ShardList	recs = {0};
	ShardList	ress = {0};
	Var		   *column = NULL;
	TypeCacheEntry *type;

	route.records = objects->records;
	route.results = objects->results;
	route.local_group_rel = citus_catalog("pg_dist_local_group");
	route.group = local_group();
	route.distributed = distribution_of(objects->records, &column);
	route.nshards = 0;
	if (route.shards != NULL)
		pfree(route.shards);
	route.shards = NULL;
	if (!route.distributed)
		return;
	if (column == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency table \"%s\" is not hash-distributed",
						get_rel_name(objects->records))));
	/* by key, as idem_distribute() makes it, or by the tenant it colocates with */
	route.by_tenant = column->varattno != get_attnum(objects->records, "key");
	route.dist_type = column->vartype;
	route.dist_collation = column->varcollid;
	type = lookup_type_cache(route.dist_type, TYPECACHE_HASH_PROC_FINFO);
	if (!OidIsValid(type->hash_proc_finfo.fn_oid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_FUNCTION),
				 errmsg("type %s has no hash function", format_type_be(route.dist_type))));
	route.dist_hash = &type->hash_proc_finfo;

	for_each_shard(objects->records, collect_shard, &recs);
	if (OidIsValid(objects->results))
		for_each_shard(objects->results, collect_shard, &ress);
	if (recs.n > 0)
		qsort(recs.items, recs.n, sizeof(ShardRoute), compare_ranges);
	if (ress.n > 0)
		qsort(ress.items, ress.n, sizeof(ShardRoute), compare_ranges);
	if (OidIsValid(objects->results) && ress.n != recs.n)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem_record and idem_result are not colocated"),
				 errdetail("They have %d and %d shards.", recs.n, ress.n)));
	route.shards = MemoryContextAllocZero(CacheMemoryContext,
										  Max(recs.n, 1) * sizeof(ShardRoute));
	for (int i = 0; i < recs.n; i++)
	{
		ShardRoute *r = &route.shards[i];

		*r = recs.items[i];
		if (OidIsValid(objects->results))
		{
			if (ress.items[i].min != r->min || ress.items[i].max != r->max)
				ereport(ERROR,
						(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
						 errmsg("idem_record and idem_result are not colocated"),
						 errdetail("Their shards %lld and %lld hold different hash ranges.",
								   (long long) r->shardid, (long long) ress.items[i].shardid)));
			r->result_shardid = ress.items[i].shardid;
		}
		r->local = placed_on(r->shardid, route.group);
		if (r->local)
		{
			r->records = shard_relid(objects->records, r->shardid);
			if (OidIsValid(objects->results))
				r->results = shard_relid(objects->results, r->result_shardid);
		}
	}
	route.nshards = recs.n;
}

/* The layout for objects, read again if Citus changed it since */
static RouteCache *
get_route(const IdemObjects *objects)
{
	if (!on_citus())
		return NULL;
	while (!route.valid || route.records != objects->records ||
		   route.results != objects->results)
	{
		uint64		seen = route_invalidations;

		route.valid = false;
		build_route(objects);
		route.valid = (seen == route_invalidations);
	}
	return &route;
}

/* The shard whose range holds hash */
static ShardRoute *
shard_of_hash(RouteCache *rc, int32 hash)
{
	int			lo = 0,
				hi = rc->nshards - 1;

	while (lo <= hi)
	{
		int			mid = (lo + hi) / 2;
		ShardRoute *r = &rc->shards[mid];

		if (hash < r->min)
			hi = mid - 1;
		else if (hash > r->max)
			lo = mid + 1;
		else
			return r;
	}
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("no shard of \"%s\" holds hash value %d", get_rel_name(rc->records), hash)));
	pg_unreachable();
}

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

/* Citus's shard metadata lock on shardid in share mode, as its writers take it */
static void
lock_shard_in_share_mode(Oid shell, int64 shardid)
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
 * a call for the whole store (see idem_citus_local_parts).
 */
bool
idem_citus_route(IdemObjects *objects, const IdemKey *key, bool write)
{
	RouteCache *rc = get_route(objects);
	int32		hash;
	ShardRoute *shard;
	int64		shardid;

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
	shardid = shard_of_hash(rc, hash)->shardid;
	lock_shard_in_share_mode(objects->records, shardid);
	/* a move that committed while we waited for the lock */
	AcceptInvalidationMessages();
	rc = get_route(objects);
	shard = shard_of_hash(rc, hash);
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
	RouteCache *rc = get_route(objects);
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

/* Are the records distributed, on a node of a Citus cluster? */
bool
idem_citus_distributed(Oid records)
{
	return on_citus() && distribution_of(records, NULL);
}
