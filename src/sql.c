/*-------------------------------------------------------------------------
 *
 * sql.c
 *	  The statements the extension runs through SPI on its own tables: their
 *	  quoted names and one statement at a time.
 *
 * The administration functions that run SQL (purge, the durability
 * switches, the publication guard) are SECURITY DEFINER with search_path
 * pinned to pg_catalog in the install script, and name the tables fully
 * qualified, so a caller's search_path reaches nothing that runs with the
 * owner's rights.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "executor/spi.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"

#include "sql.h"

/* The schema-qualified, quoted name of a relation */
char *
idem_qualified_name(Oid relid)
{
	return quote_qualified_identifier(get_namespace_name(get_rel_namespace(relid)),
									  get_rel_name(relid));
}

/* Run one statement through SPI, which must return status expected */
uint64
idem_run_sql(const char *query, int nargs, Oid *argtypes, Datum *args, int expected)
{
	int			rc = SPI_execute_with_args(query, nargs, argtypes, args, NULL,
										   false, 0);

	if (rc != expected)
		elog(ERROR, "\"%s\" failed: %s", query,
			 SPI_result_code_string(rc));
	return SPI_processed;
}
