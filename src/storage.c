/*-------------------------------------------------------------------------
 *
 * storage.c
 *	  Access to the record tables: looking records up, and writing them
 *	  through the executor.
 *
 * Claims are in idem_record.  A completed record is there too, except in
 * durability mode 'completed' (admin.c), where a finish moves it to
 * idem_result.  A look-up searches both, whatever the mode; a write puts a
 * version where the mode keeps it.
 *
 * Reads go straight to the primary key index with a dirty snapshot, which
 * SQL cannot do: it shows the newest version of a record even while another
 * transaction is inserting or changing it, and which transaction that is,
 * so the caller can wait for it.
 *
 * Writes go through the executor, as logical replication's apply worker
 * writes a table (ExecOpenIndices, ExecSimpleRelationInsert/Update/Delete):
 * every index the catalog marks ready -- one a DBA added, one REINDEX
 * CONCURRENTLY is building -- constraints, and row triggers (pg_repack's
 * log trigger among them) see every write, as they would an INSERT.
 *
 * A rewrite of the table (VACUUM FULL, CLUSTER, SET LOGGED, SET TABLESPACE)
 * moves every row, so a physical location is good only while the table is
 * locked and keeps its file.  Within a call the table stays locked.  The
 * one location kept longer is that of the claim the current transaction
 * inserted last, which its idem_finish usually settles: the transaction
 * holds its lock on the table until it ends, so only the transaction
 * itself can rewrite the table meanwhile, and that gives the table a new
 * file, which the location is checked against.
 *
 * This file knows the table's shape; claim.c decides what to do with a
 * record.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/dependency.h"
#include "catalog/pg_collation_d.h"
#include "catalog/pg_extension_d.h"
#include "catalog/pg_proc_d.h"
#include "commands/trigger.h"
#include "executor/executor.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "nodes/execnodes.h"
#include "nodes/makefuncs.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "idempotency.h"
#include "pg_compat.h"

/* Column numbers of idem_record; see the install script */
#define Anum_role_id		1
#define Anum_operation		2
#define Anum_key			3
#define Anum_token			4
#define Anum_fingerprint	5
#define Anum_ttl			6
#define Anum_created_at		7
#define Anum_completed_at	8
#define Anum_expires_at		9
#define Anum_response		10
#define Natts_record		10

/*
 * The extension's objects, looked up once per backend.  A relcache
 * invalidation of one of them (DROP EXTENSION, ALTER EXTENSION UPDATE)
 * forgets them.  Only OIDs are kept: the primary key index is asked of the
 * table at every open, since REINDEX CONCURRENTLY replaces it.
 */
static Oid	extension_oid = InvalidOid;
static Oid	record_relid = InvalidOid;
static Oid	result_relid = InvalidOid;	/* InvalidOid before version 1.3 */
static Oid	token_seqid = InvalidOid;
static Oid	epoch_seqid = InvalidOid;	/* InvalidOid before version 1.2 */

static void
forget_relids(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == record_relid ||
		relid == result_relid || relid == token_seqid || relid == epoch_seqid)
		extension_oid = record_relid = result_relid = token_seqid =
			epoch_seqid = InvalidOid;
}

void
idem_store_init(void)
{
	CacheRegisterRelcacheCallback(forget_relids, (Datum) 0);
}

/*
 * The relation called name in the extension's schema, if the extension owns
 * it; InvalidOid otherwise.  A name alone proves nothing: whoever may CREATE
 * in that schema can create an object of that name.
 */
static Oid
member_relid(Oid extoid, Oid nsp, const char *name)
{
	Oid			relid = get_relname_relid(name, nsp);

	if (OidIsValid(relid) &&
		getExtensionOfObject(RelationRelationId, relid) != extoid)
		return InvalidOid;
	return relid;
}

Oid
idem_store_member(IdemStore *store, const char *name)
{
	return member_relid(store->extension, get_rel_namespace(store->token_seq),
						name);
}

/*
 * Find the extension's objects beside the calling function, which must be
 * the extension's own (the extension is not relocatable).
 */
static void
lookup_relids(Oid fn_oid)
{
	Oid			extoid = getExtensionOfObject(ProcedureRelationId, fn_oid);
	Oid			nsp = get_func_namespace(fn_oid);
	Oid			relid,
				seqid;

	if (!OidIsValid(extoid))
		elog(ERROR, "idempotency: function %u is not a member of the extension",
			 fn_oid);
	relid = member_relid(extoid, nsp, "idem_record");
	seqid = member_relid(extoid, nsp, "idem_token_seq");
	if (!OidIsValid(relid) || !OidIsValid(seqid))
		elog(ERROR, "idempotency: the extension's record table is missing from schema \"%s\"",
			 get_namespace_name(nsp));

	epoch_seqid = member_relid(extoid, nsp, "idem_token_epoch");
	result_relid = member_relid(extoid, nsp, "idem_result");
	token_seqid = seqid;
	record_relid = relid;
	extension_oid = extoid;
}

Oid
idem_store_relid(Oid fn_oid)
{
	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);
	return record_relid;
}

/* idem_result, or InvalidOid before version 1.3 */
Oid
idem_store_result_relid(Oid fn_oid)
{
	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);
	return result_relid;
}

/* Open one table of the store and its primary key */
static void
open_table(IdemStore *store, int table, Oid relid)
{
	Relation	heap = table_open(relid, store->lockmode);
	Oid			pkey;

	/* an unlogged table has no data on a standby: say so, not "no file" */
	if (heap->rd_rel->relpersistence == RELPERSISTENCE_UNLOGGED &&
		RecoveryInProgress())
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idempotency records cannot be read during recovery"),
				 errdetail("Table \"%s\" is unlogged: it is not replicated to standbys.",
						   RelationGetRelationName(heap)),
				 errhint("Read them on the primary, or make the tables logged there with idem_set_durability('all').")));

	pkey = idem_primary_key_index(heap);
	if (!OidIsValid(pkey))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("table \"%s\" has no primary key",
						RelationGetRelationName(heap)),
				 errhint("Restore its primary key on (role_id, operation, key).")));
	store->heap[table] = heap;
	store->index[table] = index_open(pkey, store->lockmode);
}

/*
 * Open the tables and their primary keys: RowExclusiveLock to write,
 * AccessShareLock to only read (which also works on a standby).
 *
 * idem_result (from version 1.3) is opened and searched in every mode: the
 * durability mode decides only where a write puts a completed record, and
 * a record put there stays findable whatever a DBA does to the tables'
 * persistence by hand.
 */
void
idem_store_open(IdemStore *store, Oid fn_oid, LOCKMODE lockmode)
{
	Oid			relid;
	Oid			resultid;

	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);

	/*
	 * Opening the table processes invalidations, which may reset the cached
	 * OIDs (an ANALYZE of the table does): use copies.
	 */
	relid = record_relid;
	resultid = result_relid;
	store->extension = extension_oid;
	store->token_seq = token_seqid;
	store->epoch_seq = epoch_seqid;
	store->lockmode = lockmode;
	store->fn_oid = fn_oid;

	open_table(store, IDEM_RECORDS, relid);
	store->ntables = OidIsValid(resultid) ? 2 : 1;
	store->result_relid = resultid;
	store->heap[IDEM_RESULTS] = store->index[IDEM_RESULTS] = NULL;

	/*
	 * The persistence of both decides the mode.  Our lock on idem_record
	 * keeps it: a switch takes ACCESS EXCLUSIVE locks on both tables, and
	 * invalidates idem_record, whose lock we took after it.
	 */
	store->split = OidIsValid(resultid) &&
		store->heap[IDEM_RECORDS]->rd_rel->relpersistence == RELPERSISTENCE_UNLOGGED &&
		get_rel_persistence(resultid) == RELPERSISTENCE_PERMANENT;
}

/*
 * idem_result is opened when a call first needs it: a replay in modes
 * 'none' and 'all' finds its record in idem_record and never does.
 */
static void
need_table(IdemStore *store, int table)
{
	Assert(table < store->ntables);
	if (table == IDEM_RESULTS && store->heap[IDEM_RESULTS] == NULL)
		open_table(store, IDEM_RESULTS, store->result_relid);
}

/*
 * Close the tables and their indexes.  release: give the locks back now
 * rather than at the end of the transaction (a lock the transaction held
 * before the open stays held).
 */
void
idem_store_close(IdemStore *store, bool release)
{
	LOCKMODE	mode = release ? store->lockmode : NoLock;

	for (int t = store->ntables - 1; t >= 0; t--)
	{
		if (store->heap[t] == NULL)
			continue;
		index_close(store->index[t], mode);
		table_close(store->heap[t], mode);
	}
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

	rec->token = DatumGetInt64(slot_getattr(slot, Anum_token, &isnull));
	d = slot_getattr(slot, Anum_fingerprint, &isnull);
	rec->fingerprint = isnull ? NULL : DatumGetByteaPCopy(d);
	rec->ttl = *DatumGetIntervalP(slot_getattr(slot, Anum_ttl, &isnull));
	rec->created_at = DatumGetTimestampTz(slot_getattr(slot, Anum_created_at, &isnull));
	d = slot_getattr(slot, Anum_completed_at, &isnull);
	rec->completed_at = isnull ? 0 : DatumGetTimestampTz(d);
	rec->expires_at = DatumGetTimestampTz(slot_getattr(slot, Anum_expires_at, &isnull));
	d = slot_getattr(slot, Anum_response, &isnull);
	rec->response = isnull ? NULL : DatumGetJsonbPCopy(d);
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
static bool
fetch_in(IdemStore *store, int table, const IdemKey *key, IdemRecord *rec)
{
	SnapshotData dirty;
	ScanKeyData skey[3];
	IndexScanDesc scan;
	TupleTableSlot *slot;
	bool		found = false;

	need_table(store, table);
	InitDirtySnapshot(dirty);

	ScanKeyInit(&skey[0], Anum_role_id, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(key->role));
	ScanKeyEntryInitialize(&skey[1], 0, 2, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ,
						   PointerGetDatum(key->operation));
	ScanKeyEntryInitialize(&skey[2], 0, 3, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ,
						   PointerGetDatum(key->key));

	slot = table_slot_create(store->heap[table], NULL);
	scan = idem_index_beginscan(store->heap[table], store->index[table],
								&dirty, 3, 0);
	index_rescan(scan, skey, 3, NULL, 0);

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

bool
idem_store_fetch(IdemStore *store, const IdemKey *key, IdemRecord *rec)
{
	/* where a completed record is most likely: a replay looks once */
	int			first = store->split ? IDEM_RESULTS : IDEM_RECORDS;

	if (fetch_in(store, first, key, rec))
		return true;
	return store->ntables == 2 && fetch_in(store, 1 - first, key, rec);
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

static bool
text_equal(Datum a, const text *b)
{
	text	   *t = DatumGetTextPP(a);

	return VARSIZE_ANY_EXHDR(t) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(t), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(b)) == 0;
}

static bool
slot_matches_key(TupleTableSlot *slot, const IdemKey *key)
{
	bool		isnull;

	return DatumGetObjectId(slot_getattr(slot, Anum_role_id, &isnull)) == key->role &&
		text_equal(slot_getattr(slot, Anum_operation, &isnull), key->operation) &&
		text_equal(slot_getattr(slot, Anum_key, &isnull), key->key);
}

/*
 * Like idem_store_fetch, for the pending claim that token should hold, which
 * can only be in idem_record (a version being moved to idem_result by a
 * concurrent finish is still there, marked by it).  In the
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
			slot_matches_key(slot, key);
		if (found)
			record_from_slot(store, IDEM_RECORDS, slot, &dirty, rec);
		ExecDropSingleTupleTableSlot(slot);
		if (found && rec->token == token)
			return true;
	}
	/* a claim is pending, and a pending record is always in idem_record */
	return fetch_in(store, IDEM_RECORDS, key, rec);
}

/* ---- writes ---- */

/*
 * One write through the executor: the table as the result relation of a
 * one-entry range table, all of its indexes open, AFTER triggers collected
 * for this write and fired when it is done.
 */
typedef struct RecordWrite
{
	EState	   *estate;
	ResultRelInfo *rri;
	EPQState	epq;
	TupleTableSlot *slot;		/* the new version */
	TupleTableSlot *oldslot;	/* the version replaced or deleted */
} RecordWrite;

static void
write_begin(IdemStore *store, int table, RecordWrite *w)
{
	Relation	heap = store->heap[table];
	RangeTblEntry *rte = makeNode(RangeTblEntry);

	Assert(store->lockmode == RowExclusiveLock);

	w->estate = CreateExecutorState();
	rte->rtekind = RTE_RELATION;
	rte->relid = RelationGetRelid(heap);
	rte->relkind = heap->rd_rel->relkind;
	rte->rellockmode = RowExclusiveLock;
	idem_init_range_table(w->estate, rte);

	w->rri = makeNode(ResultRelInfo);
	InitResultRelInfo(w->rri, heap, 1, NULL, 0);
	/* so that AFTER triggers find it, and ExecCloseResultRelations closes it */
	w->estate->es_opened_result_relations =
		lappend(w->estate->es_opened_result_relations, w->rri);
	w->estate->es_output_cid = GetCurrentCommandId(true);
	ExecOpenIndices(w->rri, false);
	idem_epq_init(&w->epq, w->estate);

	w->slot = table_slot_create(heap, &w->estate->es_tupleTable);
	w->oldslot = table_slot_create(heap, &w->estate->es_tupleTable);

	AfterTriggerBeginQuery();
}

/*
 * Fire the AFTER row triggers, release the executor state, and make the
 * write visible to the rest of the statement: a later call in the same
 * SELECT -- idem_finish on a claim idem_begin made in it -- must see it.
 */
static void
write_end(RecordWrite *w)
{
	AfterTriggerEndQuery(w->estate);
	EvalPlanQualEnd(&w->epq);
	/* our indexes, and relations the triggers opened */
	ExecCloseResultRelations(w->estate);
	ExecCloseRangeTableRelations(w->estate);
	ExecResetTupleTable(w->estate->es_tupleTable, false);
	FreeExecutorState(w->estate);
	CommandCounterIncrement();
}

static void
fill_slot(TupleTableSlot *slot, const IdemKey *key, const IdemRecord *rec)
{
	Datum	   *values = slot->tts_values;
	bool	   *nulls = slot->tts_isnull;

	Assert(slot->tts_tupleDescriptor->natts == Natts_record);

	ExecClearTuple(slot);
	memset(nulls, false, Natts_record * sizeof(bool));
	values[Anum_role_id - 1] = ObjectIdGetDatum(key->role);
	values[Anum_operation - 1] = PointerGetDatum(key->operation);
	values[Anum_key - 1] = PointerGetDatum(key->key);
	values[Anum_token - 1] = Int64GetDatum(rec->token);
	values[Anum_fingerprint - 1] = PointerGetDatum(rec->fingerprint);
	nulls[Anum_fingerprint - 1] = (rec->fingerprint == NULL);
	values[Anum_ttl - 1] = IntervalPGetDatum(&rec->ttl);
	values[Anum_created_at - 1] = TimestampTzGetDatum(rec->created_at);
	values[Anum_completed_at - 1] = TimestampTzGetDatum(rec->completed_at);
	nulls[Anum_completed_at - 1] = (rec->response == NULL);
	values[Anum_expires_at - 1] = TimestampTzGetDatum(rec->expires_at);
	values[Anum_response - 1] = JsonbPGetDatum(rec->response);
	nulls[Anum_response - 1] = (rec->response == NULL);
	ExecStoreVirtualTuple(slot);
}

void
idem_store_insert(IdemStore *store, const IdemKey *key, const IdemRecord *rec)
{
	RecordWrite w;

	Assert(IdemRecordIsPending(rec));

	write_begin(store, IDEM_RECORDS, &w);
	fill_slot(w.slot, key, rec);
	ExecSimpleRelationInsert(w.rri, w.estate, w.slot);

	last_claim.xid = GetCurrentTransactionId();
	last_claim.relid = RelationGetRelid(store->heap[IDEM_RECORDS]);
	last_claim.relfilenumber = idem_relfilenumber(store->heap[IDEM_RECORDS]);
	last_claim.role = key->role;
	last_claim.token = rec->token;
	last_claim.tid = w.slot->tts_tid;

	write_end(&w);
}

/*
 * Lock the version rec->tid for an update or delete, waiting for a
 * concurrent writer (idem_purge, say).  TM_Ok: it is ours to change;
 * otherwise it was changed or deleted meanwhile and the caller looks again.
 * A version our own transaction wrote needs no lock: nobody else can
 * change it before we commit.
 */
static TM_Result
lock_version(IdemStore *store, const IdemRecord *rec, RecordWrite *w)
{
	TM_FailureData tmfd;
	TM_Result	result;
	ItemPointerData tid = rec->tid;

	if (rec->mine)
	{
		if (!table_tuple_fetch_row_version(store->heap[rec->table], &tid, SnapshotAny,
										   w->oldslot))
			elog(ERROR, "idempotency: record version (%u,%u) not found",
				 ItemPointerGetBlockNumber(&tid),
				 ItemPointerGetOffsetNumber(&tid));
		return TM_Ok;
	}

	result = table_tuple_lock(store->heap[rec->table], &tid, GetActiveSnapshot(),
							  w->oldslot, GetCurrentCommandId(false),
							  LockTupleExclusive, LockWaitBlock, 0, &tmfd);
	if (result == TM_Invisible || result == TM_SelfModified)
		elog(ERROR, "idempotency: record version not lockable (%d)", result);
	return result;
}

/*
 * Replace the version rec->tid (in table rec->table) with rec's values.
 * A completed record goes to idem_result when the durability mode is
 * 'completed', anything else to idem_record: when that is the other table,
 * the version is deleted there and the new one inserted here, in this
 * transaction.  Anything but TM_Ok means the version was changed or
 * deleted by a concurrent writer and nothing was written.
 */
TM_Result
idem_store_update(IdemStore *store, const IdemKey *key, const IdemRecord *rec)
{
	int			to = (store->split && !IdemRecordIsPending(rec)) ?
		IDEM_RESULTS : IDEM_RECORDS;
	RecordWrite w;
	TM_Result	result;

	Assert(rec->table < store->ntables);

	write_begin(store, rec->table, &w);
	result = lock_version(store, rec, &w);
	if (result == TM_Ok && to == rec->table)
	{
		fill_slot(w.slot, key, rec);
		ExecSimpleRelationUpdate(w.rri, w.estate, &w.epq, w.oldslot, w.slot);
	}
	else if (result == TM_Ok)
		ExecSimpleRelationDelete(w.rri, w.estate, &w.epq, w.oldslot);
	write_end(&w);

	if (result == TM_Ok && to != rec->table)
	{
		need_table(store, to);
		write_begin(store, to, &w);
		fill_slot(w.slot, key, rec);
		ExecSimpleRelationInsert(w.rri, w.estate, w.slot);
		write_end(&w);
	}
	return result;
}

TM_Result
idem_store_delete(IdemStore *store, const IdemRecord *rec)
{
	RecordWrite w;
	TM_Result	result;

	write_begin(store, rec->table, &w);
	result = lock_version(store, rec, &w);
	if (result == TM_Ok)
		ExecSimpleRelationDelete(w.rri, w.estate, &w.epq, w.oldslot);
	write_end(&w);
	return result;
}

/* An index scan of one role's records in one table */
typedef struct RoleScan
{
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
record_cmp(TupleTableSlot *a, TupleTableSlot *b)
{
	for (AttrNumber att = Anum_operation; att <= Anum_key; att++)
	{
		bool		isnull;
		text	   *ta = DatumGetTextPP(slot_getattr(a, att, &isnull));
		text	   *tb = DatumGetTextPP(slot_getattr(b, att, &isnull));
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
 * Call fn for every committed record of one role, in (operation, key)
 * order, as the active snapshot sees them: the two tables' primary keys
 * are read side by side and merged.  For statistics: nothing here waits or
 * locks, and responses are not read.
 */
void
idem_store_scan_role(IdemStore *store, Oid role, IdemRecordCallback fn, void *arg)
{
	ScanKeyData skey[1];
	RoleScan	rs[IDEM_NUM_TABLES];

	ScanKeyInit(&skey[0], Anum_role_id, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(role));
	for (int t = 0; t < store->ntables; t++)
	{
		need_table(store, t);
		rs[t].slot = table_slot_create(store->heap[t], NULL);
		rs[t].scan = idem_index_beginscan(store->heap[t], store->index[t],
										  GetActiveSnapshot(), 1, 0);
		index_rescan(rs[t].scan, skey, 1, NULL, 0);
		role_scan_next(&rs[t]);
	}

	for (;;)
	{
		RoleScan   *next = NULL;
		bool		isnull;
		bool		pending;
		TimestampTz expires_at;
		text	   *operation;

		for (int t = 0; t < store->ntables; t++)
			if (rs[t].valid &&
				(next == NULL || record_cmp(rs[t].slot, next->slot) < 0))
				next = &rs[t];
		if (next == NULL)
			break;

		operation = DatumGetTextPP(slot_getattr(next->slot, Anum_operation, &isnull));
		(void) slot_getattr(next->slot, Anum_completed_at, &pending);
		expires_at = DatumGetTimestampTz(slot_getattr(next->slot, Anum_expires_at, &isnull));
		fn(arg, operation, pending, expires_at);
		role_scan_next(next);
	}

	for (int t = 0; t < store->ntables; t++)
	{
		index_endscan(rs[t].scan);
		ExecDropSingleTupleTableSlot(rs[t].slot);
	}
}
