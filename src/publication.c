/*-------------------------------------------------------------------------
 *
 * publication.c
 *	  The guard against publications that would take the extension's
 *	  tables without naming them.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "commands/event_trigger.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "utils/guc.h"

#include "publication.h"
#include "sql.h"

/* idempotency.publish_records */
static bool publish_records = false;

/*
 * A publication that takes one of the extension's logged tables without
 * naming it -- FOR ALL TABLES, or FOR TABLES IN SCHEMA of the extension's
 * schema -- sends its changes to subscribers that may not have the
 * extension, whose apply worker then stops on the missing table, and every
 * table of the application stops replicating with it.  Refuse that,
 * unless idempotency.publish_records says the subscribers have the
 * extension.
 */
void
idem_check_publications(bool only_this_command)
{
	char	   *pubname;
	char	   *relname;

	if (publish_records)
		return;
	SPI_connect();
	idem_run_sql(psprintf("SELECT pt.pubname::pg_catalog.text, pt.tablename::pg_catalog.text"
			"  FROM pg_catalog.pg_publication_tables pt"
			"  JOIN pg_catalog.pg_publication p ON p.pubname OPERATOR(pg_catalog.=) pt.pubname"
			"  JOIN pg_catalog.pg_namespace n ON n.nspname OPERATOR(pg_catalog.=) pt.schemaname"
			"  JOIN pg_catalog.pg_class c ON c.relnamespace OPERATOR(pg_catalog.=) n.oid"
			"   AND c.relname OPERATOR(pg_catalog.=) pt.tablename"
			"  JOIN pg_catalog.pg_depend d ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass"
			"   AND d.objid OPERATOR(pg_catalog.=) c.oid AND d.deptype OPERATOR(pg_catalog.=) 'e'"
			"  JOIN pg_catalog.pg_extension e ON e.oid OPERATOR(pg_catalog.=) d.refobjid"
			"   AND e.extname OPERATOR(pg_catalog.=) 'idempotency'"
			" WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel pr"
			"                    WHERE pr.prpubid OPERATOR(pg_catalog.=) p.oid"
			"                      AND pr.prrelid OPERATOR(pg_catalog.=) c.oid)"
			"%s ORDER BY 1, 2 LIMIT 1",
			only_this_command ?
			"   AND p.oid OPERATOR(pg_catalog.=) ANY ("
			"       SELECT CASE c.classid"
			"              WHEN 'pg_catalog.pg_publication'::pg_catalog.regclass THEN c.objid"
			"              WHEN 'pg_catalog.pg_publication_rel'::pg_catalog.regclass THEN"
			"                (SELECT prpubid FROM pg_catalog.pg_publication_rel"
			"                  WHERE oid OPERATOR(pg_catalog.=) c.objid)"
			"              WHEN 'pg_catalog.pg_publication_namespace'::pg_catalog.regclass THEN"
			"                (SELECT pnpubid FROM pg_catalog.pg_publication_namespace"
			"                  WHERE oid OPERATOR(pg_catalog.=) c.objid)"
			"              END"
			"         FROM pg_catalog.pg_event_trigger_ddl_commands() c)" : ""),
			0, NULL, NULL, SPI_OK_SELECT);
	if (SPI_processed == 0)
	{
		SPI_finish();
		return;
	}
	pubname = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
	relname = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2);
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("publication \"%s\" would publish the idempotency table \"%s\"",
					pubname, relname),
			 errdetail("A subscriber without the idempotency extension stops applying every table of the publication when it receives a change of this table."),
			 errhint("Publish the application's tables or schemas by name. If every subscriber has the extension installed (a blue-green upgrade), SET idempotency.publish_records = on and run the command again.")));
}

/*
 * idem_publication_guard: event trigger at the end of CREATE/ALTER
 * PUBLICATION: that publication is checked; at the end of ALTER TABLE
 * (which may move a table into a schema published FOR TABLES IN SCHEMA),
 * every publication.  The install and update
 * scripts check every publication (set_durability_and_record).  idem_mode
 * is always logged, so a publication that takes the extension's tables
 * without naming them always takes it: a later durability switch that
 * makes idem_result logged adds no publication to check.
 */
PG_FUNCTION_INFO_V1(idem_publication_guard);

Datum
idem_publication_guard(PG_FUNCTION_ARGS)
{
	EventTriggerData *trigdata = (EventTriggerData *) fcinfo->context;

	if (!CALLED_AS_EVENT_TRIGGER(fcinfo))
		elog(ERROR, "idem_publication_guard must be an event trigger");
	/* ALTER TABLE ... SET SCHEMA may take a table into a published schema */
	idem_check_publications(trigdata->tag != CMDTAG_ALTER_TABLE);
	PG_RETURN_VOID();
}

void
idem_publication_init(void)
{
	DefineCustomBoolVariable("idempotency.publish_records",
							 "Allow publications that take the extension's tables without naming them.",
							 "Set it only when every subscriber has the idempotency extension installed.",
							 &publish_records,
							 false,
							 PGC_USERSET,
							 0,
							 NULL, NULL, NULL);
}

