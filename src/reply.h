/*-------------------------------------------------------------------------
 *
 * reply.h
 *	  What the claim functions answer: idem_begin's row, and the errors
 *	  that refuse a request (reply.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_REPLY_H
#define IDEM_REPLY_H

#include "decide.h"

/* idem_begin's status */
typedef enum ClaimStatus
{
	CLAIM_NEW,
	CLAIM_REPLAY,
	CLAIM_RECOVER				/* taken over, with the checkpoint to resume from */
} ClaimStatus;

extern Datum idem_claim_result(FunctionCallInfo fcinfo, ClaimStatus status,
							   const IdemRecord *rec);
extern void idem_refuse_begin(BeginRefusal why, const IdemKey *key,
							  const IdemRecord *rec, const bytea *fingerprint);
extern void idem_raise_stale_token(Oid fn_oid, const IdemKey *key, int64 token);
extern void idem_raise_lease_over_ttl(int64 lease, const Interval *ttl);

#endif							/* IDEM_REPLY_H */
