/*-------------------------------------------------------------------------
 *
 * roles.c
 *	  A role's records through ALTER ROLE ... RENAME, DROP OWNED BY and
 *	  DROP ROLE.
 *
 * Records are a role's.  role_id holds the role's OID on one server and
 * with the records on a Citus coordinator, which follows the role through a
 * rename.  Where the records are distributed over a Citus cluster it holds
 * the role's name (a role's OID differs from node to node), and a name is
 * not an identity: after ALTER ROLE bob RENAME TO carol the records named
 * bob would be nobody's -- carol's finished keys new again, a second
 * effect for every retry -- and a role created later as bob would replay
 * them.  So, in the database where the statement runs:
 *
 *	- ALTER ROLE ... RENAME renames the role in the records too, in the same
 *	  transaction: an UPDATE of the tables, which Citus runs on every shard.
 *	  Citus propagates the ALTER ROLE to the other nodes over its own
 *	  connections, where this does nothing more;
 *	- DROP OWNED BY deletes the role's records, as it drops its objects
 *	  (every layout);
 *	- DROP ROLE of a role that still has records there is refused (2BP01),
 *	  as PostgreSQL refuses to drop a role that owns objects: a role created
 *	  later under the freed name can then never find them.
 *
 * On the OID layouts a dropped role's records stay (idem_monitor shows them
 * without a name, pg_dump leaves them out), as they always have.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/skey.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/indexing.h"
#include "catalog/pg_class.h"
#include "catalog/pg_extension.h"
#include "catalog/namespace.h"
#include "catalog/pg_type_d.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "nodes/parsenodes.h"
#include "tcop/utility.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/syscache.h"

#include "citus_route.h"
#include "idempotency.h"
#include "roles.h"

static ProcessUtility_hook_type prev_utility = NULL;

/* The record tables of this database's installation, and how role_id holds a role */
typedef struct RoleTables
{
	Oid			owner;			/* the tables' owner: the statements run as it */
	char	   *tables[2];		/* qualified names; NULL: none */
	bool		by_name;		/* role_id is the role's name */
} RoleTables;

/* The schema of extension ext (extension.c's get_extension_schema is static before 16) */
static Oid
extension_schema(Oid ext)
{
	Relation	rel = table_open(ExtensionRelationId, AccessShareLock);
	ScanKeyData key;
	SysScanDesc scan;
	HeapTuple	tuple;
	Oid			schema = InvalidOid;

	ScanKeyInit(&key, Anum_pg_extension_oid, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(ext));
	scan = systable_beginscan(rel, ExtensionOidIndexId, true, NULL, 1, &key);
	tuple = systable_getnext(scan);
	if (HeapTupleIsValid(tuple))
		schema = ((Form_pg_extension) GETSTRUCT(tuple))->extnamespace;
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return schema;
}

static bool
role_tables(RoleTables *rt)
{
	Oid			ext = get_extension_oid("idempotency", true);
	Oid			schema;
	const char *names[2] = {"idem_record", "idem_result"};

	memset(rt, 0, sizeof(*rt));
	if (!OidIsValid(ext) || creating_extension)
		return false;
	schema = extension_schema(ext);
	for (int i = 0; i < 2; i++)
	{
		Oid			relid = get_relname_relid(names[i], schema);

		if (!OidIsValid(relid))
			continue;
		rt->tables[i] = quote_qualified_identifier(get_namespace_name(schema), names[i]);
		if (i == 0)
		{
			AttrNumber	att = get_attnum(relid, "role_id");

			HeapTuple	tuple = SearchSysCache1(RELOID, ObjectIdGetDatum(relid));

			if (!HeapTupleIsValid(tuple))
				elog(ERROR, "cache lookup failed for relation %u", relid);
			rt->owner = ((Form_pg_class) GETSTRUCT(tuple))->relowner;
			ReleaseSysCache(tuple);
			rt->by_name = att != InvalidAttrNumber &&
				get_atttype(relid, att) == NAMEOID;
		}
	}
	return rt->tables[0] != NULL;
}

/*
 * Run sql, with %s the table and $1 (and $2) of type argtype, on each
 * table, as the tables' owner; returns the rows it returned or changed
 */
static uint64
on_role_records(const RoleTables *rt, const char *sql, Datum *args, Oid argtype,
				int nargs, bool read_only)
{
	Oid			save_userid;
	int			save_sec_context;
	Oid			types[2] = {argtype, argtype};
	volatile uint64 rows = 0;

	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(rt->owner, save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	PG_TRY();
	{
		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "SPI_connect failed");
		for (int i = 0; i < 2; i++)
		{
			int			rc;

			if (rt->tables[i] == NULL)
				continue;
			rc = SPI_execute_with_args(psprintf(sql, rt->tables[i]), nargs, types, args,
									   NULL, read_only, 0);
			if (rc < 0)
				elog(ERROR, "%s failed: %s", sql, SPI_result_code_string(rc));
			rows += SPI_processed;
		}
		SPI_finish();
	}
	PG_FINALLY();
	{
		SetUserIdAndSecContext(save_userid, save_sec_context);
	}
	PG_END_TRY();
	return rows;
}

/* role, as role_id holds it, into *value (a name lives in *buf) */
static Oid
role_value(const RoleTables *rt, Oid role, const char *rolname, NameData *buf, Datum *value)
{
	if (!rt->by_name)
	{
		*value = ObjectIdGetDatum(role);
		return OIDOID;
	}
	namestrcpy(buf, rolname);
	*value = NameGetDatum(buf);
	return NAMEOID;
}

/* Refuse to drop a role that has records in this database (names only) */
static void
check_drop_role(DropRoleStmt *stmt)
{
	RoleTables	rt;
	ListCell   *lc;

	if (!role_tables(&rt) || !rt.by_name)
		return;
	foreach(lc, stmt->roles)
	{
		RoleSpec   *spec = lfirst(lc);
		NameData	buf;
		Datum		value;
		Oid			type;

		if (spec->roletype != ROLESPEC_CSTRING ||
			!OidIsValid(get_role_oid(spec->rolename, true)))
			continue;
		type = role_value(&rt, InvalidOid, spec->rolename, &buf, &value);
		if (on_role_records(&rt, "SELECT FROM %s WHERE role_id OPERATOR(pg_catalog.=) $1 LIMIT 1",
							&value, type, 1, true) > 0)
			ereport(ERROR,
					(errcode(ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST),
					 errmsg("role \"%s\" cannot be dropped because it has idempotency records",
							spec->rolename),
					 errdetail("The records are distributed and know their role by name: a role created later under the same name would replay them."),
					 errhint("Delete them first with DROP OWNED BY %s (in every database with records of the role).",
							 quote_identifier(spec->rolename))));
	}
}

/* DROP OWNED BY: the roles' records go too */
static void
drop_owned_records(DropOwnedStmt *stmt)
{
	RoleTables	rt;
	ListCell   *lc;

	if (!role_tables(&rt))
		return;
	foreach(lc, stmt->roles)
	{
		RoleSpec   *spec = lfirst(lc);
		Oid			role = get_rolespec_oid(spec, true);
		NameData	buf;
		Datum		value;
		Oid			type;

		if (!OidIsValid(role))
			continue;
		type = role_value(&rt, role, GetUserNameFromId(role, false), &buf, &value);
		on_role_records(&rt, "DELETE FROM %s WHERE role_id OPERATOR(pg_catalog.=) $1",
						&value, type, 1, false);
	}
}

/* ALTER ROLE ... RENAME: the records named by the old name get the new one */
static void
rename_records(const char *from, const char *to)
{
	RoleTables	rt;
	NameData	names[2];
	Datum		values[2];

	if (!role_tables(&rt) || !rt.by_name)
		return;
	namestrcpy(&names[0], from);
	namestrcpy(&names[1], to);
	values[0] = NameGetDatum(&names[0]);
	values[1] = NameGetDatum(&names[1]);
	on_role_records(&rt, "UPDATE %s SET role_id = $2 WHERE role_id OPERATOR(pg_catalog.=) $1",
					values, NAMEOID, 2, false);
}

static void
roles_utility(PlannedStmt *pstmt, const char *query_string, bool read_only_tree,
			  ProcessUtilityContext context, ParamListInfo params,
			  QueryEnvironment *query_env, DestReceiver *dest, QueryCompletion *qc)
{
	Node	   *stmt = pstmt->utilityStmt;
	char	   *renamed_from = NULL;
	char	   *renamed_to = NULL;

	/* a statement Citus propagates from another node: that node did it all */
	bool		ours = !idem_citus_internal_backend();

	if (ours && IsA(stmt, DropRoleStmt))
		check_drop_role((DropRoleStmt *) stmt);
	if (ours && IsA(stmt, RenameStmt) && ((RenameStmt *) stmt)->renameType == OBJECT_ROLE)
	{
		renamed_from = pstrdup(((RenameStmt *) stmt)->subname);
		renamed_to = pstrdup(((RenameStmt *) stmt)->newname);
	}

	if (prev_utility != NULL)
		prev_utility(pstmt, query_string, read_only_tree, context, params, query_env,
					 dest, qc);
	else
		standard_ProcessUtility(pstmt, query_string, read_only_tree, context, params,
								query_env, dest, qc);

	if (renamed_from != NULL)
		rename_records(renamed_from, renamed_to);
	if (ours && IsA(stmt, DropOwnedStmt))
		drop_owned_records((DropOwnedStmt *) stmt);
}

/* Called from _PG_init */
void
idem_roles_init(void)
{
	prev_utility = ProcessUtility_hook;
	ProcessUtility_hook = roles_utility;
}
