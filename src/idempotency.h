/*-------------------------------------------------------------------------
 *
 * idempotency.h
 *	  Shared declarations of the idempotency extension.
 *
 * The extension is split by concern, each file owning one thing:
 *	  idempotency.c  the module's entry point: each part's init
 *	  args.c         the settings, and the arguments of the idem_* functions
 *	  claim.c        idem_begin: look at the key's record, act on the decision
 *	  decide.c       what idem_begin does with a record: claim, replay,
 *	                 wait or refuse (nothing there reads, writes or sleeps)
 *	  wait.c         idem_begin's waits for another attempt
 *	  reply.c        idem_begin's row, and the errors that refuse a request
 *	  finish.c       idem_finish / idem_abort / idem_renew / idem_checkpoint
 *	  forget.c       idem_forget
 *	  catalog.c      the extension's objects, and their cache
 *	  shape.c        the record tables' shape
 *	  store.c        opening and closing the tables, and the one definition
 *	                 of the durability mode
 *	  read.c         reading records
 *	  state.c        a record's state: the one definition every view,
 *	                 function and claim decision uses
 *	  write.c        writing records, and every move between the tables
 *	  tokens.c       fencing tokens: epochs and counts
 *	  locks.c        the key lock, waiting for an attempt, waking waiters,
 *	                 the locks of 'session' claims and of switches
 *	  durability.c   the durability modes and the switches between them
 *	  restore.c      the triggers that settle a restored dump
 *	  publication.c  the guard against publications of the tables
 *	  purge.c        idem_purge(), and the background workers
 *	  citus.c        a Citus cluster: the records' layout, from its catalogs
 *	  citus_route.c  which node's table or shard holds a key's record, and
 *	                 what Citus must be told of a write
 *	  citus_locks.c  Citus's shard metadata lock, given back while a
 *	                 duplicate sleeps
 *	  citus_guard.c  the planner hook that refuses a NULL key or tenant
 *	  citus_tokens.c fencing tokens above every other node's
 *	  sql.c          SPI statements on the extension's own tables
 *	  stats.c        idem_inspect, idem_stats: the records as a DBA sees them
 *	  counters.c     server-wide counters in shared memory
 *	  fingerprint.c  idem_fingerprint()
 *	  pg_compat.h    differences between PostgreSQL versions
 *
 * Each part declares what it offers in a header of its own; this one holds
 * what all of them share: the SQLSTATEs, the limits, the policies and the
 * key.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_H
#define IDEMPOTENCY_H

#include "postgres.h"

#include "datatype/timestamp.h"
#include "fmgr.h"

/* The extension's own SQLSTATEs (the standard ones come from errcodes.h) */
#define ERRCODE_IDEMPOTENCY_IN_PROGRESS		MAKE_SQLSTATE('I','K','4','0','9')
#define ERRCODE_IDEMPOTENCY_KEY_REUSED		MAKE_SQLSTATE('I','K','4','2','2')
#define ERRCODE_IDEMPOTENCY_STALE_TOKEN		MAKE_SQLSTATE('I','K','4','1','2')
/* a remembered key whose response has expired */
#define ERRCODE_IDEMPOTENCY_RESPONSE_EXPIRED	MAKE_SQLSTATE('I','K','4','1','0')

/* Longest operation or key, in characters */
#define IDEM_MAX_KEY_CHARS		255
/* Longest fingerprint, in bytes (a SHA-256 takes 32) */
#define IDEM_MAX_FINGERPRINT_BYTES	1024
/* Largest idempotency.max_response_size: see check_response_size */
#define IDEM_MAX_RESPONSE_SIZE		(256 * 1024 * 1024)
/* Shortest retention a record may be given */
#define IDEM_MIN_TTL			(60 * USECS_PER_SEC)
/* Longest lease or retention accepted, to keep timestamps in range */
#define IDEM_MAX_INTERVAL_DAYS	36500
#define IDEM_MAX_INTERVAL		((int64) IDEM_MAX_INTERVAL_DAYS * USECS_PER_DAY)

typedef enum IdemInFlightPolicy
{
	IDEM_IN_FLIGHT_WAIT,
	IDEM_IN_FLIGHT_RAISE
} IdemInFlightPolicy;

/* When a committed pending claim may be taken over */
typedef enum IdemTakeover
{
	IDEM_TAKEOVER_LEASE,		/* when its lease lapses */
	IDEM_TAKEOVER_SESSION		/* ... or when the session that made it ends */
} IdemTakeover;

/*
 * Identifies one record: the calling role's key for one operation, and,
 * where the records are colocated with a tenant's table on Citus
 * (docs/scaling-out.md), the tenant's value too.
 */
typedef struct IdemKey
{
	Oid			role;
	text	   *operation;
	text	   *key;
	bool		has_tenant;		/* a call of an idem_* function's tenant form */
	Oid			tenant_type;	/* ... with a tenant of this type */
	Datum		tenant;
	uint64		hash;			/* of all of them; names the key's locks */
} IdemKey;

#endif							/* IDEMPOTENCY_H */
