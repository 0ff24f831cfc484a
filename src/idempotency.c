/*-------------------------------------------------------------------------
 *
 * idempotency.c
 *	  Module entry point: each part defines its settings, and reserves what
 *	  it needs at server start, in its own init.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "fmgr.h"
#include "utils/guc.h"
#include "utils/inval.h"

#include "args.h"
#include "catalog.h"
#include "citus.h"
#include "citus_guard.h"
#include "citus_locks.h"
#include "citus_tokens.h"
#include "counters.h"
#include "idempotency.h"
#include "publication.h"
#include "purge.h"
#include "roles.h"
#include "shape.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

/* Forget what the parts cached of relid (InvalidOid: of every relation) */
static void
forget_relation(Datum arg, Oid relid)
{
	idem_catalog_forget(relid);	/* the extension's objects */
	idem_shape_forget(relid);	/* the tables' shapes */
	idem_citus_forget(relid);	/* the Citus layout */
}

void
_PG_init(void)
{
	idem_args_init();			/* in_flight, lease, ttl, max_response_size */
	idem_purge_init();			/* purge_*, databases; the workers */
	idem_publication_init();	/* publish_records */
	idem_counters_init();		/* shared memory, when preloaded */
	idem_shape_init();			/* the cache of the tables' shapes */
	if (idem_citus_loaded())	/* before this library, as it must be */
	{
		idem_citus_tokens_init();	/* shared memory, when preloaded */
		idem_citus_guard_init();	/* the guard in front of Citus's planner */
		idem_citus_locks_init();	/* forget a shard lock given back */
	}
	idem_roles_init();			/* records through role renames and drops */

	/*
	 * One relcache callback for every cache of the parts: a backend has
	 * room for ten (MAX_RELCACHE_CALLBACKS), which Citus and a logical
	 * decoding plugin share with us in a walsender.
	 */
	CacheRegisterRelcacheCallback(forget_relation, (Datum) 0);

	MarkGUCPrefixReserved("idempotency");
}
