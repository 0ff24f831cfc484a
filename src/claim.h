/*-------------------------------------------------------------------------
 *
 * claim.h
 *	  The state of a record as the claim logic sees it (claim.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLAIM_H
#define IDEM_CLAIM_H

#include "read.h"

extern const char *idem_record_state(const IdemRecord *rec, TimestampTz now);

#endif							/* IDEM_CLAIM_H */
