/*-------------------------------------------------------------------------
 *
 * read.h
 *	  Reading records (read.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_READ_H
#define IDEM_READ_H

#include "store.h"

extern Datum idem_store_role_datum(IdemStore *store, int t, Oid role);
extern bool idem_store_role_equal(IdemStore *store, int t, Datum value, Oid role);
extern Datum idem_store_required_column(IdemStore *store, int t, TupleTableSlot *slot,
										IdemColumn c);
extern bool idem_store_fetch_in(IdemStore *store, int table, const IdemKey *key,
								IdemRecord *rec);
extern void idem_store_note_claim(IdemStore *store, const IdemKey *key, int64 token,
								  ItemPointer tid);
extern bool idem_store_peek(IdemStore *store, const IdemKey *key,
							IdemRecord *rec);
extern bool idem_store_fetch(IdemStore *store, const IdemKey *key,
							 IdemRecord *rec);
extern bool idem_store_fetch_claim(IdemStore *store, const IdemKey *key,
								   int64 token, IdemRecord *rec);
typedef void (*IdemRecordCallback) (void *arg, text *operation,
									const IdemRecord *rec);
extern void idem_store_scan_role(IdemStore *store, Oid role,
								 IdemRecordCallback fn, void *arg);

#endif							/* IDEM_READ_H */
