/*-------------------------------------------------------------------------
 *
 * citus_guard.c
 *	  The calls Citus would take a node down with, refused before Citus
 *	  plans them.
 *
 * Citus delegates a call of a distributed function -- SELECT f(...), or
 * SELECT ... FROM f(...) -- by hashing the constant its distribution
 * argument has once the planner has folded it.  Citus 13.2 does not look
 * at whether that constant is NULL: for a type passed by value (bigint)
 * it hashes a zero, and for one passed by reference (text, numeric, uuid:
 * the key of records distributed by key, a tenant of such a type) it
 * reads through a null pointer and takes the node down, with every
 * session on it.  The functions refuse a NULL key or tenant anyway
 * (22004), so this planner hook, which runs before Citus's (the library
 * is preloaded after Citus), refuses such a call of one of ours with that
 * error while planning it, on every node, whatever the layout.
 *
 * Citus 13.2 also takes the node down when the planner folds a call's
 * arguments to constants from other items of the query -- SELECT ... FROM
 * (VALUES ('k')) v(k), idem_inspect('op', v.k), or SELECT idem_inspect('op',
 * v.k) FROM (VALUES ('k')) v(k): it then delegates the call by the query
 * the planner has scribbled on, and crashes deparsing it (any distributed
 * function's, on a node that does not hold the shard).  Where our
 * function is distributed, a call of it whose arguments read other items
 * of a query that reads no table, which is the only kind the planner can
 * fold so, is refused while planning (0A000): Citus would not delegate it
 * anyway, and the documented form is a call with constant arguments.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "catalog/pg_language_d.h"
#include "catalog/pg_proc.h"
#include "nodes/params.h"
#include "nodes/pathnodes.h"
#include "nodes/primnodes.h"
#include "optimizer/optimizer.h"
#include "optimizer/planner.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/syscache.h"

#include "citus.h"
#include "citus_guard.h"

static planner_hook_type prev_planner = NULL;

/* Is s the suffix of a versioned entry point, such as "_1_4"? */
static bool
is_version_suffix(const char *s)
{
	if (*s == '\0')
		return false;
	while (*s == '_' && isdigit((unsigned char) s[1]))
	{
		s++;
		while (isdigit((unsigned char) *s))
			s++;
	}
	return *s == '\0';
}

/*
 * Is funcid one of our functions that take a key?  If so, *key_arg and
 * *tenant_arg (-1: none) are the arguments Citus may delegate it by.  Its
 * C entry point is the function's name, with a version's suffix or not
 * ("idem_begin_1_4": see the install script), or its tenant form's.
 */
static bool
distribution_args(Oid funcid, int *key_arg, int *tenant_arg)
{
	static const char *const keyed[] = {
		"idem_begin", "idem_finish", "idem_abort", "idem_renew",
		"idem_checkpoint", "idem_inspect", "idem_forget"
	};
	HeapTuple	tuple;
	Form_pg_proc proc;
	bool		ours = false;

	tuple = SearchSysCache1(PROCOID, ObjectIdGetDatum(funcid));
	if (!HeapTupleIsValid(tuple))
		return false;
	proc = (Form_pg_proc) GETSTRUCT(tuple);
	if (proc->prolang == ClanguageId && strncmp(NameStr(proc->proname), "idem_", 5) == 0)
	{
		bool		isnull;
		Datum		bin = SysCacheGetAttr(PROCOID, tuple, Anum_pg_proc_probin, &isnull);
		Datum		src = SysCacheGetAttr(PROCOID, tuple, Anum_pg_proc_prosrc, &isnull);
		char	   *library = TextDatumGetCString(bin);
		char	   *symbol = TextDatumGetCString(src);
		size_t		len = strlen(library);

		if (len >= strlen("idempotency") &&
			strcmp(library + len - strlen("idempotency"), "idempotency") == 0)
		{
			for (int i = 0; i < lengthof(keyed) && !ours; i++)
			{
				size_t		n = strlen(keyed[i]);

				if (strncmp(symbol, keyed[i], n) != 0)
					continue;
				if (symbol[n] == '\0' || is_version_suffix(symbol + n))
				{
					*tenant_arg = -1;
					*key_arg = 1;
					ours = true;
				}
				else if (strcmp(symbol + n, "_tenant") == 0)
				{
					*tenant_arg = 0;
					*key_arg = 2;
					ours = true;
				}
			}
		}
	}
	ReleaseSysCache(tuple);
	return ours;
}

/* Is the argument NULL, as the planner will fold it with these parameters? */
static bool
folds_to_null(Node *arg, ParamListInfo params)
{
	PlannerGlobal glob;
	PlannerInfo root;
	Node	   *folded;

	if (IsA(arg, Const))
		return ((Const *) arg)->constisnull;
	if (IsA(arg, Param) && ((Param *) arg)->paramkind != PARAM_EXTERN)
		return false;
	if (params == NULL && IsA(arg, Param))
		return false;
	if (!IsA(arg, Param) && contain_volatile_functions(arg))
		return false;
	MemSet(&glob, 0, sizeof(glob));
	MemSet(&root, 0, sizeof(root));
	glob.boundParams = params;
	root.glob = &glob;
	folded = estimate_expression_value(&root, copyObject(arg));
	return IsA(folded, Const) && ((Const *) folded)->constisnull;
}

static void
refuse_null_distribution_arg(FuncExpr *call, int key_arg, int tenant_arg, ParamListInfo params)
{
	if (tenant_arg >= 0 && tenant_arg < list_length(call->args) &&
		folds_to_null(list_nth(call->args, tenant_arg), params))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("argument \"%s\" must not be null", "tenant")));
	if (key_arg < list_length(call->args) &&
		folds_to_null(list_nth(call->args, key_arg), params))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("argument \"%s\" must not be null", "key")));
}

/* Does the query read a table, at its level or in a subquery in FROM? */
static bool
reads_a_table(List *rtable)
{
	ListCell   *lc;

	foreach(lc, rtable)
	{
		RangeTblEntry *rte = (RangeTblEntry *) lfirst(lc);

		if (rte->rtekind == RTE_RELATION)
			return true;
		if (rte->rtekind == RTE_SUBQUERY && reads_a_table(rte->subquery->rtable))
			return true;
	}
	return false;
}

/*
 * Refuse a call of one of our distributed functions whose arguments read
 * other items of a query that reads no table (see the top)
 */
static void
refuse_folded_call(FuncExpr *call, Query *parse)
{
	if (!contain_var_clause((Node *) call->args) || reads_a_table(parse->rtable) ||
		!idem_citus_function_distributed(call->funcid))
		return;
	ereport(ERROR,
			(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
			 errmsg("%s cannot take its arguments from other items of the query on a Citus node",
					get_func_name(call->funcid)),
			 errdetail("The function is distributed, and Citus 13.2 takes the node down when it delegates such a call."),
			 errhint("Call it with constant arguments, SELECT %s('op', 'key', ...), or with parameters.",
					 get_func_name(call->funcid))));
}

/* Refuse expr if it is a call of one of ours that Citus would crash on */
static void
guard_call(Node *expr, Query *parse, ParamListInfo params)
{
	FuncExpr   *call;
	int			key_arg,
				tenant_arg;

	if (expr == NULL || !IsA(expr, FuncExpr))
		return;
	call = (FuncExpr *) expr;
	if (!distribution_args(call->funcid, &key_arg, &tenant_arg))
		return;
	refuse_null_distribution_arg(call, key_arg, tenant_arg, params);
	refuse_folded_call(call, parse);
}

static PlannedStmt *
citus_guard_planner(Query *parse, const char *query_string, int cursor_options,
					ParamListInfo params)
{
	/* the shapes Citus delegates: a call in the select list, or in FROM */
	if (parse->commandType == CMD_SELECT)
	{
		ListCell   *lc;

		foreach(lc, parse->targetList)
			guard_call((Node *) ((TargetEntry *) lfirst(lc))->expr, parse, params);
		foreach(lc, parse->rtable)
		{
			RangeTblEntry *rte = (RangeTblEntry *) lfirst(lc);
			ListCell   *fc;

			if (rte->rtekind != RTE_FUNCTION)
				continue;
			foreach(fc, rte->functions)
				guard_call(((RangeTblFunction *) lfirst(fc))->funcexpr, parse, params);
		}
	}
	if (prev_planner != NULL)
		return prev_planner(parse, query_string, cursor_options, params);
	return standard_planner(parse, query_string, cursor_options, params);
}

/*
 * Called from _PG_init where Citus is loaded (before this library, as it
 * must be): put the guard in front of Citus's planner
 */
void
idem_citus_guard_init(void)
{
	prev_planner = planner_hook;
	planner_hook = citus_guard_planner;
}
