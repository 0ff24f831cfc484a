/*-------------------------------------------------------------------------
 *
 * writer.c
 *	  The executor state a write of a record table goes through, kept for
 *	  the rest of the transaction.
 *
 * A write goes through the executor (storage.c): the table as the result
 * relation of an executor state, all of its indexes open.  Building that
 * state -- the range table, the ResultRelInfo, each index opened and its
 * IndexInfo built, the tuple slots -- costs as much as the write itself
 * when the table has one index, and a new key writes twice (the claim, the
 * finish).  So the first write of a transaction to a table builds it, and
 * the later writes of the transaction to that table use it again.
 *
 * It is rebuilt, never trusted, when anything it was built from may have
 * changed: an invalidation of the table or of one of its indexes (an index
 * or trigger added or dropped, ALTER TABLE, a rewrite) marks it stale, and
 * the next write builds it anew.  Within a transaction that is enough: the
 * table stays locked from the first write, so only this transaction itself
 * can change it, and its own changes invalidate at once; another session's
 * CREATE INDEX CONCURRENTLY waits for this transaction before it relies on
 * the new index being filled, as it waits for any writer.
 *
 * The kept state holds references to the table and its indexes, in a
 * resource owner of its own under the transaction's.  ALTER TABLE, DROP,
 * TRUNCATE, CREATE INDEX and the like refuse a table this session still
 * references, so every utility statement first lets the kept state go (the
 * ProcessUtility hook), and the transaction's end releases it.  A write
 * that fails part-way leaves the state in doubt (a slot may name a buffer
 * pin the abort released): it is dropped without being used again.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/table.h"
#include "access/xact.h"
#include "catalog/pg_trigger.h"
#include "commands/trigger.h"
#include "executor/executor.h"
#include "nodes/makefuncs.h"
#include "rewrite/rewriteHandler.h"
#include "tcop/utility.h"
#include "utils/inval.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/resowner.h"

#include "idempotency.h"
#include "pg_compat.h"

/* One kept state per record table (IDEM_RECORDS, IDEM_RESULTS) */
static IdemWriter *kept[IDEM_NUM_TABLES];

static ProcessUtility_hook_type prev_process_utility = NULL;

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
 * Build the executor state for writing heap (locked by the caller in
 * RowExclusiveLock or stronger) into w, in memory context cxt.  With
 * w->owner set, the references it takes are remembered there; otherwise
 * in the current resource owner (a state used for one write).
 */
static void
build(IdemWriter *w, Relation heap, MemoryContext cxt)
{
	ResourceOwner save_owner = CurrentResourceOwner;
	MemoryContext save_cxt = MemoryContextSwitchTo(cxt);
	RangeTblEntry *rte;

	if (w->owner != NULL)
		CurrentResourceOwner = w->owner;
	PG_TRY();
	{
		w->estate = CreateExecutorState();
		MemoryContextSwitchTo(w->estate->es_query_cxt);
		if (w->owner != NULL)
			MemoryContextSetIdentifier(w->estate->es_query_cxt,
									   pstrdup(RelationGetRelationName(heap)));

		/* the table: kept at hand by our own reference while we keep it */
		w->heap = heap;
		if (w->owner != NULL)
			RelationIncrementReferenceCount(heap);

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
		idem_epq_init(&w->epq, w->estate);

		/*
		 * The row trigger functions' call information, which the executor
		 * fills in at a trigger's first call, in whatever memory context
		 * is current then: here, in the state's, which outlives the
		 * statement (a SECURITY DEFINER function keeps its settings in it).
		 */
		w->row_triggers = has_row_triggers(w->rri->ri_TrigDesc);
		for (int i = 0; w->row_triggers && i < w->rri->ri_TrigDesc->numtriggers; i++)
		{
			Trigger    *trigger = &w->rri->ri_TrigDesc->triggers[i];

			if (TRIGGER_FOR_ROW(trigger->tgtype))
				fmgr_info_cxt(trigger->tgfoid, &w->rri->ri_TrigFunctions[i],
							  w->estate->es_query_cxt);
		}

		w->slot = table_slot_create(heap, &w->estate->es_tupleTable);
		w->oldslot = table_slot_create(heap, &w->estate->es_tupleTable);

		/*
		 * The slots row triggers are given, which the executor would make
		 * at their first use: a slot holds a reference to the table's tuple
		 * descriptor, and it must be owned by the state's owner, not by
		 * the call that happens to fire a trigger first.
		 */
		if (w->row_triggers)
		{
			(void) ExecGetTriggerOldSlot(w->estate, w->rri);
			(void) ExecGetTriggerNewSlot(w->estate, w->rri);
		}
		w->defaults = palloc0(RelationGetDescr(heap)->natts * sizeof(ExprState *));
	}
	PG_FINALLY();
	{
		CurrentResourceOwner = save_owner;
		MemoryContextSwitchTo(save_cxt);
	}
	PG_END_TRY();
}

/*
 * Let a kept state go.  Its references are released with its resource
 * owner, quietly (as an abort releases them): after a failed write they
 * may be all that is left of it, and are not leaks.  The index locks it
 * took pass to the transaction, which holds them to its end, as it would
 * after an INSERT.
 */
static void
release(IdemWriter *w)
{
	ResourceOwner owner = w->owner;

	if (w->estate != NULL)
		FreeExecutorState(w->estate);
	ResourceOwnerRelease(owner, RESOURCE_RELEASE_BEFORE_LOCKS, false, false);
	ResourceOwnerRelease(owner, RESOURCE_RELEASE_LOCKS, true, false);
	ResourceOwnerRelease(owner, RESOURCE_RELEASE_AFTER_LOCKS, false, false);
	ResourceOwnerDelete(owner);
	pfree(w);
}

/* Let go of every kept state that is not in the middle of a write */
static void
release_idle(void)
{
	for (int t = 0; t < IDEM_NUM_TABLES; t++)
		if (kept[t] != NULL && !kept[t]->writing)
		{
			IdemWriter *w = kept[t];

			kept[t] = NULL;
			release(w);
		}
}

/*
 * The executor state to write heap, table number table of the store, with
 * es_output_cid set for this write and the AFTER trigger queue opened.
 * Every idem_writer_begin is paired with an idem_writer_end.
 */
IdemWriter *
idem_writer_begin(Relation heap, int table)
{
	IdemWriter *w = kept[table];

	if (w != NULL && !w->writing &&
		(w->stale || w->in_doubt || w->building || w->heap != heap))
	{
		kept[table] = NULL;
		release(w);
		w = NULL;
	}

	if (w == NULL)
	{
		/*
		 * Keep it for the rest of the transaction.  A build that fails
		 * part-way leaves it marked as being built, and it is released
		 * like a write that did.  An invalidation that arrives while it is
		 * built (opening an index lets them in) makes the next write build
		 * anew.
		 */
		w = MemoryContextAllocZero(TopTransactionContext, sizeof(IdemWriter));
		w->owner = ResourceOwnerCreate(TopTransactionResourceOwner,
									   "idempotency writer");
		w->building = true;
		kept[table] = w;
		build(w, heap, TopTransactionContext);
		w->building = false;
	}
	else if (w->writing)
	{
		/*
		 * A write from within a write to the same table (a trigger on it
		 * calling the idem_* functions): a state of its own, for this
		 * write only.
		 */
		w = palloc0(sizeof(IdemWriter));
		build(w, heap, CurrentMemoryContext);
	}

	w->writing = true;
	w->write_subid = GetCurrentSubTransactionId();
	w->estate->es_output_cid = GetCurrentCommandId(true);
	if (w->row_triggers)
		AfterTriggerBeginQuery();
	return w;
}

/*
 * Fire the AFTER row triggers, and make the write visible to the rest of
 * the statement: a later call in the same SELECT -- idem_finish on a claim
 * idem_begin made in it -- must see it.  A kept state is cleared for the
 * next write; one built for this write alone is released.
 */
void
idem_writer_end(IdemWriter *w)
{
	EState	   *estate = w->estate;
	ListCell   *lc;

	if (w->row_triggers)
		AfterTriggerEndQuery(estate);
	EvalPlanQualEnd(&w->epq);

	/* relations the AFTER triggers opened, under this call's owner */
	foreach(lc, estate->es_trig_target_relations)
		table_close(((ResultRelInfo *) lfirst(lc))->ri_RelationDesc, NoLock);
	estate->es_trig_target_relations = NIL;

	ExecClearTuple(w->slot);
	ExecClearTuple(w->oldslot);
	ResetPerTupleExprContext(estate);

	if (w->owner == NULL)
	{
		ExecCloseResultRelations(estate);
		ExecResetTupleTable(estate->es_tupleTable, false);
		FreeExecutorState(estate);
	}
	else
		w->writing = false;
	CommandCounterIncrement();
}

/*
 * The default of column att (a column of the DBA's), as an INSERT that
 * does not name it would give it; NULL when it has none.  The expression
 * is prepared once per state.
 */
Datum
idem_writer_default(IdemWriter *w, AttrNumber att, bool *isnull)
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

/* ---- when a kept state must go ---- */

/* The table or one of its indexes changed: build anew at the next write */
static void
writer_relcache_inval(Datum arg, Oid relid)
{
	for (int t = 0; t < IDEM_NUM_TABLES; t++)
	{
		IdemWriter *w = kept[t];

		if (w == NULL)
			continue;
		/* while it is built, its index list may be half filled in */
		if (w->building || relid == InvalidOid ||
			relid == RelationGetRelid(w->heap))
			w->stale = true;
		for (int i = 0; i < w->rri->ri_NumIndices && !w->stale; i++)
			if (RelationGetRelid(w->rri->ri_IndexRelationDescs[i]) == relid)
				w->stale = true;
	}
}

static void
writer_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_PRE_COMMIT:
		case XACT_EVENT_PARALLEL_PRE_COMMIT:
		case XACT_EVENT_PRE_PREPARE:
			/* no write is in progress at the end of a transaction */
			release_idle();
			break;
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			/* the abort releases the owners and frees the memory */
			memset(kept, 0, sizeof(kept));
			break;
		default:
			break;
	}
}

/*
 * A subtransaction aborted in the middle of a write: its buffer pins and
 * trigger state were released with it, and the kept state no longer
 * matches them.
 */
static void
writer_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
						SubTransactionId parentSubid, void *arg)
{
	if (event != SUBXACT_EVENT_ABORT_SUB)
		return;

	/*
	 * A write begun in this subtransaction or one below it (their ids are
	 * larger) ends here; one begun further out goes on (a trigger that
	 * caught an error).
	 */
	for (int t = 0; t < IDEM_NUM_TABLES; t++)
		if (kept[t] != NULL && kept[t]->writing &&
			kept[t]->write_subid >= mySubid)
		{
			kept[t]->in_doubt = true;
			kept[t]->writing = false;
		}
}

/*
 * Before a utility statement: it may need the table unreferenced.  Those
 * that never do -- transaction control, SET, prepared statements (which
 * cannot be DDL), and DO and CALL, whose own statements come through
 * here -- keep the state.
 */
static void
writer_process_utility(PlannedStmt *pstmt, const char *queryString,
					   bool readOnlyTree, ProcessUtilityContext context,
					   ParamListInfo params, QueryEnvironment *queryEnv,
					   DestReceiver *dest, QueryCompletion *qc)
{
	switch (nodeTag(pstmt->utilityStmt))
	{
		case T_TransactionStmt:
		case T_VariableSetStmt:
		case T_VariableShowStmt:
		case T_PrepareStmt:
		case T_ExecuteStmt:
		case T_DeallocateStmt:
		case T_DoStmt:
		case T_CallStmt:
			break;
		default:
			release_idle();
			break;
	}
	if (prev_process_utility)
		prev_process_utility(pstmt, queryString, readOnlyTree, context,
							 params, queryEnv, dest, qc);
	else
		standard_ProcessUtility(pstmt, queryString, readOnlyTree, context,
								params, queryEnv, dest, qc);
}

void
idem_writer_init(void)
{
	CacheRegisterRelcacheCallback(writer_relcache_inval, (Datum) 0);
	RegisterXactCallback(writer_xact_callback, NULL);
	RegisterSubXactCallback(writer_subxact_callback, NULL);
	prev_process_utility = ProcessUtility_hook;
	ProcessUtility_hook = writer_process_utility;
}
