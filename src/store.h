/*-------------------------------------------------------------------------
 *
 * store.h
 *	  The record tables, their records, and the store of open tables;
 *	  opening and closing them (store.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_STORE_H
#define IDEM_STORE_H

#include "executor/tuptable.h"
#include "storage/itemptr.h"
#include "storage/lockdefs.h"
#include "utils/jsonb.h"
#include "utils/relcache.h"
#include "catalog.h"
#include "idempotency.h"

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
 * columns of their own.  A schema without session claims, checkpoints and
 * remembering has the first IDEM_NUM_BASE_COLUMNS only.
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

#define IDEM_NUM_BASE_COLUMNS	(IDEM_COL_RESPONSE + 1)

/* Where each column is in one table (InvalidAttrNumber: absent) */
typedef struct IdemShape
{
	AttrNumber	attnum[IDEM_NUM_COLUMNS];
	bool		exact;			/* every column is ours, nothing dropped */
	bool		has_claim_columns;	/* holder, checkpoint, takeovers and
									 * forget_at are there */
	bool		role_by_name;	/* role_id is a name, not the role's OID */
	Oid			pkey;			/* primary key on (role_id, operation, key) */

	/*
	 * Records colocated with a tenant's table (docs/scaling-out.md): their
	 * "tenant" column, the last of the primary key, of the tenant's type
	 */
	AttrNumber	tenant;			/* InvalidAttrNumber: none */
	Oid			tenant_type;
	Oid			tenant_collation;
	int16		tenant_typlen;
	bool		tenant_byval;
	RegProcedure tenant_eq;		/* the primary key's equality of the type */
} IdemShape;

/* The tables and their primary key indexes, open for one call */
typedef struct IdemStore
{
	Relation	heap[IDEM_NUM_TABLES];
	Relation	index[IDEM_NUM_TABLES];	/* each table's primary key */
	IdemShape	shape[IDEM_NUM_TABLES];	/* each table's columns */
	bool		hidden[IDEM_NUM_TABLES];	/* unlogged, during recovery */
	int			ntables;		/* 1 in a schema without idem_result */
	Oid			result_relid;	/* idem_result; its heap[] is NULL until used */
	bool		split;			/* mode 'completed': results to idem_result */
	LOCKMODE	lockmode;		/* of all of them */
	Oid			fn_oid;			/* the SQL function that opened them */
	Oid			extension;		/* the extension that owns them */
	Oid			token_seq;		/* idem_token_seq: the count */
	Oid			epoch_seq;		/* idem_token_epoch; InvalidOid without one */
	bool		distributed;	/* Citus shards of distributed records */
	Oid			shell;			/* ... whose tables' shell is locked too */
	int64		shard;			/* ... and the Citus shard whose metadata lock
								 * the opening took (0: none) */
	const IdemKey *key;		/* the key they were opened for, or NULL */
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
extern void idem_store_open(IdemStore *store, Oid fn_oid, LOCKMODE lockmode,
							const IdemKey *key);
extern void idem_store_reopen(IdemStore *store);
extern List *idem_store_parts(Oid fn_oid, bool refuse_worker);
extern void idem_store_open_part(IdemStore *store, Oid fn_oid, LOCKMODE lockmode,
								 const IdemObjects *part);
extern void idem_store_need_heap(IdemStore *store, int table);
extern void idem_store_need_table(IdemStore *store, int table);
extern IdemDurability idem_tables_mode(char records, char results);
extern void idem_store_find_epoch_seq(IdemStore *store);

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

extern void idem_store_close(IdemStore *store, bool release);
extern void idem_store_note_hidden(IdemStore *store);

#endif							/* IDEM_STORE_H */
