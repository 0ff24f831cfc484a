/*-------------------------------------------------------------------------
 *
 * idempotency.h
 *	  Shared declarations of the idempotency extension.
 *
 * The extension is split by concern, each file owning one thing:
 *	  idempotency.c  the module's entry point: each part's init
 *	  args.c         the settings, and the arguments of the idem_* functions
 *	  claim.c        the claim logic: idem_begin / idem_finish / idem_abort /
 *	                 idem_renew / idem_checkpoint
 *	  catalog.c      the extension's objects, and their cache
 *	  shape.c        the record tables' shape
 *	  store.c        opening and closing the tables, and the one definition
 *	                 of the durability mode
 *	  read.c         reading records
 *	  write.c        writing records, and every move between the tables
 *	  tokens.c       fencing tokens: epochs and counts
 *	  locks.c        the key lock, waiting for an attempt, waking waiters,
 *	                 the locks of 'session' claims and of switches
 *	  durability.c   the durability modes and the switches between them
 *	  restore.c      the triggers that settle a restored dump
 *	  publication.c  the guard against publications of the tables
 *	  purge.c        idem_purge(), and the background workers
 *	  sql.c          SPI statements on the extension's own tables
 *	  stats.c        idem_inspect, idem_stats: the records as a DBA sees them
 *	  counters.c     server-wide counters in shared memory
 *	  fingerprint.c  idem_fingerprint()
 *	  pg_compat.h    differences between PostgreSQL versions
 *
 * This header holds what several of them share: the key, the record, the
 * store of open tables, and the declarations of the parts that have no
 * header of their own.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_H
#define IDEMPOTENCY_H

#include "postgres.h"

#include "access/tableam.h"
#include "fmgr.h"
#include "datatype/timestamp.h"
#include "utils/jsonb.h"
#include "storage/lockdefs.h"
#include "nodes/execnodes.h"
#include "utils/relcache.h"
#include "utils/resowner.h"

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

/* Identifies one record: the calling role's key for one operation */
typedef struct IdemKey
{
	Oid			role;
	text	   *operation;
	text	   *key;
	uint64		hash;			/* of all three; names the key's locks */
} IdemKey;

/* ---- arguments and their settings (args.c) ---- */

extern int	idem_in_flight;			/* IdemInFlightPolicy */
extern int	idem_lease_ms;
extern int	idem_ttl_s;
extern int	idem_max_response_size;
extern int	idem_takeover;			/* IdemTakeover */
extern int	idem_remember_s;

extern void idem_args_init(void);
extern void idem_check_settings(void);
extern void idem_require_arg(FunctionCallInfo fcinfo, int argno, const char *name);
extern void idem_key_from_args(FunctionCallInfo fcinfo, IdemKey *key);
extern void idem_key_hash(IdemKey *key);
extern int64 idem_token_arg(FunctionCallInfo fcinfo, int argno);
extern bytea *idem_fingerprint_arg(FunctionCallInfo fcinfo, int argno);
extern IdemInFlightPolicy idem_policy_arg(FunctionCallInfo fcinfo, int argno);
extern int64 idem_interval_usecs(const Interval *iv, const char *name);
extern Jsonb *idem_response_arg(FunctionCallInfo fcinfo, int argno,
								const char *name);
extern IdemTakeover idem_takeover_arg(FunctionCallInfo fcinfo, int argno);
extern int64 idem_remember_arg(FunctionCallInfo fcinfo, int argno);

/* ---- storage (storage.c) ---- */

/*
 * The store's tables: idem_record holds claims, and completed records
 * except in durability mode 'completed', where those go to idem_result
 * (logged, while idem_record is unlogged).
 */
#define IDEM_RECORDS		0
#define IDEM_RESULTS		1
#define IDEM_NUM_TABLES		2

/*
 * The columns of both tables, found by name (shape.c): a DBA may add
 * columns of their own.  A schema older than 1.4 lacks the last four.
 */
typedef enum IdemColumn
{
	IDEM_COL_ROLE_ID,
	IDEM_COL_OPERATION,
	IDEM_COL_KEY,
	IDEM_COL_TOKEN,
	IDEM_COL_FINGERPRINT,
	IDEM_COL_TTL,
	IDEM_COL_CREATED_AT,
	IDEM_COL_COMPLETED_AT,
	IDEM_COL_EXPIRES_AT,
	IDEM_COL_RESPONSE,
	IDEM_COL_HOLDER,
	IDEM_COL_CHECKPOINT,
	IDEM_COL_TAKEOVERS,
	IDEM_COL_FORGET_AT,
	IDEM_NUM_COLUMNS
} IdemColumn;

#define IDEM_NUM_COLUMNS_1_0	(IDEM_COL_RESPONSE + 1)

/* Where each column is in one table (InvalidAttrNumber: absent) */
typedef struct IdemShape
{
	AttrNumber	attnum[IDEM_NUM_COLUMNS];
	bool		exact;			/* every column is ours, nothing dropped */
	bool		has_1_4;		/* the last four columns are there */
	Oid			pkey;			/* primary key on (role_id, operation, key) */
} IdemShape;

/* The tables and their primary key indexes, open for one call */
typedef struct IdemStore
{
	Relation	heap[IDEM_NUM_TABLES];
	Relation	index[IDEM_NUM_TABLES];	/* each table's primary key */
	IdemShape	shape[IDEM_NUM_TABLES];	/* each table's columns */
	bool		hidden[IDEM_NUM_TABLES];	/* unlogged, during recovery */
	int			ntables;		/* 1 in a schema older than 1.3 */
	Oid			result_relid;	/* idem_result; its heap[] is NULL until used */
	bool		split;			/* mode 'completed': results to idem_result */
	LOCKMODE	lockmode;		/* of all of them */
	Oid			fn_oid;			/* the SQL function that opened them */
	Oid			extension;		/* the extension that owns them */
	Oid			token_seq;		/* idem_token_seq: the count */
	Oid			epoch_seq;		/* idem_token_epoch; InvalidOid before 1.2 */
} IdemStore;

/* One record's columns, plus what the fetch learned about its version */
typedef struct IdemRecord
{
	int64		token;
	bytea	   *fingerprint;	/* NULL when the claim gave none */
	Interval	ttl;
	TimestampTz created_at;
	TimestampTz completed_at;	/* 0 while pending */
	TimestampTz expires_at;		/* pending: lease end; completed: retention end */
	Jsonb	   *response;		/* NULL while pending, and once forgotten */
	int64		holder;			/* the session holding a 'session'
								 * claim; 0: none */
	Jsonb	   *checkpoint;		/* the last idem_checkpoint state */
	int32		takeovers;		/* times the key was taken over */
	TimestampTz forget_at;		/* end of 'remember'; 0: expires_at */

	/* filled in by idem_store_fetch */
	int			table;			/* IDEM_RECORDS or IDEM_RESULTS */
	ItemPointerData tid;
	TransactionId busy_xid;		/* another transaction inserting/changing it */
	bool		uncommitted;	/* ... and it is inserting this version */
	bool		mine;			/* this version was written by our transaction */
	bool		in_snapshot;	/* visible to the transaction snapshot */
} IdemRecord;

#define IdemRecordIsPending(rec)	((rec)->completed_at == 0)

/* The durability modes, in order of what they keep (durability.c) */
typedef enum IdemDurability
{
	IDEM_DURABILITY_NONE,
	IDEM_DURABILITY_COMPLETED,
	IDEM_DURABILITY_ALL
} IdemDurability;

/* opening and closing the tables, the mode (store.c) */
extern void idem_store_open(IdemStore *store, Oid fn_oid, LOCKMODE lockmode);
extern void idem_store_need_heap(IdemStore *store, int table);
extern void idem_store_need_table(IdemStore *store, int table);
extern IdemDurability idem_tables_mode(char records, char results);

/* Column c of a version in table t; absent columns read as NULL */
static inline Datum
idem_store_column(IdemStore *store, int t, TupleTableSlot *slot, IdemColumn c, bool *isnull)
{
	AttrNumber	att = store->shape[t].attnum[c];

	if (att == InvalidAttrNumber)
	{
		*isnull = true;
		return (Datum) 0;
	}
	return slot_getattr(slot, att, isnull);
}

/* reading (read.c) */
extern Datum idem_store_required_column(IdemStore *store, int t, TupleTableSlot *slot,
										IdemColumn c);
extern bool idem_store_fetch_in(IdemStore *store, int table, const IdemKey *key,
								IdemRecord *rec);
extern void idem_store_note_claim(IdemStore *store, const IdemKey *key, int64 token,
								  ItemPointer tid);

extern void idem_store_close(IdemStore *store, bool release);
extern void idem_store_note_hidden(IdemStore *store);
extern bool idem_store_peek(IdemStore *store, const IdemKey *key,
							IdemRecord *rec);
extern bool idem_store_fetch(IdemStore *store, const IdemKey *key,
							 IdemRecord *rec);
extern bool idem_store_fetch_claim(IdemStore *store, const IdemKey *key,
								   int64 token, IdemRecord *rec);
extern void idem_store_insert(IdemStore *store, const IdemKey *key,
							  const IdemRecord *rec);
extern bool idem_store_moves(const IdemStore *store, const IdemRecord *rec,
							 bool durable);
extern TM_Result idem_store_update(IdemStore *store, const IdemKey *key,
								   const IdemRecord *rec);
extern TM_Result idem_store_delete(IdemStore *store, const IdemKey *key,
								   const IdemRecord *rec);
typedef void (*IdemRecordCallback) (void *arg, text *operation, bool pending,
									TimestampTz expires_at,
									TimestampTz forget_at);
extern void idem_store_scan_role(IdemStore *store, Oid role,
								 IdemRecordCallback fn, void *arg);
/* writing (write.c) */
extern int64 idem_store_move_batch(IdemStore *store, int from, bool all,
								   int64 max_rows);

/* ---- fencing tokens (tokens.c) ---- */

extern int64 idem_next_token(IdemStore *store);
extern int64 idem_next_token_above(IdemStore *store, int64 floor);

/* ---- counters (counters.c) ---- */

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
	IDEM_NUM_COUNTERS
} IdemCounter;

extern void idem_counters_init(void);
extern void idem_count(IdemCounter counter, int64 n);

/* ---- locks and waiting (locks.c) ---- */

extern void idem_lock_key(const IdemKey *key);
extern bool idem_try_lock_key(const IdemKey *key);
extern void idem_lock_key_until_commit(const IdemKey *key);
extern void idem_lock_switch(bool session);
extern void idem_unlock_switch(void);
extern void idem_unlock_key(const IdemKey *key);
extern void idem_wait_for_xact(TransactionId xid);
extern int64 idem_session_holder(void);
extern bool idem_session_alive(int64 holder);
extern void idem_wait_for_wakeup(const IdemKey *key, int64 holder,
								 TimestampTz until,
								 TimestampTz lock_deadline,
								 const Oid *relids, int nrelids);
extern void idem_wake_waiters(const IdemKey *key);

#endif							/* IDEMPOTENCY_H */
