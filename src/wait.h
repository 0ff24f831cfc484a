/*-------------------------------------------------------------------------
 *
 * wait.h
 *	  idem_begin's waits for another attempt (wait.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_WAIT_H
#define IDEM_WAIT_H

#include "store.h"

extern void idem_wait_for_writer(const IdemKey *key, const IdemRecord *rec);
extern void idem_wait_for_claim(IdemStore *store, const IdemKey *key,
								const IdemRecord *rec, TimestampTz now,
								TimestampTz *lock_deadline);

#endif							/* IDEM_WAIT_H */
