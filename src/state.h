/*-------------------------------------------------------------------------
 *
 * state.h
 *	  A record's state: the one definition that idem_begin's decision,
 *	  idem_inspect, idem_stats, idem_monitor and idem_forget use (state.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_STATE_H
#define IDEM_STATE_H

#include "store.h"

/* The states of a record, as idem_inspect names them */
typedef enum IdemState
{
	IDEM_STATE_PENDING,			/* a live claim: a duplicate waits or gets IK409 */
	IDEM_STATE_LAPSED,			/* a claim the next idem_begin takes over */
	IDEM_STATE_COMPLETED,		/* within its retention: a duplicate replays */
	IDEM_STATE_EXPIRED,			/* past its retention: counts as absent */
	IDEM_STATE_REMEMBERED,		/* past its retention, kept: IK410 */
	IDEM_STATE_UNKNOWN,			/* a 'session' claim seen on a standby */
	IDEM_NUM_STATES
} IdemState;

extern IdemState idem_record_state(const IdemRecord *rec, TimestampTz now);
extern const char *idem_state_name(IdemState state);

/* Does idem_begin find the record there, or count it as absent? */
static inline bool
idem_state_is_live(IdemState state)
{
	return state == IDEM_STATE_PENDING || state == IDEM_STATE_COMPLETED ||
		state == IDEM_STATE_UNKNOWN;
}

#endif							/* IDEM_STATE_H */
