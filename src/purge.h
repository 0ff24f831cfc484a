/*-------------------------------------------------------------------------
 *
 * purge.h
 *	  Deleting expired records, and the background workers (purge.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_PURGE_H
#define IDEM_PURGE_H

extern void idem_purge_init(void);
PGDLLEXPORT extern void idem_purge_worker_main(Datum arg);

#endif							/* IDEM_PURGE_H */
