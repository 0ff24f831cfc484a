/*-------------------------------------------------------------------------
 *
 * citus_guard.h
 *	  The planner hook that refuses a NULL key or tenant before Citus
 *	  plans the call (citus_guard.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CITUS_GUARD_H
#define IDEM_CITUS_GUARD_H

extern void idem_citus_guard_init(void);

#endif							/* IDEM_CITUS_GUARD_H */
