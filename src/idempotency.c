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

#include "args.h"
#include "catalog.h"
#include "citus.h"
#include "counters.h"
#include "idempotency.h"
#include "publication.h"
#include "purge.h"
#include "shape.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

void
_PG_init(void)
{
	idem_args_init();			/* in_flight, lease, ttl, max_response_size */
	idem_purge_init();			/* purge_*, databases; the workers */
	idem_publication_init();	/* publish_records */
	idem_counters_init();		/* shared memory, when preloaded */
	idem_catalog_init();		/* forget cached OIDs on invalidation */
	idem_shape_init();			/* forget cached shapes on invalidation */
	idem_citus_init();			/* forget the Citus layout on invalidation */

	MarkGUCPrefixReserved("idempotency");
}
