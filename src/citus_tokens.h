/*-------------------------------------------------------------------------
 *
 * citus_tokens.h
 *	  Fencing tokens across the nodes of a Citus cluster (citus_tokens.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CITUS_TOKENS_H
#define IDEM_CITUS_TOKENS_H

#include "access/transam.h"
#include "catalog.h"

extern void idem_citus_tokens_init(void);
extern bool idem_citus_tokens_need_sync(const IdemObjects *objects, int64 shardid);
extern void idem_citus_tokens_synced(FullTransactionId before);
extern int64 idem_citus_other_epochs(Oid epoch_seq, int64 mask);
extern void idem_citus_lock_epochs(bool lock);
extern void idem_citus_record_epoch(const IdemObjects *objects, Oid epoch_seq,
									int64 epoch, int epoch_bits);

#endif							/* IDEM_CITUS_TOKENS_H */
