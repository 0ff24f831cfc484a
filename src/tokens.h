/*-------------------------------------------------------------------------
 *
 * tokens.h
 *	  Fencing tokens (tokens.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_TOKENS_H
#define IDEM_TOKENS_H

#include "store.h"

extern int64 idem_next_token(IdemStore *store);
extern int64 idem_next_token_above(IdemStore *store, int64 floor);

#endif							/* IDEM_TOKENS_H */
