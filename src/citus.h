/*-------------------------------------------------------------------------
 *
 * citus.h
 *	  What a Citus cluster makes of this node (citus.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CITUS_H
#define IDEM_CITUS_H

extern void idem_citus_check_node(bool write);

#endif							/* IDEM_CITUS_H */
