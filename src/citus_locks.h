/*-------------------------------------------------------------------------
 *
 * citus_locks.h
 *	  Citus's shard metadata lock on a key's shard (citus_locks.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CITUS_LOCKS_H
#define IDEM_CITUS_LOCKS_H

#include "datatype/timestamp.h"
#include "catalog.h"

extern void idem_citus_locks_init(void);
extern void idem_citus_lock_shard(Oid shell, int64 shardid);
extern void idem_citus_unlock_shard(const IdemObjects *objects, int64 shardid);
extern bool idem_citus_take_given_back(void);
extern TimestampTz idem_citus_wake_by(TimestampTz until);

#endif							/* IDEM_CITUS_LOCKS_H */
