/*-------------------------------------------------------------------------
 *
 * args.h
 *	  The settings and the arguments of the idem_* functions (args.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_ARGS_H
#define IDEM_ARGS_H

#include "idempotency.h"
#include "utils/jsonb.h"

extern void idem_args_init(void);
extern void idem_check_settings(void);
extern void idem_require_arg(FunctionCallInfo fcinfo, int argno, const char *name);
extern int	idem_key_from_args(FunctionCallInfo fcinfo, IdemKey *key, bool tenant);
extern void idem_key_hash(IdemKey *key);
extern void idem_key_check_tenant(const IdemKey *key, Oid tenant_type);
extern int64 idem_token_arg(FunctionCallInfo fcinfo, int argno);
extern bytea *idem_fingerprint_arg(FunctionCallInfo fcinfo, int argno);
extern IdemInFlightPolicy idem_policy_arg(FunctionCallInfo fcinfo, int argno);
extern int64 idem_interval_usecs(const Interval *iv, const char *name);
extern Jsonb *idem_response_arg(FunctionCallInfo fcinfo, int argno,
								const char *name);
extern IdemTakeover idem_takeover_arg(FunctionCallInfo fcinfo, int argno);
extern int64 idem_lease_arg(FunctionCallInfo fcinfo, int argno);
extern Interval idem_ttl_arg(FunctionCallInfo fcinfo, int argno);
extern int64 idem_remember_arg(FunctionCallInfo fcinfo, int argno);

#endif							/* IDEM_ARGS_H */
