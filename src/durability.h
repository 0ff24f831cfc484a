/*-------------------------------------------------------------------------
 *
 * durability.h
 *	  The durability modes and their switches (durability.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_DURABILITY_H
#define IDEM_DURABILITY_H

#include "store.h"

extern IdemDurability idem_durability_from_name(const char *name);
extern void idem_durability_restore(Oid fn_oid, IdemDurability mode, bool replace);
extern void idem_durability_settle(Oid fn_oid);
extern bool idem_durability_switching(void);

#endif							/* IDEM_DURABILITY_H */
