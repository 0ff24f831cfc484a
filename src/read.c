/*-------------------------------------------------------------------------
 *
 * read.c
 *	  Reading records: a row decoded, a record looked up by key or by
 *	  token, and one role's records in key order.
 *
 * Reads go straight to the primary key index with a dirty snapshot, which
 * SQL cannot do: it shows the newest version of a record even while another
 * transaction is inserting or changing it, and which transaction that is,
 * so the caller can wait for it.  A look-up searches both tables, whatever
 * the mode.
 *
 * A rewrite of the table (VACUUM FULL, CLUSTER, SET LOGGED, SET TABLESPACE)
 * moves every row, so a physical location is good only while the table is
 * locked and keeps its file.  Within a call the table stays locked.  The
 * one location kept longer is that of the claim the current transaction
 * inserted last, which its idem_finish usually settles: the transaction
 * holds its lock on the table until it ends, so only the transaction
 * itself can rewrite the table meanwhile, and that gives the table a new
 * file, which the location is checked against.
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/dependency.h"
#include "catalog/indexing.h"
#include "catalog/pg_am_d.h"
#include "catalog/pg_class.h"
#include "catalog/pg_collation_d.h"
#include "catalog/pg_depend.h"
#include "catalog/pg_extension_d.h"
#include "catalog/pg_proc_d.h"
#include "catalog/pg_type_d.h"
#include "commands/trigger.h"
#include "executor/executor.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "nodes/execnodes.h"
#include "nodes/makefuncs.h"
#include "parser/parse_func.h"
#include "rewrite/rewriteHandler.h"
#include "storage/bufmgr.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "idempotency.h"
#include "read.h"
#include "shape.h"
#include "store.h"
#include "write.h"
#include "pg_compat.h"

/* A column that must not be NULL: a row written by hand may have one */
Datum
idem_store_required_column(IdemStore *store, int t, TupleTableSlot *slot, IdemColumn c)
{
	bool		isnull;
	Datum		d = idem_store_column(store, t, slot, c, &isnull);

	if (isnull)
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("idempotency record in table \"%s\" has a NULL \"%s\"",
						RelationGetRelationName(store->heap[t]), idem_shape_column_name(c)),
				 errdetail("The record of key \"%s\" was not written by the idem_* functions.",
						   TextDatumGetCString(idem_store_required_column(store, t, slot, IDEM_COL_KEY)))));
	return d;
}

/*
 * Fill *rec from a version the dirty snapshot accepted, and say who is
 * working on it (see idem_store_fetch).
 */
static void
record_from_slot(IdemStore *store, int table, TupleTableSlot *slot,
				 Snapshot dirty, IdemRecord *rec)
{
	HeapTuple	tuple = ExecFetchSlotHeapTuple(slot, false, NULL);
	TransactionId xmin = HeapTupleHeaderGetXmin(tuple->t_data);
	bool		isnull;
	Datum		d;

	rec->table = table;
	rec->tid = slot->tts_tid;
	rec->uncommitted = TransactionIdIsValid(dirty->xmin);
	rec->busy_xid = rec->uncommitted ? dirty->xmin : dirty->xmax;
	rec->mine = TransactionIdIsCurrentTransactionId(xmin);
	rec->in_snapshot = !IsolationUsesXactSnapshot() || rec->mine ||
		table_tuple_satisfies_snapshot(store->heap[table], slot, GetActiveSnapshot());

	rec->token = DatumGetInt64(idem_store_required_column(store, table, slot, IDEM_COL_TOKEN));
	d = idem_store_column(store, table, slot, IDEM_COL_FINGERPRINT, &isnull);
	rec->fingerprint = isnull ? NULL : DatumGetByteaPCopy(d);
	rec->ttl = *DatumGetIntervalP(idem_store_required_column(store, table, slot, IDEM_COL_TTL));
	rec->created_at = DatumGetTimestampTz(idem_store_required_column(store, table, slot, IDEM_COL_CREATED_AT));
	d = idem_store_column(store, table, slot, IDEM_COL_COMPLETED_AT, &isnull);
	rec->completed_at = isnull ? 0 : DatumGetTimestampTz(d);
	rec->expires_at = DatumGetTimestampTz(idem_store_required_column(store, table, slot, IDEM_COL_EXPIRES_AT));
	d = idem_store_column(store, table, slot, IDEM_COL_RESPONSE, &isnull);
	rec->response = isnull ? NULL : DatumGetJsonbPCopy(d);
	if (rec->completed_at == 0 && rec->response != NULL)
		rec->response = NULL;	/* a pending record has no response */

	d = idem_store_column(store, table, slot, IDEM_COL_HOLDER, &isnull);
	rec->holder = isnull ? 0 : DatumGetInt64(d);
	d = idem_store_column(store, table, slot, IDEM_COL_CHECKPOINT, &isnull);
	rec->checkpoint = isnull ? NULL : DatumGetJsonbPCopy(d);
	d = idem_store_column(store, table, slot, IDEM_COL_TAKEOVERS, &isnull);
	rec->takeovers = isnull ? 0 : DatumGetInt32(d);
	d = idem_store_column(store, table, slot, IDEM_COL_FORGET_AT, &isnull);
	rec->forget_at = isnull ? 0 : DatumGetTimestampTz(d);
}

/*
 * Look a key up.  Returns false when no record exists (or only versions
 * that are dead to everyone).  Otherwise fills *rec with the newest version
 * and with who is working on it:
 *
 *	busy_xid	another transaction that inserted this version and has not
 *				finished, or is deleting or updating it right now; the
 *				caller must wait for it before trusting the record
 *	uncommitted	busy_xid is the transaction that inserted this version
 *	mine		this version was written by our own transaction
 *	in_snapshot	the version is visible to our transaction snapshot (only
 *				computed under REPEATABLE READ and SERIALIZABLE)
 */
/*
 * A role as table t's role_id holds it: the role's OID, or on distributed
 * records its name (a role's OID differs from node to node).  The name of
 * a role dropped since reads as its OID's digits, which no role can have.
 */
Datum
idem_store_role_datum(IdemStore *store, int t, Oid role)
{
	NameData   *name;
	char	   *rolname;

	if (!store->shape[t].role_by_name)
		return ObjectIdGetDatum(role);
	rolname = GetUserNameFromId(role, true);
	name = (NameData *) palloc0(sizeof(NameData));
	namestrcpy(name, rolname != NULL ? rolname : psprintf("%u", role));
	return NameGetDatum(name);
}

/* Does value, table t's role_id, name role? */
bool
idem_store_role_equal(IdemStore *store, int t, Datum value, Oid role)
{
	if (!store->shape[t].role_by_name)
		return DatumGetObjectId(value) == role;
	return strncmp(NameStr(*DatumGetName(value)),
				   NameStr(*DatumGetName(idem_store_role_datum(store, t, role))),
				   NAMEDATALEN) == 0;
}

/* The scan key on role_id, attribute 1 of the primary key, for role */
static void
init_role_key(IdemStore *store, int table, ScanKey skey, Oid role)
{
	if (store->shape[table].role_by_name)
		ScanKeyEntryInitialize(skey, 0, 1, BTEqualStrategyNumber, InvalidOid,
							   C_COLLATION_OID, F_NAMEEQ,
							   idem_store_role_datum(store, table, role));
	else
		ScanKeyInit(skey, 1, BTEqualStrategyNumber, F_OIDEQ, ObjectIdGetDatum(role));
}

bool
idem_store_fetch_in(IdemStore *store, int table, const IdemKey *key, IdemRecord *rec)
{
	SnapshotData dirty;
	ScanKeyData skey[4];
	int			nkeys = 3;
	IndexScanDesc scan;
	TupleTableSlot *slot;
	bool		found = false;

	idem_store_need_table(store, table);
	if (store->heap[table] == NULL)
		return false;			/* hidden during recovery */
	InitDirtySnapshot(dirty);

	init_role_key(store, table, &skey[0], key->role);
	ScanKeyEntryInitialize(&skey[1], 0, 2, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ,
						   PointerGetDatum(key->operation));
	ScanKeyEntryInitialize(&skey[2], 0, 3, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ,
						   PointerGetDatum(key->key));
	if (key->has_tenant)
	{
		const IdemShape *shape = &store->shape[table];

		Assert(shape->tenant != InvalidAttrNumber);
		ScanKeyEntryInitialize(&skey[nkeys++], 0, 4, BTEqualStrategyNumber,
							   InvalidOid, shape->tenant_collation,
							   shape->tenant_eq, key->tenant);
	}

	slot = table_slot_create(store->heap[table], NULL);
	scan = idem_index_beginscan(store->heap[table], store->index[table],
								&dirty, nkeys, 0);
	index_rescan(scan, skey, nkeys, NULL, 0);

	/*
	 * At most one version of a key is live at a time, in either table (all
	 * writers hold the key lock, and a move between the tables deletes and
	 * inserts in one transaction), so the first tuple the dirty snapshot
	 * accepts is the one.
	 */
	found = index_getnext_slot(scan, ForwardScanDirection, slot);
	if (found)
		record_from_slot(store, table, slot, &dirty, rec);

	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);

	return found;
}

/*
 * A look-up without the key lock, which another call holds: in the one
 * table where a completed record most likely is, for a replay.  It may
 * miss a record, one in the other table or one moved between the tables
 * meanwhile; the caller then looks again with idem_store_fetch, under the
 * key lock.
 */
bool
idem_store_peek(IdemStore *store, const IdemKey *key, IdemRecord *rec)
{
	return idem_store_fetch_in(store, store->split ? IDEM_RESULTS : IDEM_RECORDS, key, rec);
}

/*
 * Can idem_result hold a record?  In mode 'completed' it is where they
 * go.  In the other modes the functions do not write it, and it holds
 * records only after a mode switch or a restore put some there: a table
 * that never had a row has no blocks, which costs one look at its size
 * instead of an index descent.
 */
static bool
results_possible(IdemStore *store)
{
	if (store->ntables < 2)
		return false;
	if (store->split)
		return true;
	/* the size first: an empty table's index need not be opened */
	idem_store_need_heap(store, IDEM_RESULTS);
	return store->heap[IDEM_RESULTS] != NULL &&
		RelationGetNumberOfBlocks(store->heap[IDEM_RESULTS]) > 0;
}

/*
 * The look-up that decides, made holding the key lock: where a completed
 * record most likely is first (idem_result in mode 'completed'), then the
 * other table.  Every write that moves a record between the tables holds
 * the key lock too (a finish or checkpoint in mode 'completed', an online
 * mode switch; idem_set_durability and a restore's settling lock the
 * tables whole), so no move commits between this look's two reads: a
 * record that exists is found in exactly one of the two places, in every
 * interleaving.  A move still in progress is found marked by the mover,
 * whom the caller waits for.
 */
bool
idem_store_fetch(IdemStore *store, const IdemKey *key, IdemRecord *rec)
{
	if (store->split)
		return idem_store_fetch_in(store, IDEM_RESULTS, key, rec) ||
			idem_store_fetch_in(store, IDEM_RECORDS, key, rec);
	if (idem_store_fetch_in(store, IDEM_RECORDS, key, rec))
		return true;
	return results_possible(store) && idem_store_fetch_in(store, IDEM_RESULTS, key, rec);
}

/*
 * The claim this transaction inserted last (see idem_store_fetch_claim):
 * where, in which file of the table, by which transaction.
 */
static struct
{
	TransactionId xid;
	Oid			relid;
	Oid			relfilenumber;
	Oid			role;
	int64		token;
	ItemPointerData tid;
}			last_claim;

/* The claim this transaction has just inserted (idem_store_insert) */
void
idem_store_note_claim(IdemStore *store, const IdemKey *key, int64 token,
					  ItemPointer tid)
{
	last_claim.xid = GetCurrentTransactionId();
	last_claim.relid = RelationGetRelid(store->heap[IDEM_RECORDS]);
	last_claim.relfilenumber = idem_relfilenumber(store->heap[IDEM_RECORDS]);
	last_claim.role = key->role;
	last_claim.token = token;
	last_claim.tid = *tid;
}

static bool
text_equal(Datum a, const text *b)
{
	text	   *t = DatumGetTextPP(a);

	return VARSIZE_ANY_EXHDR(t) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(t), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(b)) == 0;
}

static bool
slot_matches_key(IdemStore *store, int t, TupleTableSlot *slot,
				 const IdemKey *key)
{
	bool		isnull;

	Datum		role = idem_store_column(store, t, slot, IDEM_COL_ROLE_ID, &isnull);

	if (isnull || !idem_store_role_equal(store, t, role, key->role) ||
		!text_equal(idem_store_required_column(store, t, slot, IDEM_COL_OPERATION), key->operation) ||
		!text_equal(idem_store_required_column(store, t, slot, IDEM_COL_KEY), key->key))
		return false;
	if (key->has_tenant)
	{
		const IdemShape *shape = &store->shape[t];
		Datum		tenant = slot_getattr(slot, shape->tenant, &isnull);

		/* the same datum: equal (an equal one in another form falls back to the index) */
		return !isnull && datumIsEqual(tenant, key->tenant, shape->tenant_byval,
									   shape->tenant_typlen);
	}
	return true;
}

/*
 * Like idem_store_fetch, for the pending claim that token should hold.  In the
 * in-transaction shape the claim to settle is the one this transaction
 * inserted last: it is read straight from where it was inserted, without
 * descending the index, if the table still has the file it was inserted
 * into.  Any doubt -- another transaction, another file, the version was
 * updated since, the place holds another row -- falls back to the index.
 */
bool
idem_store_fetch_claim(IdemStore *store, const IdemKey *key, int64 token,
					   IdemRecord *rec)
{
	if (token == last_claim.token && key->role == last_claim.role &&
		TransactionIdIsValid(last_claim.xid) &&
		last_claim.xid == GetCurrentTransactionIdIfAny() &&
		RelationGetRelid(store->heap[IDEM_RECORDS]) == last_claim.relid &&
		idem_relfilenumber(store->heap[IDEM_RECORDS]) == last_claim.relfilenumber)
	{
		SnapshotData dirty;
		Relation	heap = store->heap[IDEM_RECORDS];
		TupleTableSlot *slot = table_slot_create(heap, NULL);
		bool		found;

		InitDirtySnapshot(dirty);
		found = table_tuple_fetch_row_version(heap, &last_claim.tid,
											  &dirty, slot) &&
			slot_matches_key(store, IDEM_RECORDS, slot, key);
		if (found)
			record_from_slot(store, IDEM_RECORDS, slot, &dirty, rec);
		ExecDropSingleTupleTableSlot(slot);
		if (found && rec->token == token)
			return true;
	}
	return idem_store_fetch(store, key, rec);
}

/* An index scan of one role's records in one table */
typedef struct RoleScan
{
	int			table;
	IndexScanDesc scan;
	TupleTableSlot *slot;
	bool		valid;			/* slot holds the next record */
} RoleScan;

static void
role_scan_next(RoleScan *rs)
{
	rs->valid = index_getnext_slot(rs->scan, ForwardScanDirection, rs->slot);
}

/* C-collation order of (operation, key) of two records */
static int
record_cmp(IdemStore *store, RoleScan *a, RoleScan *b)
{
	for (IdemColumn c = IDEM_COL_OPERATION; c <= IDEM_COL_KEY; c++)
	{
		text	   *ta = DatumGetTextPP(idem_store_required_column(store, a->table, a->slot, c));
		text	   *tb = DatumGetTextPP(idem_store_required_column(store, b->table, b->slot, c));
		int			la = VARSIZE_ANY_EXHDR(ta);
		int			lb = VARSIZE_ANY_EXHDR(tb);
		int			c = memcmp(VARDATA_ANY(ta), VARDATA_ANY(tb), Min(la, lb));

		if (c != 0)
			return c;
		if (la != lb)
			return la < lb ? -1 : 1;
	}
	return 0;
}

/*
 * What a record's state needs (idem_record_state), from a version the
 * active snapshot sees: committed, or written by our transaction
 */
static void
record_times_from_slot(IdemStore *store, int t, TupleTableSlot *slot,
					   IdemRecord *rec)
{
	bool		isnull;
	Datum		d;
	HeapTuple	tuple = ExecFetchSlotHeapTuple(slot, false, NULL);

	memset(rec, 0, sizeof(*rec));
	rec->table = t;
	rec->busy_xid = InvalidTransactionId;
	rec->mine = TransactionIdIsCurrentTransactionId(HeapTupleHeaderGetXmin(tuple->t_data));
	d = idem_store_column(store, t, slot, IDEM_COL_COMPLETED_AT, &isnull);
	rec->completed_at = isnull ? 0 : DatumGetTimestampTz(d);
	rec->expires_at = DatumGetTimestampTz(idem_store_required_column(store, t, slot, IDEM_COL_EXPIRES_AT));
	d = idem_store_column(store, t, slot, IDEM_COL_FORGET_AT, &isnull);
	rec->forget_at = isnull ? 0 : DatumGetTimestampTz(d);
	d = idem_store_column(store, t, slot, IDEM_COL_HOLDER, &isnull);
	rec->holder = isnull ? 0 : DatumGetInt64(d);
}

/*
 * Call fn for every committed record of one role, in (operation, key)
 * order, as the active snapshot sees them: the two tables' primary keys
 * are read side by side and merged.  fn gets each record's operation,
 * and the record with what its state needs (idem_record_state):
 * completed_at, expires_at, forget_at, holder and whether our transaction
 * wrote it.  For statistics: nothing here waits or locks, and responses
 * are not read.
 */
void
idem_store_scan_role(IdemStore *store, Oid role, IdemRecordCallback fn, void *arg)
{
	ScanKeyData skey[1];
	RoleScan	rs[IDEM_NUM_TABLES];

	for (int t = 0; t < store->ntables; t++)
	{
		idem_store_need_table(store, t);
		rs[t].table = t;
		rs[t].valid = false;
		rs[t].scan = NULL;
		if (store->heap[t] == NULL)
			continue;			/* hidden during recovery */
		rs[t].slot = table_slot_create(store->heap[t], NULL);
		init_role_key(store, t, &skey[0], role);
		rs[t].scan = idem_index_beginscan(store->heap[t], store->index[t],
										  GetActiveSnapshot(), 1, 0);
		index_rescan(rs[t].scan, skey, 1, NULL, 0);
		role_scan_next(&rs[t]);
	}

	for (;;)
	{
		RoleScan   *next = NULL;
		IdemRecord	rec;
		text	   *operation;

		for (int t = 0; t < store->ntables; t++)
			if (rs[t].valid &&
				(next == NULL || record_cmp(store, &rs[t], next) < 0))
				next = &rs[t];
		if (next == NULL)
			break;

		operation = DatumGetTextPP(idem_store_required_column(store, next->table, next->slot, IDEM_COL_OPERATION));
		record_times_from_slot(store, next->table, next->slot, &rec);
		fn(arg, operation, &rec);
		role_scan_next(next);
	}

	for (int t = 0; t < store->ntables; t++)
	{
		if (rs[t].scan == NULL)
			continue;
		index_endscan(rs[t].scan);
		ExecDropSingleTupleTableSlot(rs[t].slot);
	}
}
