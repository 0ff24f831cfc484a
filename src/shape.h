/*-------------------------------------------------------------------------
 *
 * shape.h
 *	  The record tables' shape (shape.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_SHAPE_H
#define IDEM_SHAPE_H

#include "store.h"

extern Relation idem_shape_open(Relation heap, LOCKMODE lockmode,
								IdemShape *shape);
extern const char *idem_shape_column_name(IdemColumn c);
extern void idem_shape_init(void);
extern void idem_shape_forget(Oid relid);

#endif							/* IDEM_SHAPE_H */
