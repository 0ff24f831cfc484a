/*-------------------------------------------------------------------------
 *
 * citus.c
 *	  What a Citus cluster makes of this node: the records are served by the
 *	  coordinator only.
 *
 * The record tables are not distributed.  Citus creates the extension on
 * every node of a cluster, so each worker has tables of its own: answering
 * there would keep a second store beside the coordinator's, in which a key
 * completed through the coordinator is new.  Every call that opens the
 * records therefore refuses on a node that Citus has made a worker (its
 * pg_dist_local_group is not the coordinator's group, 0).
 *
 * On the coordinator, a transaction that writes records may also write
 * distributed tables through Citus, the in-transaction shape's effect.
 * With one worker written, Citus commits it in one phase, before the
 * coordinator's own commit, unless it is told that the transaction has a
 * local write of its own: a coordinator that died between the two would
 * keep the effect and lose the claim and the result, and the retry would
 * run the effect again.  So a call that opens the records to write tells
 * Citus, through its Use2PCForCoordinatedTransaction() (a flag of the
 * current transaction, which Citus clears at its end): Citus then prepares
 * the workers it wrote before the local commit, and commits or rolls them
 * back by what that commit did, also after a crash of either side.
 * Workers that were not written are not prepared, so a transaction that
 * writes only records costs nothing more.
 *
 * Citus refuses to run unless it is in shared_preload_libraries, so a
 * backend without its settings is on no Citus node, and pays one look-up
 * of a setting.  A Citus node reads the one row of pg_dist_local_group at
 * each call: the coordinator may add this node while our sessions live.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "catalog/namespace.h"
#include "catalog/pg_namespace_d.h"
#include "commands/extension.h"
#include "fmgr.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"

#include "citus.h"

/* The coordinator's group: a node Citus has not added to a cluster has it too */
#define CITUS_COORDINATOR_GROUP 0

/*
 * The group of this node, from Citus's pg_dist_local_group.  *upgrading is
 * set when the table is empty, as it is while a PostgreSQL upgrade is
 * finished.
 */
static int32
local_group(bool *upgrading)
{
	Oid			relid;
	Relation	rel;
	SysScanDesc scan;
	HeapTuple	tuple;
	int32		group = CITUS_COORDINATOR_GROUP;

	*upgrading = false;
	relid = get_relname_relid("pg_dist_local_group", PG_CATALOG_NAMESPACE);
	if (!OidIsValid(relid))
		return group;

	rel = table_open(relid, AccessShareLock);
	scan = systable_beginscan(rel, InvalidOid, false, NULL, 0, NULL);
	tuple = systable_getnext(scan);
	if (HeapTupleIsValid(tuple))
	{
		bool		isnull;
		Datum		value = heap_getattr(tuple, 1, RelationGetDescr(rel), &isnull);

		if (!isnull)
			group = DatumGetInt32(value);
	}
	else
		*upgrading = true;
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return group;
}

/* Citus's Use2PCForCoordinatedTransaction(), once looked up */
static void (*use_2pc) (void) = NULL;

/*
 * Refuse to open the records on a Citus worker; on the coordinator, make a
 * transaction that opens them to write commit its workers in two phases
 * (docs/scaling-out.md).
 */
void
idem_citus_check_node(bool write)
{
	bool		upgrading;
	int32		group;

	/*
	 * The extension's own scripts set up the tables on every node: Citus
	 * runs CREATE and ALTER EXTENSION on its workers too.
	 */
	if (GetConfigOption("citus.version", true, false) == NULL || creating_extension ||
		!OidIsValid(get_extension_oid("citus", true)))
		return;
	group = local_group(&upgrading);
	if (upgrading)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency records cannot be used while Citus is being upgraded"),
				 errdetail("pg_dist_local_group is empty, so this node does not know whether it is the coordinator."),
				 errhint("Run citus_finish_pg_upgrade() first.")));
	if (group != CITUS_COORDINATOR_GROUP)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idempotency records are served by the Citus coordinator, not by a worker"),
				 errdetail("This node is a worker of a Citus cluster (group %d); its own record tables would be a second store, in which a key completed through the coordinator counts as new.",
						   group),
				 errhint("Send calls of the idem_* functions to the coordinator.")));
	if (write)
	{
		if (use_2pc == NULL)
			use_2pc = (void (*) (void))
				load_external_function("citus", "Use2PCForCoordinatedTransaction",
									   true, NULL);
		use_2pc();
	}
}
