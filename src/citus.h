/*-------------------------------------------------------------------------
 *
 * citus.h
 *	  What a Citus cluster makes of this node (citus.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CITUS_H
#define IDEM_CITUS_H

#include "access/transam.h"
#include "datatype/timestamp.h"
#include "nodes/pg_list.h"
#include "catalog.h"
#include "idempotency.h"

extern void idem_citus_init(void);
extern void idem_citus_forget(Oid relid);
extern bool idem_citus_loaded(void);
extern bool idem_citus_internal_backend(void);
extern bool idem_citus_route(IdemObjects *objects, const IdemKey *key, bool write,
							 int64 *locked);
extern void idem_citus_unlock_shard(const IdemObjects *objects, int64 shardid);
extern TimestampTz idem_citus_wake_by(TimestampTz until);
extern bool idem_citus_tokens_need_sync(const IdemObjects *objects, int64 shardid);
extern void idem_citus_tokens_synced(FullTransactionId before);
extern int64 idem_citus_other_epochs(Oid epoch_seq, int64 mask);
extern List *idem_citus_local_parts(const IdemObjects *objects, bool refuse_on_worker);
extern bool idem_citus_distributed(Oid records);

#endif							/* IDEM_CITUS_H */
