/*-------------------------------------------------------------------------
 *
 * writer.c
 *	  The executor state of one write of a record table.
 *
 * A write goes through the executor (storage.c), so that every index,
 * constraint and row trigger of the table sees it as it would see an
 * INSERT, UPDATE or DELETE: the table is the result relation of an
 * executor state of its own, with all of its indexes open.  The state is
 * built for the write and freed after it, in the caller's memory context
 * and resource owner, so an error part-way leaves nothing behind that the
 * abort does not release.  The trigger machinery (trigger slots, the AFTER
 * trigger queue, the EvalPlanQual state row triggers need) is set up only
 * when the table has row triggers.
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
#include "utils/rel.h"

#include "idempotency.h"
#include "pg_compat.h"

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
 * idem_writer_begin is paired with an idem_writer_end.
 */
IdemWriter *
idem_writer_begin(Relation heap)
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
void
idem_writer_end(IdemWriter *w)
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
