/*-------------------------------------------------------------------------
 *
 * write.h
 *	  Writing records and moving them between the tables (write.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_WRITE_H
#define IDEM_WRITE_H

#include "access/tableam.h"
#include "store.h"

extern void idem_store_insert(IdemStore *store, const IdemKey *key,
							  const IdemRecord *rec);
extern bool idem_store_moves(const IdemStore *store, const IdemRecord *rec,
							 bool durable);
extern TM_Result idem_store_update(IdemStore *store, const IdemKey *key,
								   const IdemRecord *rec);
extern TM_Result idem_store_delete(IdemStore *store, const IdemKey *key,
								   const IdemRecord *rec);
extern int64 idem_store_move_batch(IdemStore *store, int from, bool all,
								   int64 max_rows);

#endif							/* IDEM_WRITE_H */
