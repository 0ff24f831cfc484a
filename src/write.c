/*-------------------------------------------------------------------------
 *
 * write.c
 *	  Writing records: inserts, updates, deletes and moves between the
 *	  tables, through the executor, each one verified.
 *
 * Writes go through the executor, as logical replication's apply worker
 * writes a table (ExecOpenIndices, ExecSimpleRelationInsert/Update/Delete):
 * every index the catalog marks ready -- one a DBA added, one REINDEX
 * CONCURRENTLY is building -- constraints, and row triggers (pg_repack's
 * log trigger among them) see every write, as they would an INSERT, and
 * each write is verified: a trigger that skips or changes it is an error,
 * never a record reported but not written.  Each write builds its executor
 * state and frees it, in the caller's memory context and resource owner,
 * so an error part-way leaves nothing behind that the abort does not
 * release; the trigger machinery (trigger slots, the AFTER trigger queue,
 * the EvalPlanQual state) is set up only when the table has row triggers.
 *
 * A write puts a version where the durability mode keeps it; every move of
 * a record between the tables -- a finish in mode 'completed', a switch, a
 * restore's settling -- is a delete and an insert made here.
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
#include "catalog/pg_trigger.h"
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

#include "args.h"
#include "idempotency.h"
#include "locks.h"
#include "read.h"
#include "store.h"
#include "write.h"
#include "pg_compat.h"

/* The executor state of one write */
typedef struct IdemWriter
{
	Relation	heap;			/* the table written */
	EState	   *estate;
	ResultRelInfo *rri;			/* the table, with all its indexes open */
	EPQState	epq;			/* set up only with row triggers */
	TupleTableSlot *slot;		/* the new version */
	TupleTableSlot *oldslot;	/* the version replaced or deleted */
	ExprState **defaults;		/* per column, prepared when first needed */
	bool		row_triggers;	/* the table has row triggers */
} IdemWriter;

/*
 * Does the table have row triggers, the only ones a write of a single row
 * fires (ExecSimpleRelationInsert/Update/Delete)?  Statement triggers --
 * the extension's own idem_settle among them -- fire for statements only.
 */
static bool
has_row_triggers(TriggerDesc *td)
{
	return td != NULL &&
		(td->trig_insert_before_row || td->trig_insert_after_row ||
		 td->trig_insert_instead_row ||
		 td->trig_update_before_row || td->trig_update_after_row ||
		 td->trig_update_instead_row ||
		 td->trig_delete_before_row || td->trig_delete_after_row ||
		 td->trig_delete_instead_row);
}

/*
 * The executor state to write heap (locked by the caller in
 * RowExclusiveLock or stronger), with es_output_cid set for this write and,
 * for a table with row triggers, the AFTER trigger queue opened.  Every
 * writer_begin is paired with a writer_end.
 */
static IdemWriter *
writer_begin(Relation heap)
{
	IdemWriter *w = palloc0(sizeof(IdemWriter));
	RangeTblEntry *rte;
	MemoryContext save_cxt;

	w->heap = heap;
	w->estate = CreateExecutorState();
	save_cxt = MemoryContextSwitchTo(w->estate->es_query_cxt);

	rte = makeNode(RangeTblEntry);
	rte->rtekind = RTE_RELATION;
	rte->relid = RelationGetRelid(heap);
	rte->relkind = heap->rd_rel->relkind;
	rte->rellockmode = RowExclusiveLock;
	idem_init_range_table(w->estate, rte);

	w->rri = makeNode(ResultRelInfo);
	InitResultRelInfo(w->rri, heap, 1, NULL, 0);
	/* so that AFTER triggers find it */
	w->estate->es_opened_result_relations =
		lappend(w->estate->es_opened_result_relations, w->rri);
	ExecOpenIndices(w->rri, false);

	w->slot = table_slot_create(heap, &w->estate->es_tupleTable);
	w->oldslot = table_slot_create(heap, &w->estate->es_tupleTable);
	w->defaults = palloc0(RelationGetDescr(heap)->natts * sizeof(ExprState *));
	w->row_triggers = has_row_triggers(w->rri->ri_TrigDesc);
	if (w->row_triggers)
	{
		idem_epq_init(&w->epq, w->estate);

		/*
		 * The row trigger functions' call information, which the executor
		 * fills in at a trigger's first call in whatever memory context is
		 * current then, is filled in here in the state's, as a query's
		 * executor would have it: a SECURITY DEFINER function keeps its
		 * settings there, and an AFTER trigger calls it again later.
		 */
		for (int i = 0; i < w->rri->ri_TrigDesc->numtriggers; i++)
		{
			Trigger    *trigger = &w->rri->ri_TrigDesc->triggers[i];

			if (TRIGGER_FOR_ROW(trigger->tgtype))
				fmgr_info_cxt(trigger->tgfoid, &w->rri->ri_TrigFunctions[i],
							  w->estate->es_query_cxt);
		}
	}
	MemoryContextSwitchTo(save_cxt);

	w->estate->es_output_cid = GetCurrentCommandId(true);
	if (w->row_triggers)
		AfterTriggerBeginQuery();
	return w;
}

/*
 * Fire the AFTER row triggers, free the state, and make the write visible
 * to the rest of the statement: a later call in the same SELECT --
 * idem_finish on a claim idem_begin made in it -- must see it.
 */
static void
writer_end(IdemWriter *w)
{
	EState	   *estate = w->estate;

	if (w->row_triggers)
	{
		AfterTriggerEndQuery(estate);
		EvalPlanQualEnd(&w->epq);
	}
	ExecCloseResultRelations(estate);
	ExecResetTupleTable(estate->es_tupleTable, false);
	FreeExecutorState(estate);
	pfree(w);
	CommandCounterIncrement();
}

/*
 * The default of column att (a column of the DBA's), as an INSERT that
 * does not name it would give it; NULL when it has none.
 */
static Datum
writer_default(IdemWriter *w, AttrNumber att, bool *isnull)
{
	ExprState  *state = w->defaults[att - 1];

	if (state == NULL)
	{
		Node	   *expr = build_column_default(w->heap, att);

		if (expr == NULL)
		{
			*isnull = true;
			return (Datum) 0;
		}
		state = ExecPrepareExpr((Expr *) expr, w->estate);
		w->defaults[att - 1] = state;
	}
	return ExecEvalExprSwitchContext(state, GetPerTupleExprContext(w->estate),
									 isnull);
}

/*
 * One write through the executor (writer.c): the table as the result
 * relation, all of its indexes open, AFTER triggers collected for this
 * write and fired when it is done.
 */
typedef struct RecordWrite
{
	IdemStore  *store;
	int			table;
	IdemWriter *wr;
	TupleTableSlot *slot;		/* the new version */
	TupleTableSlot *oldslot;	/* the version replaced or deleted */
	Datum		expected[IDEM_NUM_COLUMNS];	/* what the new version must hold */
	bool		expected_null[IDEM_NUM_COLUMNS];
} RecordWrite;

static void
write_begin(IdemStore *store, int table, RecordWrite *w)
{
	Assert(store->lockmode >= RowExclusiveLock);

	w->store = store;
	w->table = table;
	w->wr = writer_begin(store->heap[table]);
	w->slot = w->wr->slot;
	w->oldslot = w->wr->oldslot;
}

static void
write_end(RecordWrite *w)
{
	writer_end(w->wr);
}

/*
 * The columns of the DBA's own in a new version: kept from the version it
 * replaces (oldslot), or else each one's default, as an INSERT that names
 * only our columns would give them.  Generated columns are computed by the
 * executor.
 */
static void
fill_other_columns(RecordWrite *w, TupleTableSlot *oldslot)
{
	Relation	heap = w->store->heap[w->table];
	TupleDesc	desc = RelationGetDescr(heap);
	const IdemShape *shape = &w->store->shape[w->table];
	bool		ours[MaxHeapAttributeNumber + 1] = {0};

	for (int c = 0; c < IDEM_NUM_COLUMNS; c++)
		ours[shape->attnum[c]] = true;
	ours[shape->tenant] = true;
	if (oldslot != NULL)
		slot_getallattrs(oldslot);

	for (int i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute att = TupleDescAttr(desc, i);

		if (ours[att->attnum] || att->attisdropped || att->attgenerated)
			continue;
		if (oldslot != NULL)
		{
			w->slot->tts_values[i] = oldslot->tts_values[i];
			w->slot->tts_isnull[i] = oldslot->tts_isnull[i];
			continue;
		}
		w->slot->tts_values[i] = writer_default(w->wr, att->attnum,
													 &w->slot->tts_isnull[i]);
	}
}

/*
 * Put a record into w->slot as the new version (oldslot: the version it
 * replaces in the same table, or NULL), and remember what it must hold.
 */
static void
fill_slot(RecordWrite *w, const IdemKey *key, const IdemRecord *rec,
		  TupleTableSlot *oldslot)
{
	TupleTableSlot *slot = w->slot;
	const IdemShape *shape = &w->store->shape[w->table];
	Datum	   *v = w->expected;
	bool	   *n = w->expected_null;
	bool		pending = IdemRecordIsPending(rec);

	ExecClearTuple(slot);
	ItemPointerSetInvalid(&slot->tts_tid);
	memset(slot->tts_isnull, true, slot->tts_tupleDescriptor->natts * sizeof(bool));
	memset(n, false, sizeof(w->expected_null));

	v[IDEM_COL_ROLE_ID] = idem_store_role_datum(w->store, w->table, key->role);
	v[IDEM_COL_OPERATION] = PointerGetDatum(key->operation);
	v[IDEM_COL_KEY] = PointerGetDatum(key->key);
	v[IDEM_COL_TOKEN] = Int64GetDatum(rec->token);
	v[IDEM_COL_FINGERPRINT] = PointerGetDatum(rec->fingerprint);
	n[IDEM_COL_FINGERPRINT] = (rec->fingerprint == NULL);
	v[IDEM_COL_TTL] = IntervalPGetDatum(&rec->ttl);
	v[IDEM_COL_CREATED_AT] = TimestampTzGetDatum(rec->created_at);
	v[IDEM_COL_COMPLETED_AT] = TimestampTzGetDatum(rec->completed_at);
	n[IDEM_COL_COMPLETED_AT] = pending;
	v[IDEM_COL_EXPIRES_AT] = TimestampTzGetDatum(rec->expires_at);
	v[IDEM_COL_RESPONSE] = JsonbPGetDatum(rec->response);
	n[IDEM_COL_RESPONSE] = (rec->response == NULL);
	v[IDEM_COL_HOLDER] = Int64GetDatum(rec->holder);
	n[IDEM_COL_HOLDER] = (rec->holder == 0);
	v[IDEM_COL_CHECKPOINT] = JsonbPGetDatum(rec->checkpoint);
	n[IDEM_COL_CHECKPOINT] = (rec->checkpoint == NULL);
	v[IDEM_COL_TAKEOVERS] = Int32GetDatum(rec->takeovers);
	v[IDEM_COL_FORGET_AT] = TimestampTzGetDatum(rec->forget_at);
	n[IDEM_COL_FORGET_AT] = (rec->forget_at == 0);

	if (!shape->has_claim_columns &&
		(rec->holder != 0 || rec->checkpoint != NULL || rec->forget_at != 0))
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("table \"%s\" has no columns holder, checkpoint, takeovers and forget_at",
						RelationGetRelationName(w->store->heap[w->table])),
				 errhint("Update the extension: ALTER EXTENSION idempotency UPDATE.")));

	for (int c = 0; c < IDEM_NUM_COLUMNS; c++)
	{
		AttrNumber	att = shape->attnum[c];

		if (att == InvalidAttrNumber)
			continue;
		slot->tts_values[att - 1] = v[c];
		slot->tts_isnull[att - 1] = n[c];
	}
	if (shape->tenant != InvalidAttrNumber)
	{
		/* idem_store_open checked that the key names it */
		Assert(key->has_tenant);
		slot->tts_values[shape->tenant - 1] = key->tenant;
		slot->tts_isnull[shape->tenant - 1] = false;
	}
	if (!shape->exact)
		fill_other_columns(w, oldslot);
	ExecStoreVirtualTuple(slot);
}

static void
write_skipped(RecordWrite *w, const IdemKey *key, const char *what)
{
	ereport(ERROR,
			(errcode(ERRCODE_TRIGGERED_ACTION_EXCEPTION),
			 errmsg("a trigger on table \"%s\" %s the write of idempotency key \"%s\"",
					RelationGetRelationName(w->store->heap[w->table]), what,
					text_to_cstring(key->key)),
			 errdetail("A BEFORE ROW trigger on the table returned NULL or changed the extension's columns; nothing was recorded."),
			 errhint("Triggers on the idempotency tables must return the row they are given, with the extension's columns unchanged.")));
}

/*
 * After an insert or update: did the table get the version asked for?  A
 * BEFORE ROW trigger can skip the write (return NULL) or change the row;
 * reporting a claim or a result that was not written is how a second
 * effect happens.  Without such triggers the executor wrote what it was
 * given.
 */
static void
verify_write(RecordWrite *w, const IdemKey *key, bool before_triggers)
{
	TupleDesc	desc = w->slot->tts_tupleDescriptor;
	const IdemShape *shape = &w->store->shape[w->table];

	if (!before_triggers)
		return;
	if (!ItemPointerIsValid(&w->slot->tts_tid))
		write_skipped(w, key, "skipped");
	slot_getallattrs(w->slot);
	for (int c = 0; c < IDEM_NUM_COLUMNS; c++)
	{
		AttrNumber	att = shape->attnum[c];
		Form_pg_attribute a;

		if (att == InvalidAttrNumber)
			continue;
		a = TupleDescAttr(desc, att - 1);
		if (w->slot->tts_isnull[att - 1] != w->expected_null[c] ||
			(!w->expected_null[c] &&
			 !datum_image_eq(w->slot->tts_values[att - 1], w->expected[c],
						   a->attbyval, a->attlen)))
			write_skipped(w, key, "changed");
	}
}

/*
 * After a delete: is the version gone?  A BEFORE DELETE trigger that
 * returns NULL leaves it, and a record left behind would be found again.
 */
static void
verify_delete(RecordWrite *w, const IdemKey *key, ItemPointer tid)
{
	ItemPointerData t = *tid;

	if (w->wr->rri->ri_TrigDesc == NULL || !w->wr->rri->ri_TrigDesc->trig_delete_before_row)
		return;
	if (table_tuple_fetch_row_version(w->store->heap[w->table], &t, SnapshotSelf,
									  w->slot))
		write_skipped(w, key, "skipped");
}

static void
insert_version(IdemStore *store, int table, const IdemKey *key,
			   const IdemRecord *rec, ItemPointer tid)
{
	RecordWrite w;

	write_begin(store, table, &w);
	fill_slot(&w, key, rec, NULL);
	ExecSimpleRelationInsert(w.wr->rri, w.wr->estate, w.slot);
	verify_write(&w, key, w.wr->rri->ri_TrigDesc != NULL &&
				 w.wr->rri->ri_TrigDesc->trig_insert_before_row);
	if (tid != NULL)
		*tid = w.slot->tts_tid;
	write_end(&w);
}

void
idem_store_insert(IdemStore *store, const IdemKey *key, const IdemRecord *rec)
{
	ItemPointerData tid;

	Assert(IdemRecordIsPending(rec));

	insert_version(store, IDEM_RECORDS, key, rec, &tid);

	idem_store_note_claim(store, key, rec->token, &tid);
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
			elog(ERROR, "record version (%u,%u) not found",
				 ItemPointerGetBlockNumber(&tid),
				 ItemPointerGetOffsetNumber(&tid));
		return TM_Ok;
	}

	result = table_tuple_lock(store->heap[rec->table], &tid, GetActiveSnapshot(),
							  w->oldslot, GetCurrentCommandId(false),
							  LockTupleExclusive, LockWaitBlock, 0, &tmfd);
	if (result == TM_Invisible || result == TM_SelfModified)
		elog(ERROR, "record version not lockable (%d)", result);
	return result;
}

/*
 * The table a version belongs in.  In durability mode 'completed',
 * idem_result (logged) holds what must survive a crash: completed records,
 * and claims that have a checkpoint; idem_record (unlogged) the rest.  In
 * the other modes everything is in idem_record.
 */
static int
home_table(const IdemStore *store, const IdemRecord *rec)
{
	if (store->split && (!IdemRecordIsPending(rec) || rec->checkpoint != NULL))
		return IDEM_RESULTS;
	return IDEM_RECORDS;
}

/*
 * Would writing rec move it to the other table?  durable: the write makes
 * it completed, or gives it a checkpoint.
 */
bool
idem_store_moves(const IdemStore *store, const IdemRecord *rec, bool durable)
{
	return store->split && rec->table == IDEM_RECORDS && durable;
}

/*
 * Replace the version rec->tid (in table rec->table) with rec's values, in
 * the table where the durability mode keeps it (home_table): when that is
 * the other table, the version is deleted there and the new one inserted
 * here, in this transaction.  Anything but TM_Ok means the version was
 * changed or deleted by a concurrent writer and nothing was written.
 */
TM_Result
idem_store_update(IdemStore *store, const IdemKey *key, const IdemRecord *rec)
{
	int			to = home_table(store, rec);
	RecordWrite w;
	TM_Result	result;

	Assert(rec->table < store->ntables);

	write_begin(store, rec->table, &w);
	result = lock_version(store, rec, &w);
	if (result == TM_Ok && to == rec->table)
	{
		fill_slot(&w, key, rec, w.oldslot);
		ExecSimpleRelationUpdate(w.wr->rri, w.wr->estate, &w.wr->epq, w.oldslot, w.slot);
		verify_write(&w, key, w.wr->rri->ri_TrigDesc != NULL &&
					 w.wr->rri->ri_TrigDesc->trig_update_before_row);
	}
	else if (result == TM_Ok)
	{
		ExecSimpleRelationDelete(w.wr->rri, w.wr->estate, &w.wr->epq, w.oldslot);
		verify_delete(&w, key, &w.oldslot->tts_tid);
	}
	write_end(&w);

	if (result == TM_Ok && to != rec->table)
	{
		idem_store_need_table(store, to);
		insert_version(store, to, key, rec, NULL);
	}
	return result;
}

TM_Result
idem_store_delete(IdemStore *store, const IdemKey *key, const IdemRecord *rec)
{
	RecordWrite w;
	TM_Result	result;

	write_begin(store, rec->table, &w);
	result = lock_version(store, rec, &w);
	if (result == TM_Ok)
	{
		ExecSimpleRelationDelete(w.wr->rri, w.wr->estate, &w.wr->epq, w.oldslot);
		verify_delete(&w, key, &w.oldslot->tts_tid);
	}
	write_end(&w);
	return result;
}

/*
 * Move up to max_rows records from table "from" to the other table, for
 * a durability switch or a restore (durability.c): all of them (all), or
 * those that must survive a crash in mode 'completed' -- completed ones and
 * claims with a checkpoint.  Each is moved under its key lock, held until
 * the transaction ends, so a look-up, which holds the key lock while it
 * reads both tables, sees it in exactly one (with the tables opened in
 * ACCESS EXCLUSIVE mode, nobody looks, no key lock is taken, and every
 * record moves, the transaction's own writes too).  In batches, records a
 * transaction is working on are left for a later batch.  Returns how many
 * were moved.
 */
int64
idem_store_move_batch(IdemStore *store, int from, bool all, int64 max_rows)
{
	/* under an ACCESS EXCLUSIVE lock nobody looks: no key locks needed */
	bool		key_locks = store->lockmode != AccessExclusiveLock;
	int64		max_seen = max_rows > PG_INT64_MAX / 4 ? PG_INT64_MAX : max_rows * 4;
	int			to = 1 - from;
	ScanKeyData skey[1];
	IndexScanDesc scan;
	TupleTableSlot *slot;
	int64		moved = 0;
	int64		seen = 0;

	idem_store_need_table(store, from);
	idem_store_need_table(store, to);
	/* distributed records (role_id a name) never switch modes: durability.c */
	if (store->shape[from].role_by_name)
		elog(ERROR, "idempotency records with role names cannot be moved between tables");
	slot = table_slot_create(store->heap[from], NULL);
	/* every record: role_id > 0 */
	ScanKeyInit(&skey[0], 1, BTGreaterStrategyNumber, F_OIDGT, ObjectIdGetDatum(InvalidOid));
	scan = idem_index_beginscan(store->heap[from], store->index[from],
								GetActiveSnapshot(), 1, 0);
	index_rescan(scan, skey, 1, NULL, 0);

	while (moved < max_rows && seen < max_seen &&
		   index_getnext_slot(scan, ForwardScanDirection, slot))
	{
		IdemKey		key;
		IdemRecord	rec;
		bool		isnull;

		CHECK_FOR_INTERRUPTS();
		seen++;
		memset(&key, 0, sizeof(key));	/* no tenant: its records have role names */
		key.role = DatumGetObjectId(idem_store_column(store, from, slot, IDEM_COL_ROLE_ID, &isnull));
		key.operation = DatumGetTextPCopy(idem_store_required_column(store, from, slot, IDEM_COL_OPERATION));
		key.key = DatumGetTextPCopy(idem_store_required_column(store, from, slot, IDEM_COL_KEY));
		idem_key_hash(&key);

		if (key_locks)
			idem_lock_key_until_commit(&key);
		if (!idem_store_fetch_in(store, from, &key, &rec))
			continue;
		/* in batches, what another transaction or this one is writing waits */
		if (key_locks && (TransactionIdIsValid(rec.busy_xid) || rec.mine))
			continue;
		if (!all && IdemRecordIsPending(&rec) && rec.checkpoint == NULL)
			continue;
		if (idem_store_delete(store, &key, &rec) != TM_Ok)
		{
			if (!key_locks)
				elog(ERROR, "a record of key \"%s\" could not be moved",
					 text_to_cstring(key.key));
			continue;
		}
		insert_version(store, to, &key, &rec, NULL);
		moved++;
	}

	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	return moved;
}

