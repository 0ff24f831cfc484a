/*-------------------------------------------------------------------------
 *
 * catalog.c
 *	  The extension's objects -- its tables and sequences -- found beside the
 *	  calling function, and their cache.
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

#include "catalog.h"
#include "idempotency.h"
#include "pg_compat.h"

/*
 * The extension's objects, looked up once per backend.  A relcache
 * invalidation of one of them (DROP EXTENSION, ALTER EXTENSION UPDATE)
 * forgets them.  Only OIDs are kept: the primary key index is asked of the
 * table at every open, since REINDEX CONCURRENTLY replaces it.
 */
static Oid	extension_oid = InvalidOid;
static Oid	record_relid = InvalidOid;
static Oid	result_relid = InvalidOid;	/* InvalidOid in a schema without idem_result */
static Oid	token_seqid = InvalidOid;
static Oid	epoch_seqid = InvalidOid;	/* InvalidOid in a schema without it */
static char result_persistence = 0; /* idem_result's; 0: not looked up */

/* A relcache invalidation of relid (InvalidOid: of all): idempotency.c */
void
idem_catalog_forget(Oid relid)
{
	if (relid == InvalidOid || relid == record_relid ||
		relid == result_relid || relid == token_seqid || relid == epoch_seqid)
	{
		extension_oid = record_relid = result_relid = token_seqid =
			epoch_seqid = InvalidOid;
		result_persistence = 0;
	}
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

/* A relation of the extension's beside its token sequence, by name */
Oid
idem_catalog_member(Oid extoid, Oid token_seq, const char *name)
{
	return member_relid(extoid, get_rel_namespace(token_seq), name);
}

/*
 * Does the extension have a function called name in schema nsp?  Which of
 * its tables the installed version has is told by its functions, which a
 * DBA does not rename: a schema with idem_durability has idem_result, one
 * with idem_mode_restored has idem_mode.
 */
static bool
member_function(Oid extoid, Oid nsp, const char *name)
{
	List	   *qualified = list_make2(makeString(get_namespace_name(nsp)),
									   makeString(pstrdup(name)));
	Oid			fn = LookupFuncName(qualified, 0, NULL, true);

	return OidIsValid(fn) &&
		getExtensionOfObject(ProcedureRelationId, fn) == extoid;
}

/*
 * A table or sequence of the extension's that is not where the code looks
 * for it: renamed, moved, or dropped from the extension.  Any of that is an
 * error naming it, never a silent change of what the extension does (a
 * missing idem_result is no reason to serve mode 'none').
 */
static void
missing_member(Oid extoid, Oid nsp, const char *name)
{
	Relation	dep;
	ScanKeyData key[2];
	SysScanDesc scan;
	HeapTuple	tup;
	char	   *elsewhere = NULL;
	char		relkind = strncmp(name, "idem_token_", 11) == 0 ?
		RELKIND_SEQUENCE : RELKIND_RELATION;
	static const char *const members[] = {
		"idem_record", "idem_result", "idem_mode", "idem_token_seq", "idem_token_epoch"
	};

	/* name the extension's relation of that kind that is not where it should be */
	dep = table_open(DependRelationId, AccessShareLock);
	ScanKeyInit(&key[0], Anum_pg_depend_refclassid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(ExtensionRelationId));
	ScanKeyInit(&key[1], Anum_pg_depend_refobjid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(extoid));
	scan = systable_beginscan(dep, DependReferenceIndexId, true, NULL, 2, key);
	while (elsewhere == NULL && HeapTupleIsValid(tup = systable_getnext(scan)))
	{
		Form_pg_depend d = (Form_pg_depend) GETSTRUCT(tup);
		char	   *relname;
		bool		known = false;

		if (d->classid != RelationRelationId || d->deptype != DEPENDENCY_EXTENSION ||
			get_rel_relkind(d->objid) != relkind)
			continue;
		relname = get_rel_name(d->objid);
		if (relname == NULL)
			continue;
		for (int i = 0; i < lengthof(members); i++)
			known |= strcmp(relname, members[i]) == 0;
		if (!known || get_rel_namespace(d->objid) != nsp)
			elsewhere = quote_qualified_identifier(get_namespace_name(get_rel_namespace(d->objid)),
												   relname);
	}
	systable_endscan(scan);
	table_close(dep, AccessShareLock);

	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("idempotency relation \"%s\" is missing from schema \"%s\"",
					name, get_namespace_name(nsp)),
			 elsewhere ?
			 errdetail("The extension has it as %s: it was renamed or moved.",
					   elsewhere) :
			 errdetail("The installed version of the extension has it, but it is not a member of the extension in that schema."),
			 errhint("Give it back its name and schema (ALTER TABLE ... RENAME TO / SET SCHEMA); the extension's objects must stay where CREATE EXTENSION put them.")));
}

/*
 * Find the extension's objects beside the calling function, which must be
 * the extension's own (the extension is not relocatable).  Nothing is kept
 * unless every object the installed version has is found: a failed look-up
 * is made again by the next call.
 */
static void
lookup_relids(Oid fn_oid)
{
	Oid			extoid = getExtensionOfObject(ProcedureRelationId, fn_oid);
	Oid			nsp = get_func_namespace(fn_oid);
	Oid			relid,
				seqid,
				epochid,
				resultid;

	if (!OidIsValid(extoid))
		elog(ERROR, "function %u is not a member of the extension",
			 fn_oid);
	relid = member_relid(extoid, nsp, "idem_record");
	if (!OidIsValid(relid))
		missing_member(extoid, nsp, "idem_record");
	seqid = member_relid(extoid, nsp, "idem_token_seq");
	if (!OidIsValid(seqid))
		missing_member(extoid, nsp, "idem_token_seq");

	epochid = member_relid(extoid, nsp, "idem_token_epoch");
	if (!OidIsValid(epochid) && member_function(extoid, nsp, "idem_durability"))
		missing_member(extoid, nsp, "idem_token_epoch");
	resultid = member_relid(extoid, nsp, "idem_result");
	if (!OidIsValid(resultid) && member_function(extoid, nsp, "idem_durability"))
		missing_member(extoid, nsp, "idem_result");
	if (!OidIsValid(member_relid(extoid, nsp, "idem_mode")) &&
		member_function(extoid, nsp, "idem_mode_restored"))
		missing_member(extoid, nsp, "idem_mode");

	epoch_seqid = epochid;
	result_relid = resultid;
	token_seqid = seqid;
	record_relid = relid;
	extension_oid = extoid;
}

Oid
idem_catalog_record_relid(Oid fn_oid)
{
	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);
	return record_relid;
}

/* Another table of the extension's, by name; InvalidOid if it has none */
Oid
idem_catalog_table(Oid fn_oid, const char *name)
{
	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);
	return member_relid(extension_oid, get_rel_namespace(record_relid), name);
}

/* idem_result, or InvalidOid in a schema without it */
Oid
idem_catalog_result_relid(Oid fn_oid)
{
	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);
	return result_relid;
}

/*
 * The extension's objects beside the calling function, as copies: opening
 * a table processes invalidations, which may reset the cache (an ANALYZE
 * of the table does).
 */
void
idem_catalog_objects(Oid fn_oid, IdemObjects *objects)
{
	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);
	objects->extension = extension_oid;
	objects->records = record_relid;
	objects->results = result_relid;
	objects->token_seq = token_seqid;
	objects->epoch_seq = epoch_seqid;
}

/*
 * Is idem_result logged?  Kept with the OIDs, which an invalidation of
 * idem_result forgets, and asked once our lock on idem_record has let any
 * committed switch's invalidations in (the OIDs are then still valid only
 * if none of them concerned our tables).
 */
bool
idem_catalog_result_logged(Oid resultid)
{
	if (!OidIsValid(record_relid) || resultid != result_relid)
		return get_rel_persistence(resultid) == RELPERSISTENCE_PERMANENT;
	if (result_persistence == 0)
		result_persistence = get_rel_persistence(resultid);
	return result_persistence == RELPERSISTENCE_PERMANENT;
}
