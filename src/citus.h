/*-------------------------------------------------------------------------
 *
 * citus.h
 *	  What a Citus cluster makes of this node (citus.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CITUS_H
#define IDEM_CITUS_H

#include "nodes/pg_list.h"
#include "catalog.h"
#include "idempotency.h"

extern void idem_citus_forget(Oid relid);
extern bool idem_citus_loaded(void);
extern bool idem_citus_route(IdemObjects *objects, const IdemKey *key, bool write);
extern List *idem_citus_local_parts(const IdemObjects *objects, bool refuse_on_worker);
extern bool idem_citus_distributed(Oid records);

#endif							/* IDEM_CITUS_H */
