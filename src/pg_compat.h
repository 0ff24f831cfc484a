/*-------------------------------------------------------------------------
 *
 * pg_compat.h
 *	  Stand-ins for the server API differences between the PostgreSQL
 *	  major versions the extension builds against (15 to 18).
 *
 * Each macro has one spelling in our code and expands to the call the
 * server we are compiled against has.  Include it after postgres.h and the
 * server headers (it tests PG_VERSION_NUM, from pg_config.h).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_PG_COMPAT_H
#define IDEM_PG_COMPAT_H

#include "access/genam.h"
#include "executor/executor.h"
#include "parser/parse_relation.h"
#include "storage/lock.h"
#include "storage/proc.h"

/*
 * PGPROC of the backend running a virtual transaction.  PostgreSQL 17
 * replaced backend IDs by proc numbers: BackendIdGetProc(vxid.backendId)
 * became ProcNumberGetProc(vxid.procNumber) (storage/procarray.h).
 */
#if PG_VERSION_NUM >= 170000
#include "storage/procarray.h"
#define IdemVxidGetProc(vxid)	ProcNumberGetProc((vxid)->procNumber)
#else
#include "storage/sinvaladt.h"
#define IdemVxidGetProc(vxid)	BackendIdGetProc((vxid)->backendId)
#endif

/*
 * index_beginscan: PostgreSQL 18 added an IndexScanInstrumentation *
 * argument after the snapshot (NULL: no instrumentation).
 */
#if PG_VERSION_NUM >= 180000
#define idem_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), NULL, (nkeys), (norderbys))
#else
#define idem_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), (nkeys), (norderbys))
#endif

/*
 * A one-relation range table for an executor state that writes that
 * relation: 16 added RTE permission infos, 18 the set of unpruned
 * relations.
 */
static inline void
idem_init_range_table(EState *estate, RangeTblEntry *rte)
{
#if PG_VERSION_NUM >= 160000
	List	   *perminfos = NIL;

	addRTEPermissionInfo(&perminfos, rte);
#endif
#if PG_VERSION_NUM >= 180000
	ExecInitRangeTable(estate, list_make1(rte), perminfos,
					   bms_make_singleton(1));
#elif PG_VERSION_NUM >= 160000
	ExecInitRangeTable(estate, list_make1(rte), perminfos);
#else
	ExecInitRangeTable(estate, list_make1(rte));
#endif
}

/* EvalPlanQualInit: 16 added the list of result relations */
#if PG_VERSION_NUM >= 160000
#define idem_epq_init(epq, estate) \
	EvalPlanQualInit((epq), (estate), NULL, NIL, -1, NIL)
#else
#define idem_epq_init(epq, estate) \
	EvalPlanQualInit((epq), (estate), NULL, NIL, -1)
#endif

/*
 * Wait events of an extension's own: 17 added WaitEventExtensionNew (a
 * name shown in pg_stat_activity.wait_event); before, every sleep of an
 * extension is PG_WAIT_EXTENSION, shown as "Extension".
 */
#if PG_VERSION_NUM >= 170000
#include "utils/wait_event.h"
#define idem_wait_event_new(name)	WaitEventExtensionNew(name)
#else
#define idem_wait_event_new(name)	((void) (name), PG_WAIT_EXTENSION)
#endif

/* LockHeldByMe: 17 added "or a stronger mode" */
#if PG_VERSION_NUM >= 170000
#define idem_lock_held_by_me(tag, mode) LockHeldByMe((tag), (mode), false)
#else
#define idem_lock_held_by_me(tag, mode) LockHeldByMe((tag), (mode))
#endif

/* LockAcquireExtended: PostgreSQL 18 adds logLockFailure */
#if PG_VERSION_NUM >= 180000
#define idem_lock_acquire_extended(tag, mode, session, dontwait, report) \
	LockAcquireExtended((tag), (mode), (session), (dontwait), (report), NULL, false)
#else
#define idem_lock_acquire_extended(tag, mode, session, dontwait, report) \
	LockAcquireExtended((tag), (mode), (session), (dontwait), (report), NULL)
#endif

/* RelationGetPrimaryKeyIndex: 18 added "deferrable_ok" */
#if PG_VERSION_NUM >= 180000
#define idem_primary_key_index(rel) RelationGetPrimaryKeyIndex((rel), false)
#else
#define idem_primary_key_index(rel) RelationGetPrimaryKeyIndex(rel)
#endif

/* The number of a relation's current file: 16 renamed rd_node */
#if PG_VERSION_NUM >= 160000
#define idem_relfilenumber(rel) ((rel)->rd_locator.relNumber)
#else
#define idem_relfilenumber(rel) ((rel)->rd_node.relNode)
#endif

/*
 * A setting's entry, a placeholder's too (NULL: none).  PostgreSQL 16
 * exports find_option(); 15 has only the array of them all.
 */
#include "utils/guc_tables.h"
#if PG_VERSION_NUM >= 160000
#define idem_find_setting(name)	find_option((name), false, true, DEBUG1)
#else
static inline struct config_generic *
idem_find_setting(const char *name)
{
	struct config_generic **vars = get_guc_variables();
	int			n = GetNumConfigOptions();

	for (int i = 0; i < n; i++)
		if (pg_strcasecmp(vars[i]->name, name) == 0)
			return vars[i];
	return NULL;
}
#endif

#endif							/* IDEM_PG_COMPAT_H */
