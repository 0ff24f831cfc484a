/*-------------------------------------------------------------------------
 *
 * catalog.h
 *	  The extension's objects and their cache (catalog.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CATALOG_H
#define IDEM_CATALOG_H

/* The extension's objects in the schema of the calling function */
typedef struct IdemObjects
{
	Oid			extension;
	Oid			records;		/* idem_record */
	Oid			results;		/* idem_result; InvalidOid in the oldest schemas */
	Oid			token_seq;		/* idem_token_seq */
	Oid			epoch_seq;		/* idem_token_epoch; InvalidOid in the oldest schemas */
} IdemObjects;

extern void idem_catalog_objects(Oid fn_oid, IdemObjects *objects);
extern Oid	idem_catalog_record_relid(Oid fn_oid);
extern Oid	idem_catalog_result_relid(Oid fn_oid);
extern Oid	idem_catalog_table(Oid fn_oid, const char *name);
extern Oid	idem_catalog_member(Oid extoid, Oid token_seq, const char *name);
extern bool idem_catalog_result_logged(Oid resultid);
extern void idem_catalog_forget(Oid relid);

#endif							/* IDEM_CATALOG_H */
