/*-------------------------------------------------------------------------
 *
 * counters.h
 *	  Server-wide counters (counters.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COUNTERS_H
#define IDEM_COUNTERS_H

#include "idempotency.h"

typedef enum IdemCounter
{
	IDEM_COUNT_CLAIMS,			/* idem_begin returned 'new' */
	IDEM_COUNT_REPLAYS,			/* idem_begin returned 'replay' */
	IDEM_COUNT_WAITS,			/* idem_begin calls that waited */
	IDEM_COUNT_WAIT_TIME,		/* microseconds they waited */
	IDEM_COUNT_IN_PROGRESS,		/* IK409 */
	IDEM_COUNT_KEY_REUSE,		/* IK422 */
	IDEM_COUNT_TAKEOVERS,		/* claims of a key whose lease lapsed */
	IDEM_COUNT_FENCED,			/* stale tokens: IK412, or abort returning false */
	IDEM_COUNT_ABORTS,			/* idem_abort returning true */
	IDEM_COUNT_PURGED,			/* records deleted by idem_purge */
	IDEM_COUNT_RECOVERIES,		/* idem_begin returned 'recover' */
	IDEM_COUNT_EXPIRED,			/* IK410 (remembered key) */
	IDEM_COUNT_FORGOTTEN,		/* records deleted by idem_forget */
	IDEM_NUM_COUNTERS
} IdemCounter;

extern void idem_counters_init(void);
extern void idem_count(IdemCounter counter, int64 n);

#endif							/* IDEM_COUNTERS_H */
