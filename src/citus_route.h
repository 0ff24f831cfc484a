/*-------------------------------------------------------------------------
 *
 * citus_route.h
 *	  Where a call finds a key's record on a Citus cluster (citus_route.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CITUS_ROUTE_H
#define IDEM_CITUS_ROUTE_H

#include "nodes/pg_list.h"
#include "catalog.h"
#include "idempotency.h"

extern bool idem_citus_internal_backend(void);
extern bool idem_citus_route(IdemObjects *objects, const IdemKey *key, bool write,
							 int64 *locked);
extern List *idem_citus_local_parts(const IdemObjects *objects, bool refuse_on_worker);

#endif							/* IDEM_CITUS_ROUTE_H */
