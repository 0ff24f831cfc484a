/*-------------------------------------------------------------------------
 *
 * roles.h
 *	  A role's records through rename and drop (roles.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_ROLES_H
#define IDEM_ROLES_H

extern void idem_roles_init(void);

#endif							/* IDEM_ROLES_H */
