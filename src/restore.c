/*-------------------------------------------------------------------------
 *
 * restore.c
 *	  The triggers that keep the mode and the records whole when a dump is
 *	  restored: idem_mode_restored and idem_settle.
 *
 * pg_dump carries the idem_mode row (the mode; no row: 'completed') and
 * the records; restoring the row switches the restored database to that
 * mode, and records restored into either table are settled where the mode
 * keeps them.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "commands/trigger.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/rel.h"

#include "durability.h"

/*
 * idem_mode_restored: BEFORE INSERT OR UPDATE trigger on idem_mode.  A
 * row written by anything but idem_set_durability -- pg_restore loading a
 * dump, a DBA -- switches to the mode it names.
 */
PG_FUNCTION_INFO_V1(idem_mode_restored);

Datum
idem_mode_restored(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	HeapTuple	row;
	bool		isnull;
	Datum		d;

	if (!CALLED_AS_TRIGGER(fcinfo) || !TRIGGER_FIRED_FOR_ROW(trigdata->tg_event))
		elog(ERROR, "idem_mode_restored must be a row trigger");
	row = TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event) ?
		trigdata->tg_newtuple : trigdata->tg_trigtuple;
	if (idem_durability_switching())
		return PointerGetDatum(row);

	d = heap_getattr(row, 1, RelationGetDescr(trigdata->tg_relation), &isnull);
	if (isnull)
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("durability mode must not be null")));
	idem_durability_restore(fcinfo->flinfo->fn_oid,
							idem_durability_from_name(TextDatumGetCString(d)),
							!TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event));
	return PointerGetDatum(row);
}

/*
 * idem_settle: AFTER INSERT statement trigger on both tables.  Records
 * inserted by SQL -- a dump being restored, from any earlier version and
 * any mode -- are moved to where the current mode keeps them, so that a
 * completed record restored into a database in mode 'completed' is in the
 * logged table.  The idem_* functions' own writes do not fire statement
 * triggers.
 */
PG_FUNCTION_INFO_V1(idem_settle);

Datum
idem_settle(PG_FUNCTION_ARGS)
{
	if (!CALLED_AS_TRIGGER(fcinfo))
		elog(ERROR, "idem_settle must be a trigger");
	if (!idem_durability_switching())
		idem_durability_settle(fcinfo->flinfo->fn_oid);
	return PointerGetDatum(NULL);
}

