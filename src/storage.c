/*-------------------------------------------------------------------------
 *
 * storage.c
 *	  Access to the record tables: looking records up, and writing them
 *	  through the executor.
 *
 * Claims are in idem_record.  A completed record is there too, except in
 * durability mode 'completed' (durability.c), where a finish moves it to
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
 * log trigger among them) see every write, as they would an INSERT.  Each
 * write builds its executor state and frees it (writer.c).
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
#include "catalog/indexing.h"
#include "catalog/pg_class.h"
#include "catalog/pg_depend.h"
#include "catalog/pg_am_d.h"
#include "catalog/pg_collation_d.h"
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
#include "pg_compat.h"

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
static char result_persistence = 0; /* idem_result's; 0: not looked up */

/*
 * Each table's shape (see check_shape), kept while its relcache entry is:
 * any ALTER TABLE, index change or rewrite of the table invalidates it.
 */
static IdemShape shape_cache[IDEM_NUM_TABLES];
static Oid	shape_relid[IDEM_NUM_TABLES];

static void
forget_relids(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == record_relid ||
		relid == result_relid || relid == token_seqid || relid == epoch_seqid)
	{
		extension_oid = record_relid = result_relid = token_seqid =
			epoch_seqid = InvalidOid;
		result_persistence = 0;
	}
	for (int t = 0; t < IDEM_NUM_TABLES; t++)
		if (relid == InvalidOid || relid == shape_relid[t])
			shape_relid[t] = InvalidOid;
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
 * Does the extension have a function called name in schema nsp?  Which of
 * its tables the installed version has is told by its functions, which a
 * DBA does not rename: idem_durability came with idem_result (1.3),
 * idem_mode_restored with idem_mode (1.4).
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
		elog(ERROR, "idempotency: function %u is not a member of the extension",
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
idem_store_relid(Oid fn_oid)
{
	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);
	return record_relid;
}

/* Another table of the extension's, by name; InvalidOid if it has none */
Oid
idem_store_table(Oid fn_oid, const char *name)
{
	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);
	return member_relid(extension_oid, get_rel_namespace(record_relid), name);
}

/* idem_result, or InvalidOid before version 1.3 */
Oid
idem_store_result_relid(Oid fn_oid)
{
	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);
	return result_relid;
}

/* ---- the tables' shape ---- */

/*
 * The columns the code reads and writes, by name.  A DBA may add columns
 * (a write fills them with their default, or NULL, and an update keeps
 * them), but not drop, retype or rename these.  role_id was an oid before
 * version 1.3.
 */
static const struct
{
	const char *name;
	Oid			type;
	Oid			old_type;		/* also accepted */
}			columns[IDEM_NUM_COLUMNS] = {
	[IDEM_COL_ROLE_ID] = {"role_id", REGROLEOID, OIDOID},
	[IDEM_COL_OPERATION] = {"operation", TEXTOID},
	[IDEM_COL_KEY] = {"key", TEXTOID},
	[IDEM_COL_TOKEN] = {"token", INT8OID},
	[IDEM_COL_FINGERPRINT] = {"fingerprint", BYTEAOID},
	[IDEM_COL_TTL] = {"ttl", INTERVALOID},
	[IDEM_COL_CREATED_AT] = {"created_at", TIMESTAMPTZOID},
	[IDEM_COL_COMPLETED_AT] = {"completed_at", TIMESTAMPTZOID},
	[IDEM_COL_EXPIRES_AT] = {"expires_at", TIMESTAMPTZOID},
	[IDEM_COL_RESPONSE] = {"response", JSONBOID},
	[IDEM_COL_HOLDER] = {"holder", INT8OID},
	[IDEM_COL_CHECKPOINT] = {"checkpoint", JSONBOID},
	[IDEM_COL_TAKEOVERS] = {"takeovers", INT4OID},
	[IDEM_COL_FORGET_AT] = {"forget_at", TIMESTAMPTZOID},
};

static void
shape_error(Relation rel, const char *detail)
{
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("idempotency table \"%s\" has a shape the extension cannot use",
					RelationGetRelationName(rel)),
			 errdetail_internal("%s", detail),
			 errhint("Undo the change to the table; columns of your own may be added if they are nullable or have a default.")));
}

/*
 * Find our columns in the table and check everything the code relies on:
 * a plain table, each column of the right type, any other column fillable
 * (nullable, or with a default), and a primary key on (role_id,
 * operation, key) with the C collation, which is what fetch_in's scan keys
 * describe.  Anything else is an error naming the table, never a write of
 * the wrong shape.
 */
static void
check_shape(Relation heap, Relation pkey, IdemShape *shape)
{
	TupleDesc	desc = RelationGetDescr(heap);
	int			ours = 0;
	int			new_columns = 0;

	memset(shape, 0, sizeof(*shape));
	shape->exact = true;
	if (heap->rd_rel->relkind != RELKIND_RELATION)
		shape_error(heap, "It is not a plain table.");

	for (int i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute att = TupleDescAttr(desc, i);
		int			c;

		if (att->attisdropped)
		{
			shape->exact = false;
			continue;
		}
		for (c = 0; c < IDEM_NUM_COLUMNS; c++)
			if (strcmp(NameStr(att->attname), columns[c].name) == 0)
				break;
		if (c == IDEM_NUM_COLUMNS)
		{
			/* a column of the DBA's: the write must be able to fill it */
			shape->exact = false;
			if (att->attnotnull && !att->atthasdef && !att->attidentity &&
				!att->attgenerated)
				shape_error(heap, psprintf("Column \"%s\" is NOT NULL and has no default.",
										   NameStr(att->attname)));
			continue;
		}
		if (att->atttypid != columns[c].type && att->atttypid != columns[c].old_type)
			shape_error(heap, psprintf("Column \"%s\" has type %s, not %s.",
									   NameStr(att->attname),
									   format_type_be(att->atttypid),
									   format_type_be(columns[c].type)));
		shape->attnum[c] = att->attnum;
		if (att->attnum != c + 1)
			shape->exact = false;
		ours++;
		if (c >= IDEM_NUM_COLUMNS_1_0)
			new_columns++;
	}
	for (int c = 0; c < IDEM_NUM_COLUMNS_1_0; c++)
		if (shape->attnum[c] == InvalidAttrNumber)
			shape_error(heap, psprintf("Column \"%s\" is missing.", columns[c].name));
	if (new_columns != 0 && new_columns != IDEM_NUM_COLUMNS - IDEM_NUM_COLUMNS_1_0)
		shape_error(heap, "Some of the columns of version 1.4 are missing.");
	shape->has_1_4 = (new_columns != 0);
	if (ours != desc->natts)
		shape->exact = false;

	/* the primary key fetch_in descends */
	if (pkey->rd_rel->relam != BTREE_AM_OID ||
		IndexRelationGetNumberOfKeyAttributes(pkey) != 3 ||
		pkey->rd_index->indkey.values[0] != shape->attnum[IDEM_COL_ROLE_ID] ||
		pkey->rd_index->indkey.values[1] != shape->attnum[IDEM_COL_OPERATION] ||
		pkey->rd_index->indkey.values[2] != shape->attnum[IDEM_COL_KEY] ||
		pkey->rd_indcollation[1] != C_COLLATION_OID ||
		pkey->rd_indcollation[2] != C_COLLATION_OID)
		shape_error(heap, psprintf("Its primary key \"%s\" is not a btree on (role_id, operation, key) with collation \"C\".",
								   RelationGetRelationName(pkey)));
	shape->pkey = RelationGetRelid(pkey);
}

/*
 * Open one table of the store.  An unlogged table has no data on a
 * standby: a look there (idem_inspect, idem_stats) reads what the standby
 * has -- completed records in a logged idem_result -- and
 * idem_store_note_hidden says what it cannot see.
 */
static void
open_heap(IdemStore *store, int table, Oid relid)
{
	Relation	heap = table_open(relid, store->lockmode);

	if (heap->rd_rel->relpersistence == RELPERSISTENCE_UNLOGGED &&
		RecoveryInProgress())
	{
		if (store->lockmode != AccessShareLock)
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("idempotency records cannot be written during recovery"),
					 errdetail("Table \"%s\" is unlogged: it is not replicated to standbys.",
							   RelationGetRelationName(heap))));
		table_close(heap, store->lockmode);
		store->hidden[table] = true;
		return;
	}
	store->heap[table] = heap;
}

/* Open the primary key of an open table, and learn the table's shape */
static void
open_index(IdemStore *store, int table)
{
	Relation	heap = store->heap[table];
	Oid			relid = RelationGetRelid(heap);
	Oid			pkey;

	if (shape_relid[table] == relid)
	{
		store->index[table] = index_open(shape_cache[table].pkey, store->lockmode);
		store->shape[table] = shape_cache[table];
		return;
	}

	if (heap->rd_rel->relkind != RELKIND_RELATION)
		shape_error(heap, "It is not a plain table.");
	pkey = idem_primary_key_index(heap);
	if (!OidIsValid(pkey))
		shape_error(heap, "It has no primary key: restore the primary key on (role_id, operation, key).");
	store->index[table] = index_open(pkey, store->lockmode);
	check_shape(heap, store->index[table], &store->shape[table]);
	/* opening the index may have processed an invalidation of the table */
	shape_cache[table] = store->shape[table];
	shape_relid[table] = relid;
}

static void
open_table(IdemStore *store, int table, Oid relid)
{
	open_heap(store, table, relid);
	if (store->heap[table] != NULL)
		open_index(store, table);
}

/*
 * Is idem_result logged?  Kept with the OIDs, which an invalidation of
 * idem_result forgets, and asked once our lock on idem_record has let any
 * committed switch's invalidations in (the OIDs are then still valid only
 * if none of them concerned our tables).
 */
static bool
result_is_logged(Oid resultid)
{
	if (!OidIsValid(record_relid) || resultid != result_relid)
		return get_rel_persistence(resultid) == RELPERSISTENCE_PERMANENT;
	if (result_persistence == 0)
		result_persistence = get_rel_persistence(resultid);
	return result_persistence == RELPERSISTENCE_PERMANENT;
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

	memset(store->heap, 0, sizeof(store->heap));
	memset(store->index, 0, sizeof(store->index));
	memset(store->hidden, 0, sizeof(store->hidden));
	open_table(store, IDEM_RECORDS, relid);
	store->ntables = OidIsValid(resultid) ? 2 : 1;
	store->result_relid = resultid;

	/*
	 * The persistence of both decides the mode.  Our lock on idem_record
	 * keeps it: a switch takes ACCESS EXCLUSIVE locks on both tables, and
	 * invalidates idem_record, whose lock we took after it.
	 */
	store->split = OidIsValid(resultid) &&
		(store->hidden[IDEM_RECORDS] ||
		 store->heap[IDEM_RECORDS]->rd_rel->relpersistence == RELPERSISTENCE_UNLOGGED) &&
		result_is_logged(resultid);
}

/*
 * idem_result is opened when a call first needs it: a replay in modes
 * 'none' and 'all' finds its record in idem_record and never does.
 */
static void
need_heap(IdemStore *store, int table)
{
	Assert(table < store->ntables);
	if (table == IDEM_RESULTS && store->heap[IDEM_RESULTS] == NULL &&
		!store->hidden[IDEM_RESULTS])
		open_heap(store, IDEM_RESULTS, store->result_relid);
}

/* ... with its primary key */
static void
need_table(IdemStore *store, int table)
{
	need_heap(store, table);
	if (store->heap[table] != NULL && store->index[table] == NULL)
		open_index(store, table);
}

/*
 * During recovery: say which records a look could not see (the unlogged
 * tables'), as a NOTICE.
 */
void
idem_store_note_hidden(IdemStore *store)
{
	if (store->hidden[IDEM_RECORDS])
		ereport(NOTICE,
				(errmsg("pending idempotency claims cannot be seen during recovery"),
				 errdetail(store->split ?
						   "Table \"idem_record\" is unlogged: it is not replicated to standbys. Completed records, which are logged, are shown." :
						   "The record tables are unlogged: they are not replicated to standbys, and no record is shown."),
				 errhint("Look on the primary to see every record.")));
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
		if (store->index[t] != NULL)
			index_close(store->index[t], mode);
		table_close(store->heap[t], mode);
	}
}

/* Column c of a version in table t; absent columns read as NULL */
static inline Datum
column(IdemStore *store, int t, TupleTableSlot *slot, IdemColumn c, bool *isnull)
{
	AttrNumber	att = store->shape[t].attnum[c];

	if (att == InvalidAttrNumber)
	{
		*isnull = true;
		return (Datum) 0;
	}
	return slot_getattr(slot, att, isnull);
}

/* A column that must not be NULL: a row written by hand may have one */
static Datum
required_column(IdemStore *store, int t, TupleTableSlot *slot, IdemColumn c)
{
	bool		isnull;
	Datum		d = column(store, t, slot, c, &isnull);

	if (isnull)
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("idempotency record in table \"%s\" has a NULL \"%s\"",
						RelationGetRelationName(store->heap[t]), columns[c].name),
				 errdetail("The record of key \"%s\" was not written by the idem_* functions.",
						   TextDatumGetCString(required_column(store, t, slot, IDEM_COL_KEY)))));
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

	rec->token = DatumGetInt64(required_column(store, table, slot, IDEM_COL_TOKEN));
	d = column(store, table, slot, IDEM_COL_FINGERPRINT, &isnull);
	rec->fingerprint = isnull ? NULL : DatumGetByteaPCopy(d);
	rec->ttl = *DatumGetIntervalP(required_column(store, table, slot, IDEM_COL_TTL));
	rec->created_at = DatumGetTimestampTz(required_column(store, table, slot, IDEM_COL_CREATED_AT));
	d = column(store, table, slot, IDEM_COL_COMPLETED_AT, &isnull);
	rec->completed_at = isnull ? 0 : DatumGetTimestampTz(d);
	rec->expires_at = DatumGetTimestampTz(required_column(store, table, slot, IDEM_COL_EXPIRES_AT));
	d = column(store, table, slot, IDEM_COL_RESPONSE, &isnull);
	rec->response = isnull ? NULL : DatumGetJsonbPCopy(d);
	if (rec->completed_at == 0 && rec->response != NULL)
		rec->response = NULL;	/* a pending record has no response */

	d = column(store, table, slot, IDEM_COL_HOLDER, &isnull);
	rec->holder = isnull ? 0 : DatumGetInt64(d);
	d = column(store, table, slot, IDEM_COL_CHECKPOINT, &isnull);
	rec->checkpoint = isnull ? NULL : DatumGetJsonbPCopy(d);
	d = column(store, table, slot, IDEM_COL_TAKEOVERS, &isnull);
	rec->takeovers = isnull ? 0 : DatumGetInt32(d);
	d = column(store, table, slot, IDEM_COL_FORGET_AT, &isnull);
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
static bool
fetch_in(IdemStore *store, int table, const IdemKey *key, IdemRecord *rec)
{
	SnapshotData dirty;
	ScanKeyData skey[3];
	IndexScanDesc scan;
	TupleTableSlot *slot;
	bool		found = false;

	need_table(store, table);
	if (store->heap[table] == NULL)
		return false;			/* hidden during recovery */
	InitDirtySnapshot(dirty);

	ScanKeyInit(&skey[0], 1, BTEqualStrategyNumber, F_OIDEQ,
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
	return fetch_in(store, store->split ? IDEM_RESULTS : IDEM_RECORDS, key, rec);
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
	need_heap(store, IDEM_RESULTS);
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
		return fetch_in(store, IDEM_RESULTS, key, rec) ||
			fetch_in(store, IDEM_RECORDS, key, rec);
	if (fetch_in(store, IDEM_RECORDS, key, rec))
		return true;
	return results_possible(store) && fetch_in(store, IDEM_RESULTS, key, rec);
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
slot_matches_key(IdemStore *store, int t, TupleTableSlot *slot,
				 const IdemKey *key)
{
	bool		isnull;

	return DatumGetObjectId(column(store, t, slot, IDEM_COL_ROLE_ID, &isnull)) == key->role &&
		!isnull &&
		text_equal(required_column(store, t, slot, IDEM_COL_OPERATION), key->operation) &&
		text_equal(required_column(store, t, slot, IDEM_COL_KEY), key->key);
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

/* ---- writes ---- */

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
	w->wr = idem_writer_begin(store->heap[table]);
	w->slot = w->wr->slot;
	w->oldslot = w->wr->oldslot;
}

static void
write_end(RecordWrite *w)
{
	idem_writer_end(w->wr);
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
		w->slot->tts_values[i] = idem_writer_default(w->wr, att->attnum,
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

	v[IDEM_COL_ROLE_ID] = ObjectIdGetDatum(key->role);
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

	if (!shape->has_1_4 &&
		(rec->holder != 0 || rec->checkpoint != NULL || rec->forget_at != 0))
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("table \"%s\" has no columns of version 1.4",
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

	last_claim.xid = GetCurrentTransactionId();
	last_claim.relid = RelationGetRelid(store->heap[IDEM_RECORDS]);
	last_claim.relfilenumber = idem_relfilenumber(store->heap[IDEM_RECORDS]);
	last_claim.role = key->role;
	last_claim.token = rec->token;
	last_claim.tid = tid;
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
		need_table(store, to);
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

	need_table(store, from);
	need_table(store, to);
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
		key.role = DatumGetObjectId(column(store, from, slot, IDEM_COL_ROLE_ID, &isnull));
		key.operation = DatumGetTextPCopy(required_column(store, from, slot, IDEM_COL_OPERATION));
		key.key = DatumGetTextPCopy(required_column(store, from, slot, IDEM_COL_KEY));
		idem_key_hash(&key);

		if (key_locks)
			idem_lock_key_until_commit(&key);
		if (!fetch_in(store, from, &key, &rec))
			continue;
		/* in batches, what another transaction or this one is writing waits */
		if (key_locks && (TransactionIdIsValid(rec.busy_xid) || rec.mine))
			continue;
		if (!all && IdemRecordIsPending(&rec) && rec.checkpoint == NULL)
			continue;
		if (idem_store_delete(store, &key, &rec) != TM_Ok)
		{
			if (!key_locks)
				elog(ERROR, "idempotency: a record of key \"%s\" could not be moved",
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
		text	   *ta = DatumGetTextPP(required_column(store, a->table, a->slot, c));
		text	   *tb = DatumGetTextPP(required_column(store, b->table, b->slot, c));
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
 * are read side by side and merged.  fn gets each record's operation,
 * whether it is pending, expires_at and forget_at (0: none).  For
 * statistics: nothing here waits or locks, and responses are not read.
 */
void
idem_store_scan_role(IdemStore *store, Oid role, IdemRecordCallback fn, void *arg)
{
	ScanKeyData skey[1];
	RoleScan	rs[IDEM_NUM_TABLES];

	ScanKeyInit(&skey[0], 1, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(role));
	for (int t = 0; t < store->ntables; t++)
	{
		need_table(store, t);
		rs[t].table = t;
		rs[t].valid = false;
		rs[t].scan = NULL;
		if (store->heap[t] == NULL)
			continue;			/* hidden during recovery */
		rs[t].slot = table_slot_create(store->heap[t], NULL);
		rs[t].scan = idem_index_beginscan(store->heap[t], store->index[t],
										  GetActiveSnapshot(), 1, 0);
		index_rescan(rs[t].scan, skey, 1, NULL, 0);
		role_scan_next(&rs[t]);
	}

	for (;;)
	{
		RoleScan   *next = NULL;
		bool		pending;
		bool		isnull;
		TimestampTz expires_at;
		Datum		forget_at;
		text	   *operation;

		for (int t = 0; t < store->ntables; t++)
			if (rs[t].valid &&
				(next == NULL || record_cmp(store, &rs[t], next) < 0))
				next = &rs[t];
		if (next == NULL)
			break;

		operation = DatumGetTextPP(required_column(store, next->table, next->slot, IDEM_COL_OPERATION));
		(void) column(store, next->table, next->slot, IDEM_COL_COMPLETED_AT, &pending);
		expires_at = DatumGetTimestampTz(required_column(store, next->table, next->slot, IDEM_COL_EXPIRES_AT));
		forget_at = column(store, next->table, next->slot, IDEM_COL_FORGET_AT, &isnull);
		fn(arg, operation, pending, expires_at,
		   isnull ? 0 : DatumGetTimestampTz(forget_at));
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
