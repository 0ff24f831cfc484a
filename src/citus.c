/*-------------------------------------------------------------------------
 *
 * citus.c
 *	  What a Citus cluster makes of this node: the layout of the records,
 *	  read from Citus's catalogs.
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
 * along (a duplicate that sleeps waiting for another attempt gives the
 * lock back while it sleeps, so that neither a move nor the other
 * attempt's finish queues behind it) -- and checks that the shard's
 * placement is on this node; a call that held it there before the move
 * took it away, or that Citus sent here by the placements before the move
 * (the move's source copy, which Citus drops later, is still here), is
 * told to retry (40001).  Any other call on a node without the key's
 * shard, one Citus did not delegate (inside PL/pgSQL, with a key that is
 * not a constant), fails with a clear error (0A000), rather than
 * answering from a shard that is not the key's.  Calls for the whole
 * store (idem_purge, idem_stats) read this node's shards: every node
 * purges its own.
 *
 * Records colocated with a tenant's table (after
 * idem_distribute(colocate_with)).  As distributed records, but
 * distributed by their column "tenant", in the colocation group of a table
 * distributed by the tenant, and the functions' tenant forms are delegated
 * by the tenant: the route hashes the tenant, by its type's hash function,
 * and a record is on the node of its tenant's rows.
 *
 * The rest of the Citus support is in parts of its own: citus_route.c
 * opens a key's shard and tells Citus of a write, citus_locks.c takes and
 * gives back Citus's shard metadata lock, citus_guard.c refuses a NULL
 * key or tenant before Citus plans the call, and citus_tokens.c keeps a
 * node's fencing tokens above those every other node issued.
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
#include "catalog/pg_namespace_d.h"
#include "catalog/pg_proc_d.h"
#include "commands/extension.h"
#include "nodes/primnodes.h"
#include "nodes/readfuncs.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/typcache.h"

#include "citus.h"

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
distribution_of(Oid relid, Var **column, int32 *colocation)
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
	if (found && colocation != NULL)
	{
		bool		isnull;
		Datum		id = heap_getattr(tuple, citus_column(catalog, "colocationid"),
									  RelationGetDescr(rel), &isnull);

		*colocation = isnull ? 0 : DatumGetInt32(id);
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

/*
 * Has shardid a placement in group (this node's)?  *xmin: the transaction
 * that wrote the placement's row here, which a shard move that brought the
 * shard here rewrites (Citus updates the row's group on every node with
 * metadata, and inserts a new one on the coordinator)
 */
static bool
placed_on(int64 shardid, int32 group, TransactionId *xmin)
{
	Relation	rel;
	SysScanDesc scan;
	ScanKeyData skey[2];
	HeapTuple	tuple;
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
	tuple = systable_getnext(scan);
	found = HeapTupleIsValid(tuple);
	*xmin = found ? HeapTupleHeaderGetRawXmin(tuple->t_data) : InvalidTransactionId;
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return found;
}

/*
 * Has Citus made funcid a distributed function, whose calls it delegates
 * (pg_dist_object)?
 */
bool
idem_citus_function_distributed(Oid funcid)
{
	Oid			catalog = citus_catalog("pg_dist_object");
	Relation	rel;
	SysScanDesc scan;
	ScanKeyData skey[2];
	bool		found;

	rel = table_open(catalog, AccessShareLock);
	ScanKeyInit(&skey[0], citus_column(catalog, "classid"), BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(ProcedureRelationId));
	ScanKeyInit(&skey[1], citus_column(catalog, "objid"), BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(funcid));
	scan = systable_beginscan(rel, citus_catalog("pg_dist_object_pkey"), true, NULL, 2, skey);
	found = HeapTupleIsValid(systable_getnext(scan));
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return found;
}

/* The relation of shard shardid of relid on this node (the table's name and _shardid), if any */
static Oid
shard_relation(Oid relid, int64 shardid, char **name)
{
	*name = psprintf("%s_" INT64_FORMAT, get_rel_name(relid), shardid);
	return get_relname_relid(*name, get_rel_namespace(relid));
}

/* The shard relation on this node, which must exist */
static Oid
shard_relid(Oid relid, int64 shardid)
{
	char	   *name;
	Oid			shard = shard_relation(relid, shardid, &name);

	if (!OidIsValid(shard))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("shard \"%s\" is placed on this node but does not exist", name)));
	return shard;
}

/*
 * Is a copy of shard shardid of relid left on this node?  A shard move
 * leaves its source behind, no longer placed here, until Citus's deferred
 * cleanup drops it: a call that finds it was routed here by the placements
 * before the move.
 */
bool
idem_citus_copy_left_here(Oid relid, int64 shardid)
{
	char	   *name;

	return OidIsValid(shard_relation(relid, shardid, &name));
}

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
	route.distributed = distribution_of(objects->records, &column, &route.colocation);
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
		r->local = placed_on(r->shardid, route.group, &r->placed_xmin);
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
RouteCache *
idem_citus_layout(const IdemObjects *objects)
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
ShardRoute *
idem_citus_shard_of_hash(RouteCache *rc, int32 hash)
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

/* Are the records distributed, on a node of a Citus cluster? */
bool
idem_citus_distributed(Oid records)
{
	return on_citus() && distribution_of(records, NULL, NULL);
}
