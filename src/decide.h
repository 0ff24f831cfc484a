/*-------------------------------------------------------------------------
 *
 * decide.h
 *	  What idem_begin does with the record it finds (decide.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_DECIDE_H
#define IDEM_DECIDE_H

#include "state.h"

/* What idem_begin was asked for */
typedef struct ClaimRequest
{
	bytea	   *fingerprint;	/* NULL: none */
	IdemInFlightPolicy policy;
	IdemTakeover takeover;
	int64		lease;
	Interval	ttl;
	int64		remember;		/* 0: off */
} ClaimRequest;

/* What to do with the record */
typedef enum BeginAction
{
	BEGIN_CLAIM,				/* absent or expired: claim it */
	BEGIN_REPLAY,				/* completed: answer with its response */
	BEGIN_WAIT_WRITER,			/* another transaction writes it: wait for
								 * that transaction, then look again */
	BEGIN_WAIT_CLAIM,			/* a live committed claim: sleep until it is
								 * finished, aborted or lapses, then look
								 * again */
	BEGIN_REFUSE				/* fail, with the error a BeginRefusal names */
} BeginAction;

/* Why a request is refused, each with its SQLSTATE */
typedef enum BeginRefusal
{
	REFUSE_NONE,
	REFUSE_KEY_REUSED,			/* IK422: another fingerprint */
	REFUSE_IN_PROGRESS,			/* IK409: another attempt holds it */
	REFUSE_IN_PROGRESS_OURS,	/* IK409: this transaction holds it */
	REFUSE_NOT_IN_SNAPSHOT,		/* 40001: a result the snapshot cannot see */
	REFUSE_RESPONSE_EXPIRED		/* IK410: remembered, its response gone */
} BeginRefusal;

extern bool idem_fingerprints_equal(const bytea *a, const bytea *b);
extern BeginAction idem_decide_begin(const IdemRecord *rec, IdemState state,
									 const ClaimRequest *req,
									 BeginRefusal *refusal);

#endif							/* IDEM_DECIDE_H */
