/*-------------------------------------------------------------------------
 *
 * citus.h
 *	  What a Citus cluster makes of this node: the records' layout (citus.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CITUS_H
#define IDEM_CITUS_H

#include "fmgr.h"
#include "catalog.h"

/* The coordinator's group: a node Citus has not added to a cluster has it too */
#define CITUS_COORDINATOR_GROUP 0

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

extern void idem_citus_forget(Oid relid);
extern bool idem_citus_loaded(void);
extern bool idem_citus_distributed(Oid records);
extern RouteCache *idem_citus_layout(const IdemObjects *objects);
extern ShardRoute *idem_citus_shard_of_hash(RouteCache *rc, int32 hash);
extern bool idem_citus_copy_left_here(Oid relid, int64 shardid);
extern bool idem_citus_function_distributed(Oid funcid);

#endif							/* IDEM_CITUS_H */
