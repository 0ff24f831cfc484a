/*-------------------------------------------------------------------------
 *
 * shape.c
 *	  The record tables' shape: where each of the extension's columns is,
 *	  checked against what the code relies on, and cached.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/stratnum.h"
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
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "idempotency.h"
#include "shape.h"
#include "store.h"
#include "pg_compat.h"

/*
 * The shapes of the tables opened so far (see check_shape), each kept while
 * its relcache entry is: any ALTER TABLE, index change or rewrite of the
 * table invalidates it.  One entry per table, and per shard of it on a
 * Citus node with distributed records.
 */
typedef struct ShapeEntry
{
	Oid			relid;			/* the hash key */
	IdemShape	shape;
} ShapeEntry;

static HTAB *shapes = NULL;

/* A relcache invalidation of relid (InvalidOid: of all): idempotency.c */
void
idem_shape_forget(Oid relid)
{
	HASH_SEQ_STATUS seq;
	ShapeEntry *entry;

	if (shapes == NULL)
		return;
	if (OidIsValid(relid))
	{
		(void) hash_search(shapes, &relid, HASH_REMOVE, NULL);
		return;
	}
	hash_seq_init(&seq, shapes);
	while ((entry = hash_seq_search(&seq)) != NULL)
		(void) hash_search(shapes, &entry->relid, HASH_REMOVE, NULL);
}

void
idem_shape_init(void)
{
	HASHCTL		ctl;

	ctl.keysize = sizeof(Oid);
	ctl.entrysize = sizeof(ShapeEntry);
	shapes = hash_create("idempotency table shapes", 16, &ctl,
						 HASH_ELEM | HASH_BLOBS);
}

/*
 * The columns the code reads and writes, by name.  A DBA may add columns
 * (a write fills them with their default, or NULL, and an update keeps
 * them), but not drop, retype or rename these.  role_id may also be an
 * oid, as in the oldest schemas the library serves, or a name, as
 * distributed records have it (a role's OID differs from node to node).
 */
static const struct
{
	const char *name;
	Oid			type;
	Oid			old_type;		/* also accepted */
	Oid			name_type;		/* also accepted */
}			columns[IDEM_NUM_COLUMNS] = {
	[IDEM_COL_ROLE_ID] = {"role_id", REGROLEOID, OIDOID, NAMEOID},
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

/* The name of one of the extension's columns */
const char *
idem_shape_column_name(IdemColumn c)
{
	return columns[c].name;
}

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
 * The tenant of colocated records: a column "tenant" that is the last of
 * the primary key's four
 */
static bool
take_tenant(Relation pkey, Form_pg_attribute att, IdemShape *shape)
{
	if (strcmp(NameStr(att->attname), "tenant") != 0 ||
		IndexRelationGetNumberOfKeyAttributes(pkey) != 4 ||
		pkey->rd_index->indkey.values[3] != att->attnum)
		return false;
	shape->tenant = att->attnum;
	shape->tenant_type = att->atttypid;
	shape->tenant_collation = att->attcollation;
	shape->tenant_typlen = att->attlen;
	shape->tenant_byval = att->attbyval;
	return true;
}

/* Our column c, at att: of its type, and where it is */
static void
take_column(Relation heap, Form_pg_attribute att, int c, IdemShape *shape)
{
	if (att->atttypid != columns[c].type && att->atttypid != columns[c].old_type &&
		(columns[c].name_type == InvalidOid || att->atttypid != columns[c].name_type))
		shape_error(heap, psprintf("Column \"%s\" has type %s, not %s.",
								   NameStr(att->attname),
								   format_type_be(att->atttypid),
								   format_type_be(columns[c].type)));
	shape->attnum[c] = att->attnum;
	if (c == IDEM_COL_ROLE_ID && att->atttypid == NAMEOID)
	{
		if (att->attcollation != C_COLLATION_OID)
			shape_error(heap, "Column \"role_id\" is a name without collation \"C\".");
		shape->role_by_name = true;
	}
	if (att->attnum != c + 1)
		shape->exact = false;
}

/*
 * Every column: each of ours there, with its type (the base ones always,
 * the claim columns all or none), and a write able to fill the DBA's
 */
static void
check_columns(Relation heap, Relation pkey, IdemShape *shape)
{
	TupleDesc	desc = RelationGetDescr(heap);
	int			ours = 0;
	int			claim_columns = 0;

	for (int i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute att = TupleDescAttr(desc, i);
		int			c;

		if (att->attisdropped || take_tenant(pkey, att, shape))
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
		take_column(heap, att, c, shape);
		ours++;
		if (c >= IDEM_NUM_BASE_COLUMNS)
			claim_columns++;
	}
	for (int c = 0; c < IDEM_NUM_BASE_COLUMNS; c++)
		if (shape->attnum[c] == InvalidAttrNumber)
			shape_error(heap, psprintf("Column \"%s\" is missing.", columns[c].name));
	if (claim_columns != 0 && claim_columns != IDEM_NUM_COLUMNS - IDEM_NUM_BASE_COLUMNS)
		shape_error(heap, "Some of the columns holder, checkpoint, takeovers and forget_at are missing.");
	shape->has_claim_columns = (claim_columns != 0);
	if (ours != desc->natts)
		shape->exact = false;
}

/* The primary key fetch_in descends, on (role_id, operation, key [, tenant]) */
static void
check_pkey(Relation heap, Relation pkey, IdemShape *shape)
{
	if (pkey->rd_rel->relam != BTREE_AM_OID ||
		IndexRelationGetNumberOfKeyAttributes(pkey) != (shape->tenant ? 4 : 3) ||
		pkey->rd_index->indkey.values[0] != shape->attnum[IDEM_COL_ROLE_ID] ||
		pkey->rd_index->indkey.values[1] != shape->attnum[IDEM_COL_OPERATION] ||
		pkey->rd_index->indkey.values[2] != shape->attnum[IDEM_COL_KEY] ||
		pkey->rd_indcollation[1] != C_COLLATION_OID ||
		pkey->rd_indcollation[2] != C_COLLATION_OID)
		shape_error(heap, psprintf("Its primary key \"%s\" is not a btree on (role_id, operation, key) with collation \"C\".",
								   RelationGetRelationName(pkey)));
	if (shape->tenant != InvalidAttrNumber)
	{
		Oid			eq = get_opfamily_member(pkey->rd_opfamily[3], shape->tenant_type,
											 shape->tenant_type, BTEqualStrategyNumber);

		if (!OidIsValid(eq) || pkey->rd_indcollation[3] != shape->tenant_collation)
			shape_error(heap, psprintf("Its primary key \"%s\" does not compare column \"tenant\" as the column's type and collation do.",
									   RelationGetRelationName(pkey)));
		shape->tenant_eq = get_opcode(eq);
	}
	shape->pkey = RelationGetRelid(pkey);
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
	memset(shape, 0, sizeof(*shape));
	shape->exact = true;
	if (heap->rd_rel->relkind != RELKIND_RELATION)
		shape_error(heap, "It is not a plain table.");
	check_columns(heap, pkey, shape);
	check_pkey(heap, pkey, shape);
}

/*
 * Open the primary key of heap, one of the record tables (or a shard of
 * one), and learn the table's shape.
 */
Relation
idem_shape_open(Relation heap, LOCKMODE lockmode, IdemShape *shape)
{
	Relation	index;
	Oid			relid = RelationGetRelid(heap);
	Oid			pkey;
	ShapeEntry *entry = hash_search(shapes, &relid, HASH_FIND, NULL);

	if (entry != NULL)
	{
		*shape = entry->shape;
		return index_open(shape->pkey, lockmode);
	}

	if (heap->rd_rel->relkind != RELKIND_RELATION)
		shape_error(heap, "It is not a plain table.");
	pkey = idem_primary_key_index(heap);
	if (!OidIsValid(pkey))
		shape_error(heap, "It has no primary key: restore the primary key on (role_id, operation, key).");
	index = index_open(pkey, lockmode);
	check_shape(heap, index, shape);
	/* opening the index may have processed an invalidation of the table */
	entry = hash_search(shapes, &relid, HASH_ENTER, NULL);
	entry->shape = *shape;
	return index;
}
