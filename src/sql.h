/*-------------------------------------------------------------------------
 *
 * sql.h
 *	  SPI statements on the extension's own tables (sql.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_SQL_H
#define IDEM_SQL_H

extern char *idem_qualified_name(Oid relid);
extern uint64 idem_run_sql(const char *query, int nargs, Oid *argtypes,
						   Datum *args, int expected);

#endif							/* IDEM_SQL_H */
