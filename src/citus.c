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
 * along (a duplicate that sleeps waiting for another attempt gives the
 * lock back while it sleeps, so that neither a move nor the other
 * attempt's finish queues behind it) -- and checks that the shard's
 * placement is on this node; a call that held it there before the move
 * took it away is told to retry (40001).  A call
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
#include "access/relation.h"
#include "access/skey.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/transam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/namespace.h"
#include "catalog/pg_class.h"
#include "catalog/pg_collation_d.h"
#include "catalog/pg_language_d.h"
#include "catalog/pg_namespace_d.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type_d.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "nodes/nodeFuncs.h"
#include "nodes/params.h"
#include "nodes/pathnodes.h"
#include "nodes/primnodes.h"
#include "nodes/readfuncs.h"
#include "optimizer/optimizer.h"
#include "optimizer/planner.h"
#include "storage/ipc.h"
#include "storage/lock.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
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
 * The classes of Citus's shard metadata locks (advisory locks):
 * ADV_LOCKTAG_CLASS_CITUS_SHARD_METADATA, by shard, and
 * ADV_LOCKTAG_CLASS_CITUS_COLOCATED_SHARDS_METADATA, by colocation group
 * and shard index, which a hash-distributed table's shards use
 */
#define CITUS_SHARD_METADATA_LOCK_CLASS 4
#define CITUS_COLOCATED_SHARDS_METADATA_LOCK_CLASS 8

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

static planner_hook_type prev_planner = NULL;

/* the call gave back its shard's lock to sleep (idem_citus_unlock_shard) */
static bool shard_given_back = false;

/* how long a sleep that gave back its shard's lock lasts at most: a move may take the shard away meanwhile */
#define SHARD_SLEEP_MS 1000

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
	TransactionId placed_xmin;	/* ... by this transaction (placed_on) */
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
	int32		colocation;		/* the colocation group's id */
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
	RouteCache *rc = get_route(objects);
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
	RouteCache *rc = get_route(objects);
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
	moved_while_asleep = shard_given_back;
	shard_given_back = false;
	shard = shard_of_hash(rc, hash);
	shardid = shard->shardid;
	/* here before the lock: a move that took it away raced this call */
	moved_while_asleep |= shard->local;
	lock_shard_in_share_mode(objects->records, shardid);
	*locked = shardid;
	/* a move that committed while we waited for the lock */
	AcceptInvalidationMessages();
	rc = get_route(objects);
	shard = shard_of_hash(rc, hash);
	if ((shard->shardid != shardid || !shard->local) && moved_while_asleep)
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
	return on_citus() && distribution_of(records, NULL, NULL);
}

/*
 * A NULL distribution argument, refused before Citus plans the call.
 *
 * Citus delegates a call of a distributed function -- SELECT f(...), or
 * SELECT ... FROM f(...) -- by hashing the constant its distribution
 * argument has once the planner has folded it.  Citus 13.2 does not look
 * at whether that constant is NULL: for a type passed by value (bigint)
 * it hashes a zero, and for one passed by reference (text, numeric, uuid:
 * the key of records distributed by key, a tenant of such a type) it
 * reads through a null pointer and takes the node down, with every
 * session on it.  The functions refuse a NULL key or tenant anyway
 * (22004), so this planner hook, which runs before Citus's (the library
 * is preloaded after Citus), refuses such a call of one of ours with that
 * error while planning it, on every node, whatever the layout.
 */

/*
 * Is funcid one of our functions that take a key?  If so, *key_arg and
 * *tenant_arg (-1: none) are the arguments Citus may delegate it by.
 */
static bool
distribution_args(Oid funcid, int *key_arg, int *tenant_arg)
{
	static const char *const keyed[] = {
		"idem_begin", "idem_finish", "idem_abort", "idem_renew",
		"idem_checkpoint", "idem_inspect", "idem_forget"
	};
	HeapTuple	tuple;
	Form_pg_proc proc;
	bool		ours = false;

	tuple = SearchSysCache1(PROCOID, ObjectIdGetDatum(funcid));
	if (!HeapTupleIsValid(tuple))
		return false;
	proc = (Form_pg_proc) GETSTRUCT(tuple);
	if (proc->prolang == ClanguageId && strncmp(NameStr(proc->proname), "idem_", 5) == 0)
	{
		bool		isnull;
		Datum		bin = SysCacheGetAttr(PROCOID, tuple, Anum_pg_proc_probin, &isnull);
		Datum		src = SysCacheGetAttr(PROCOID, tuple, Anum_pg_proc_prosrc, &isnull);
		char	   *library = TextDatumGetCString(bin);
		char	   *symbol = TextDatumGetCString(src);
		size_t		len = strlen(library);

		if (len >= strlen("idempotency") &&
			strcmp(library + len - strlen("idempotency"), "idempotency") == 0)
		{
			for (int i = 0; i < lengthof(keyed) && !ours; i++)
			{
				size_t		n = strlen(keyed[i]);

				if (strncmp(symbol, keyed[i], n) != 0)
					continue;
				if (symbol[n] == '\0')
				{
					*tenant_arg = -1;
					*key_arg = 1;
					ours = true;
				}
				else if (strcmp(symbol + n, "_tenant") == 0)
				{
					*tenant_arg = 0;
					*key_arg = 2;
					ours = true;
				}
			}
		}
	}
	ReleaseSysCache(tuple);
	return ours;
}

/* Is the argument NULL, as the planner will fold it with these parameters? */
static bool
folds_to_null(Node *arg, ParamListInfo params)
{
	PlannerGlobal glob;
	PlannerInfo root;
	Node	   *folded;

	if (IsA(arg, Const))
		return ((Const *) arg)->constisnull;
	if (IsA(arg, Param) && ((Param *) arg)->paramkind != PARAM_EXTERN)
		return false;
	if (params == NULL && IsA(arg, Param))
		return false;
	if (!IsA(arg, Param) && contain_volatile_functions(arg))
		return false;
	MemSet(&glob, 0, sizeof(glob));
	MemSet(&root, 0, sizeof(root));
	glob.boundParams = params;
	root.glob = &glob;
	folded = estimate_expression_value(&root, copyObject(arg));
	return IsA(folded, Const) && ((Const *) folded)->constisnull;
}

static void
refuse_null_distribution_arg(Node *expr, ParamListInfo params)
{
	FuncExpr   *call;
	int			key_arg,
				tenant_arg;

	if (expr == NULL || !IsA(expr, FuncExpr))
		return;
	call = (FuncExpr *) expr;
	if (!distribution_args(call->funcid, &key_arg, &tenant_arg))
		return;
	if (tenant_arg >= 0 && tenant_arg < list_length(call->args) &&
		folds_to_null(list_nth(call->args, tenant_arg), params))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("argument \"%s\" must not be null", "tenant")));
	if (key_arg < list_length(call->args) &&
		folds_to_null(list_nth(call->args, key_arg), params))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("argument \"%s\" must not be null", "key")));
}

static PlannedStmt *
citus_guard_planner(Query *parse, const char *query_string, int cursor_options,
					ParamListInfo params)
{
	/* the shapes Citus delegates: a call in the select list, or in FROM */
	if (parse->commandType == CMD_SELECT)
	{
		ListCell   *lc;

		foreach(lc, parse->targetList)
			refuse_null_distribution_arg((Node *) ((TargetEntry *) lfirst(lc))->expr, params);
		foreach(lc, parse->rtable)
		{
			RangeTblEntry *rte = (RangeTblEntry *) lfirst(lc);
			ListCell   *fc;

			if (rte->rtekind != RTE_FUNCTION)
				continue;
			foreach(fc, rte->functions)
				refuse_null_distribution_arg(((RangeTblFunction *) lfirst(fc))->funcexpr, params);
		}
	}
	if (prev_planner != NULL)
		return prev_planner(parse, query_string, cursor_options, params);
	return standard_planner(parse, query_string, cursor_options, params);
}

/*
 * Fencing tokens across nodes.  A node draws a key's tokens from its own
 * sequences (tokens.c), and those of two nodes are unrelated: after a
 * shard moves, its keys' next tokens come from another node's counter,
 * which may be behind the one that issued their earlier tokens -- and a
 * key whose record was deleted (idem_abort, idem_forget, the purge) has
 * no record whose token the next claim could go above.  So before a node
 * issues a token for a shard that came to it since it last looked, it
 * starts an epoch above the epoch of every other node of the cluster
 * (idem_citus_other_epochs): every token a node issued before that is
 * below the new epoch's first.
 *
 * "Came since it last looked": the placement's row on this node was
 * written (by the move's switch, after the source node issued its last
 * token for the shard) by a transaction not older than the transaction
 * counter's value when the node last began to read the epochs.  The node
 * keeps that value in shared memory, per database (and each backend its
 * own, which is enough without shared memory); it reads the epochs again
 * after a restart, and when the value is a billion transactions old.
 */
#define SYNC_SLOTS 16
#define SYNC_MAX_AGE (UINT64CONST(1) << 30)

typedef struct TokenSync
{
	slock_t		mutex;
	Oid			database[SYNC_SLOTS];
	FullTransactionId synced[SYNC_SLOTS];
} TokenSync;

static TokenSync *token_sync = NULL;
static FullTransactionId backend_synced = {0};
static shmem_request_hook_type prev_shmem_request = NULL;
static shmem_startup_hook_type prev_shmem_startup = NULL;

static void
token_sync_request(void)
{
	if (prev_shmem_request != NULL)
		prev_shmem_request();
	RequestAddinShmemSpace(MAXALIGN(sizeof(TokenSync)));
}

static void
token_sync_startup(void)
{
	bool		found;

	if (prev_shmem_startup != NULL)
		prev_shmem_startup();
	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	token_sync = ShmemInitStruct("idempotency token sync", sizeof(TokenSync), &found);
	if (!found)
	{
		memset(token_sync, 0, sizeof(TokenSync));
		SpinLockInit(&token_sync->mutex);
	}
	LWLockRelease(AddinShmemInitLock);
}

/* When this node (or backend) began its last read of every node's epochs, for this database */
static FullTransactionId
last_synced(void)
{
	FullTransactionId synced = backend_synced;

	if (token_sync != NULL)
	{
		SpinLockAcquire(&token_sync->mutex);
		for (int i = 0; i < SYNC_SLOTS; i++)
			if (token_sync->database[i] == MyDatabaseId &&
				FullTransactionIdFollows(token_sync->synced[i], synced))
				synced = token_sync->synced[i];
		SpinLockRelease(&token_sync->mutex);
	}
	return synced;
}

/* The read of every node's epochs that began at before is done */
void
idem_citus_tokens_synced(FullTransactionId before)
{
	if (FullTransactionIdFollows(before, backend_synced))
		backend_synced = before;
	if (token_sync == NULL)
		return;
	SpinLockAcquire(&token_sync->mutex);
	for (int i = 0; i < SYNC_SLOTS; i++)
	{
		if (token_sync->database[i] == MyDatabaseId || token_sync->database[i] == InvalidOid)
		{
			token_sync->database[i] = MyDatabaseId;
			if (FullTransactionIdFollows(before, token_sync->synced[i]))
				token_sync->synced[i] = before;
			break;
		}
	}
	SpinLockRelease(&token_sync->mutex);
}

/* Must a token for the key's shard (idem_citus_route's *locked) wait for a read of every node's epoch? */
bool
idem_citus_tokens_need_sync(const IdemObjects *objects, int64 shardid)
{
	RouteCache *rc = get_route(objects);
	FullTransactionId synced = last_synced();
	FullTransactionId next = ReadNextFullTransactionId();

	if (rc == NULL || !rc->distributed)
		return false;
	if (!FullTransactionIdIsValid(synced) ||
		U64FromFullTransactionId(next) - U64FromFullTransactionId(synced) > SYNC_MAX_AGE)
		return true;
	for (int i = 0; i < rc->nshards; i++)
	{
		TransactionId xmin = rc->shards[i].placed_xmin;

		if (rc->shards[i].shardid != shardid)
			continue;
		return TransactionIdIsNormal(xmin) &&
			!TransactionIdPrecedes(xmin, XidFromFullTransactionId(synced));
	}
	return true;
}

/*
 * The greatest epoch recorded in epoch_seq (its last value, bits of the
 * epoch only: mask) on the other nodes of the cluster, 0 if none; as the
 * sequence's owner, the extension's, over Citus's connections to every
 * node.  Refused (08006) if a node cannot be read: its epoch might be the
 * greatest.
 */
int64
idem_citus_other_epochs(Oid epoch_seq, int64 mask)
{
	Relation	seq = relation_open(epoch_seq, AccessShareLock);
	Oid			owner = seq->rd_rel->relowner;
	char	   *name = quote_qualified_identifier(get_namespace_name(RelationGetNamespace(seq)),
												  RelationGetRelationName(seq));
	Oid			save_userid;
	int			save_sec_context;
	int64		greatest = 0;
	StringInfoData query;

	relation_close(seq, NoLock);
	initStringInfo(&query);
	appendStringInfo(&query,
					 "SELECT n.success, n.result FROM pg_catalog.run_command_on_all_nodes(%s) n",
					 quote_literal_cstr(psprintf("SELECT (SELECT system_identifier FROM pg_catalog.pg_control_system()) "
												 "OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) last_value FROM %s",
												 name)));

	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(owner, save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	PG_TRY();
	{
		int64		self = (int64) GetSystemIdentifier();

		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "SPI_connect failed");
		if (SPI_execute(query.data, true, 0) != SPI_OK_SELECT)
			elog(ERROR, "could not read the token epochs of the Citus nodes");
		for (uint64 i = 0; i < SPI_processed; i++)
		{
			bool		isnull;
			bool		success = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[i],
															 SPI_tuptable->tupdesc, 1, &isnull));
			char	   *result = SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 2);
			char	   *colon = result != NULL ? strchr(result, ':') : NULL;
			int64		node;
			int64		epoch;

			if (!success || colon == NULL)
				ereport(ERROR,
						(errcode(ERRCODE_CONNECTION_FAILURE),
						 errmsg("could not read the fencing token epoch of every Citus node"),
						 errdetail("A node answered: %s", result != NULL ? result : "(nothing)"),
						 errhint("A node that holds a shard that came to it since it last read them reads every node's epoch before it issues a token; retry when every node is up.")));
			*colon = '\0';
			node = pg_strtoint64(result);
			epoch = pg_strtoint64(colon + 1) & mask;
			if (node != self && epoch > greatest)
				greatest = epoch;
		}
		SPI_finish();
	}
	PG_FINALLY();
	{
		SetUserIdAndSecContext(save_userid, save_sec_context);
	}
	PG_END_TRY();
	return greatest;
}

/* At the end of each transaction: no call has given back its shard's lock */
static void
forget_given_back(XactEvent event, void *arg)
{
	shard_given_back = false;
}

/*
 * Called from _PG_init: where Citus is loaded before this library (as it
 * must be, first in shared_preload_libraries), reserve the token sync's
 * shared memory, put the guard in front of Citus's planner, and forget at
 * the end of each transaction that a call gave back its shard's lock.
 */
void
idem_citus_init(void)
{
	if (!idem_citus_loaded())
		return;
	if (process_shared_preload_libraries_in_progress)
	{
		prev_shmem_request = shmem_request_hook;
		shmem_request_hook = token_sync_request;
		prev_shmem_startup = shmem_startup_hook;
		shmem_startup_hook = token_sync_startup;
	}
	prev_planner = planner_hook;
	planner_hook = citus_guard_planner;
	RegisterXactCallback(forget_given_back, NULL);
}
