/*-------------------------------------------------------------------------
 *
 * storage.c
 *	  Direct access to the record table, its primary key and the token
 *	  sequence.
 *
 * The core functions read and write idem_record with the heap and index
 * access methods, not SQL: no parsing or planning per call, no privilege
 * checks on a table PUBLIC cannot touch, and -- what SQL cannot give --
 * a look at the newest version of a record through a dirty snapshot,
 * which tells whether another transaction is inserting or changing it
 * right now and which transaction to wait for.
 *
 * This file knows the table's shape; claim.c decides what to do with a
 * record.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/index.h"
#include "catalog/namespace.h"
#include "catalog/pg_collation_d.h"
#include "commands/sequence.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "nodes/execnodes.h"
#include "replication/syncrep.h"
#include "replication/walsender.h"
#include "replication/walsender_private.h"
#include "storage/bufmgr.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "idempotency.h"

/* Column numbers of idem_record; see the install script */
#define Anum_role_id		1
#define Anum_operation		2
#define Anum_key			3
#define Anum_token			4
#define Anum_fingerprint	5
#define Anum_ttl			6
#define Anum_created_at		7
#define Anum_completed_at	8
#define Anum_expires_at		9
#define Anum_response		10
#define Natts_record		10

/*
 * OIDs of the extension's objects, looked up once per backend.  A relcache
 * invalidation of one of them (DROP EXTENSION, ALTER EXTENSION UPDATE)
 * forgets them.
 */
static IndexInfo *record_index_info = NULL;	/* in CacheMemoryContext */
static Oid	record_relid = InvalidOid;
static Oid	record_indexid = InvalidOid;
static Oid	token_seqid = InvalidOid;
static Oid	epoch_seqid = InvalidOid;	/* InvalidOid before version 1.2 */

static void
forget_relids(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == record_relid ||
		relid == record_indexid || relid == token_seqid ||
		relid == epoch_seqid)
	{
		record_relid = record_indexid = token_seqid = epoch_seqid = InvalidOid;
		if (record_index_info != NULL)
			pfree(record_index_info);
		record_index_info = NULL;
	}
}

void
idem_store_init(void)
{
	CacheRegisterRelcacheCallback(forget_relids, (Datum) 0);
}

/* The token epochs' sequence in schema nsp: InvalidOid before version 1.2 */
static Oid
epoch_seq_in(Oid nsp)
{
	return get_relname_relid("idem_token_epoch", nsp);
}

/*
 * Find the extension's objects in the schema of the calling function: the
 * extension is not relocatable, so they always live side by side.
 */
static void
lookup_relids(Oid fn_oid)
{
	Oid			nsp = get_func_namespace(fn_oid);
	Oid			relid,
				indexid,
				seqid;

	relid = get_relname_relid("idem_record", nsp);
	indexid = get_relname_relid("idem_record_pkey", nsp);
	seqid = get_relname_relid("idem_token_seq", nsp);
	if (!OidIsValid(relid) || !OidIsValid(indexid) || !OidIsValid(seqid))
		elog(ERROR, "idempotency: record table not found in schema \"%s\"",
			 get_namespace_name(nsp));

	epoch_seqid = epoch_seq_in(nsp);
	token_seqid = seqid;
	record_indexid = indexid;
	record_relid = relid;
}

Oid
idem_store_relid(Oid fn_oid)
{
	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);
	return record_relid;
}

/*
 * Open the table and its index: RowExclusiveLock to write, AccessShareLock
 * to only read (which also works on a standby).
 */
void
idem_store_open(IdemStore *store, Oid fn_oid, LOCKMODE lockmode)
{
	Oid			relid,
				indexid;

	if (!OidIsValid(record_relid))
		lookup_relids(fn_oid);

	/*
	 * Opening the table processes invalidations, which may reset the cached
	 * OIDs (an ANALYZE of the table does): use copies.
	 */
	relid = record_relid;
	indexid = record_indexid;
	store->token_seq = token_seqid;
	store->epoch_seq = epoch_seqid;

	store->heap = table_open(relid, lockmode);

	/* an unlogged table has no data on a standby: say so, not "no file" */
	if (store->heap->rd_rel->relpersistence == RELPERSISTENCE_UNLOGGED &&
		RecoveryInProgress())
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idempotency records cannot be read during recovery"),
				 errdetail("The record table is unlogged: it is not replicated to standbys."),
				 errhint("Read them on the primary, or make the table logged there with idem_set_logged(true).")));
	store->index = index_open(indexid, lockmode);
}

void
idem_store_close(IdemStore *store)
{
	index_close(store->index, NoLock);
	table_close(store->heap, NoLock);
}

/* The claim this backend inserted last (see idem_store_fetch_claim) */
static struct
{
	Oid			relid;
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
slot_matches_key(TupleTableSlot *slot, const IdemKey *key)
{
	bool		isnull;

	return DatumGetObjectId(slot_getattr(slot, Anum_role_id, &isnull)) == key->role &&
		text_equal(slot_getattr(slot, Anum_operation, &isnull), key->operation) &&
		text_equal(slot_getattr(slot, Anum_key, &isnull), key->key);
}

/*
 * Fill *rec from a version the dirty snapshot accepted, and say who is
 * working on it (see idem_store_fetch).
 */
static void
record_from_slot(IdemStore *store, TupleTableSlot *slot, Snapshot dirty,
				 IdemRecord *rec)
{
	HeapTuple	tuple = ExecFetchSlotHeapTuple(slot, false, NULL);
	TransactionId xmin = HeapTupleHeaderGetXmin(tuple->t_data);
	bool		isnull;
	Datum		d;

	rec->tid = slot->tts_tid;
	rec->uncommitted = TransactionIdIsValid(dirty->xmin);
	rec->busy_xid = rec->uncommitted ? dirty->xmin : dirty->xmax;
	rec->mine = TransactionIdIsCurrentTransactionId(xmin);
	rec->in_snapshot = !IsolationUsesXactSnapshot() || rec->mine ||
		table_tuple_satisfies_snapshot(store->heap, slot, GetActiveSnapshot());

	rec->token = DatumGetInt64(slot_getattr(slot, Anum_token, &isnull));
	d = slot_getattr(slot, Anum_fingerprint, &isnull);
	rec->fingerprint = isnull ? NULL : DatumGetByteaPCopy(d);
	rec->ttl = *DatumGetIntervalP(slot_getattr(slot, Anum_ttl, &isnull));
	rec->created_at = DatumGetTimestampTz(slot_getattr(slot, Anum_created_at, &isnull));
	d = slot_getattr(slot, Anum_completed_at, &isnull);
	rec->completed_at = isnull ? 0 : DatumGetTimestampTz(d);
	rec->expires_at = DatumGetTimestampTz(slot_getattr(slot, Anum_expires_at, &isnull));
	d = slot_getattr(slot, Anum_response, &isnull);
	rec->response = isnull ? NULL : DatumGetJsonbPCopy(d);
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
bool
idem_store_fetch(IdemStore *store, const IdemKey *key, IdemRecord *rec)
{
	SnapshotData dirty;
	ScanKeyData skey[3];
	IndexScanDesc scan;
	TupleTableSlot *slot;
	bool		found = false;

	InitDirtySnapshot(dirty);

	ScanKeyInit(&skey[0], Anum_role_id, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(key->role));
	ScanKeyEntryInitialize(&skey[1], 0, 2, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ,
						   PointerGetDatum(key->operation));
	ScanKeyEntryInitialize(&skey[2], 0, 3, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ,
						   PointerGetDatum(key->key));

	slot = table_slot_create(store->heap, NULL);
	scan = index_beginscan(store->heap, store->index, &dirty, 3, 0);
	index_rescan(scan, skey, 3, NULL, 0);

	/*
	 * At most one version of a key is live at a time (all writers hold the
	 * key lock), so the first tuple the dirty snapshot accepts is the one.
	 */
	found = index_getnext_slot(scan, ForwardScanDirection, slot);
	if (found)
		record_from_slot(store, slot, &dirty, rec);

	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);

	return found;
}

/*
 * Like idem_store_fetch, for the record that token should hold.  The claim
 * this backend made last is usually the one its next idem_finish settles
 * (in-transaction shape): it is read straight from where it was inserted,
 * without descending the index.  Any doubt -- the version was updated or
 * vacuumed away, the slot holds another row -- falls back to the index.
 */
bool
idem_store_fetch_claim(IdemStore *store, const IdemKey *key, int64 token,
					   IdemRecord *rec)
{
	if (token == last_claim.token && key->role == last_claim.role &&
		RelationGetRelid(store->heap) == last_claim.relid)
	{
		SnapshotData dirty;
		TupleTableSlot *slot = table_slot_create(store->heap, NULL);
		bool		found;

		InitDirtySnapshot(dirty);
		found = table_tuple_fetch_row_version(store->heap, &last_claim.tid,
											  &dirty, slot) &&
			slot_matches_key(slot, key);
		if (found)
			record_from_slot(store, slot, &dirty, rec);
		ExecDropSingleTupleTableSlot(slot);
		if (found && rec->token == token)
			return true;
	}
	return idem_store_fetch(store, key, rec);
}

/*
 * Fencing tokens: each greater than every token handed out before it, also
 * across a crash, a fail-over to a synchronous standby, or a dump and
 * restore.
 *
 * A sequence alone does not give that cheaply.  nextval() writes WAL only
 * every 32 values and leaves flushing it to the commit of a transaction
 * that writes WAL -- which a claim on the unlogged table does not -- so a
 * crash can roll the sequence back and hand a token out again, to another
 * attempt at the same key: fencing broken.  Flushing before every claim
 * commits fixes that at the price of a disk flush per 32 claims, which the
 * claims of all sessions end up waiting for.
 *
 * So a token has two parts, epoch << 32 | count:
 *
 *	count	from idem_token_seq, an UNLOGGED sequence: no WAL at all, and
 *			crash recovery (or promotion) resets it to its start, 1.
 *	epoch	from idem_token_epoch, a logged sequence, flushed to disk and
 *			to synchronous standbys before the epoch's first token is used.
 *
 * pg_dump carries the epoch, not the count: a restored database starts a
 * new epoch, above every dumped one (the two could be caught out of step).
 *
 * A count below 2^32 therefore means "no epoch since the last crash".  The
 * first backend to see it, under a lock on idem_token_epoch, takes the next
 * epoch -- greater than every earlier one, and durable -- and moves the
 * count to epoch << 32; a count nearing the end of its epoch does the same.
 * That is one flush per crash or per four billion tokens.  Values drawn
 * while that happens are discarded, never used: tokens need not be dense.
 * A new epoch starts by parking the count at its minimum, -2^63, so draws
 * made while it waits stay unusable; between the draw that crosses
 * TOKEN_COUNT_LIMIT and the parking, each backend draws at most twice: the
 * 2^24 values to spare cannot run out.
 *
 * Versions before 1.2 have a logged idem_token_seq and no epochs: there a
 * claim's commit is made synchronous, which flushes the sequence's WAL.
 */
#define TOKEN_COUNT_BITS	32
#define TOKEN_COUNT_MASK	((INT64CONST(1) << TOKEN_COUNT_BITS) - 1)
#define TOKEN_COUNT_LIMIT	(TOKEN_COUNT_MASK - (INT64CONST(1) << 24))

static inline bool
token_in_epoch(int64 value)
{
	return (value >> TOKEN_COUNT_BITS) > 0 &&
		(value & TOKEN_COUNT_MASK) < TOKEN_COUNT_LIMIT;
}

/* The LSN of the newest WAL record of a sequence: its page's LSN */
static XLogRecPtr
sequence_lsn(Oid seqid)
{
	Relation	seq = relation_open(seqid, AccessShareLock);
	Buffer		buf = ReadBuffer(seq, 0);
	XLogRecPtr	lsn;

	LockBuffer(buf, BUFFER_LOCK_SHARE);
	lsn = PageGetLSN(BufferGetPage(buf));
	UnlockReleaseBuffer(buf);
	relation_close(seq, NoLock);
	return lsn;
}

/* Run setval(count sequence, value) as the sequence's owner */
static void
set_count(Oid seqid, int64 value, bool is_called)
{
	Relation	seq = relation_open(seqid, AccessShareLock);
	Oid			owner = seq->rd_rel->relowner;
	Oid			save_userid;
	int			save_sec_context;

	relation_close(seq, NoLock);

	/* setval() checks for UPDATE on the sequence; the caller need not have it */
	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(owner,
						   save_sec_context | SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	DirectFunctionCall3(setval3_oid, ObjectIdGetDatum(seqid),
						Int64GetDatum(value), BoolGetDatum(is_called));
	SetUserIdAndSecContext(save_userid, save_sec_context);
}

/*
 * Wait until the synchronous standbys, if any, have flushed WAL up to lsn,
 * as a synchronous commit would -- whatever this session's
 * synchronous_commit says: an epoch serves every session.  A wait cut
 * short (cancel, statement_timeout) is an error here, not the warning a
 * commit gets: the epoch must not be used.
 *
 * Whether it was cut short is read off the standbys' confirmed flush
 * position, with synchronous_standby_names as this backend sees it (only
 * while a reload is under way can that differ from what the wait used).
 */
static void
wait_for_sync_standbys(XLogRecPtr lsn)
{
	int			nestlevel = NewGUCNestLevel();
	XLogRecPtr	confirmed;

	(void) set_config_option("synchronous_commit", "on", PGC_USERSET,
							 PGC_S_SESSION, GUC_ACTION_SAVE, true, 0, false);
	HOLD_INTERRUPTS();
	SyncRepWaitForLSN(lsn, false);
	RESUME_INTERRUPTS();
	AtEOXact_GUC(true, nestlevel);

	if (max_wal_senders == 0 || SyncRepStandbyNames == NULL ||
		SyncRepStandbyNames[0] == '\0')
		return;
	LWLockAcquire(SyncRepLock, LW_SHARED);
	confirmed = WalSndCtl->lsn[SYNC_REP_WAIT_FLUSH];
	LWLockRelease(SyncRepLock);
	if (confirmed < lsn)
		ereport(ERROR,
				(errcode(ERRCODE_QUERY_CANCELED),
				 errmsg("canceled waiting for synchronous standbys to confirm a new idempotency token epoch"),
				 errdetail("No token was handed out.")));
	CHECK_FOR_INTERRUPTS();
}

/*
 * Take the next epoch, make it durable, and move the count to its start.
 * The caller holds the epoch lock.
 */
static void
start_epoch(IdemStore *store)
{
	int64		epoch;
	XLogRecPtr	lsn;

	/*
	 * Park the count at its minimum, far below zero, first: while this
	 * waits (for the disk, for a standby), calls keep drawing from it, and
	 * those draws must stay unusable however many there are.
	 */
	set_count(store->token_seq, PG_INT64_MIN, false);

	epoch = nextval_internal(store->epoch_seq, false);
	if (epoch >= (INT64CONST(1) << (63 - TOKEN_COUNT_BITS)))
		ereport(ERROR,
				(errcode(ERRCODE_SEQUENCE_GENERATOR_LIMIT_EXCEEDED),
				 errmsg("idempotency token epochs are exhausted")));

	/* the WAL that covers this epoch; done at once if nextval did not log */
	lsn = sequence_lsn(store->epoch_seq);
	XLogFlush(lsn);
	wait_for_sync_standbys(lsn);

	set_count(store->token_seq, epoch << TOKEN_COUNT_BITS, true);
}

int64
idem_store_next_token(IdemStore *store)
{
	int64		value;

	if (!OidIsValid(store->epoch_seq))
	{
		/*
		 * Before 1.2 -- unless an update to 1.2 committed after we looked:
		 * lock the sequence as nextval() would, which also takes in that
		 * update's invalidations, and look again.
		 */
		LockRelationOid(store->token_seq, RowExclusiveLock);
		store->epoch_seq = epoch_seq_in(get_rel_namespace(store->token_seq));
	}
	if (!OidIsValid(store->epoch_seq))
	{
		/* a logged sequence, flushed by a synchronous commit */
		ForceSyncCommit();
		return nextval_internal(store->token_seq, false);
	}

	for (;;)
	{
		value = nextval_internal(store->token_seq, false);
		if (token_in_epoch(value))
			return value;

		LockRelationOid(store->epoch_seq, ShareUpdateExclusiveLock);
		value = nextval_internal(store->token_seq, false);
		if (!token_in_epoch(value))
			start_epoch(store);
		UnlockRelationOid(store->epoch_seq, ShareUpdateExclusiveLock);
		if (token_in_epoch(value))
			return value;
	}
}

static HeapTuple
form_record(IdemStore *store, const IdemKey *key, const IdemRecord *rec)
{
	Datum		values[Natts_record];
	bool		nulls[Natts_record];

	memset(nulls, false, sizeof(nulls));
	values[Anum_role_id - 1] = ObjectIdGetDatum(key->role);
	values[Anum_operation - 1] = PointerGetDatum(key->operation);
	values[Anum_key - 1] = PointerGetDatum(key->key);
	values[Anum_token - 1] = Int64GetDatum(rec->token);
	values[Anum_fingerprint - 1] = PointerGetDatum(rec->fingerprint);
	nulls[Anum_fingerprint - 1] = (rec->fingerprint == NULL);
	values[Anum_ttl - 1] = IntervalPGetDatum(&rec->ttl);
	values[Anum_created_at - 1] = TimestampTzGetDatum(rec->created_at);
	values[Anum_completed_at - 1] = TimestampTzGetDatum(rec->completed_at);
	nulls[Anum_completed_at - 1] = (rec->response == NULL);
	values[Anum_expires_at - 1] = TimestampTzGetDatum(rec->expires_at);
	values[Anum_response - 1] = JsonbPGetDatum(rec->response);
	nulls[Anum_response - 1] = (rec->response == NULL);

	return heap_form_tuple(RelationGetDescr(store->heap), values, nulls);
}

static void
insert_index_entry(IdemStore *store, const IdemKey *key, HeapTuple tuple)
{
	Datum		values[3];
	bool		nulls[3] = {false, false, false};

	/* built once per backend: the index never changes shape */
	if (record_index_info == NULL)
	{
		MemoryContext oldcxt = MemoryContextSwitchTo(CacheMemoryContext);

		record_index_info = BuildIndexInfo(store->index);
		MemoryContextSwitchTo(oldcxt);
	}

	values[0] = ObjectIdGetDatum(key->role);
	values[1] = PointerGetDatum(key->operation);
	values[2] = PointerGetDatum(key->key);

	/*
	 * The key lock already keeps two live versions of a key from existing;
	 * the unique check is a second line of defence that costs one probe of a
	 * page we just read.
	 */
	index_insert(store->index, values, nulls, &tuple->t_self, store->heap,
				 UNIQUE_CHECK_YES, false, record_index_info);
}

/*
 * Each write is followed by CommandCounterIncrement so that a later call
 * in the same statement -- idem_finish on a claim idem_begin made in the
 * same SELECT -- sees and may update it.
 */
void
idem_store_insert(IdemStore *store, const IdemKey *key, const IdemRecord *rec)
{
	HeapTuple	tuple = form_record(store, key, rec);

	heap_insert(store->heap, tuple, GetCurrentCommandId(true), 0, NULL);
	insert_index_entry(store, key, tuple);

	last_claim.relid = RelationGetRelid(store->heap);
	last_claim.role = key->role;
	last_claim.token = rec->token;
	last_claim.tid = tuple->t_self;

	heap_freetuple(tuple);
	CommandCounterIncrement();
}

/*
 * Replace the version rec->tid with rec's values.  A concurrent writer
 * (idem_purge, say) is waited for; if it changed or deleted the version
 * the result says so and nothing is written.
 */
TM_Result
idem_store_update(IdemStore *store, const IdemKey *key, const IdemRecord *rec)
{
	HeapTuple	tuple = form_record(store, key, rec);
	ItemPointerData otid = rec->tid;
	TM_FailureData tmfd;
	LockTupleMode lockmode;
	TM_Result	result;

	result = heap_update(store->heap, &otid, tuple, GetCurrentCommandId(true),
						 InvalidSnapshot, true, &tmfd, &lockmode);
	if (result == TM_Ok)
	{
		if (!HeapTupleIsHeapOnly(tuple))
			insert_index_entry(store, key, tuple);
		CommandCounterIncrement();
	}
	else if (result == TM_Invisible || result == TM_SelfModified)
		elog(ERROR, "idempotency: record version not updatable (%d)", result);
	heap_freetuple(tuple);
	return result;
}

TM_Result
idem_store_delete(IdemStore *store, const IdemRecord *rec)
{
	ItemPointerData tid = rec->tid;
	TM_FailureData tmfd;
	TM_Result	result;

	result = heap_delete(store->heap, &tid, GetCurrentCommandId(true),
						 InvalidSnapshot, true, &tmfd, false);
	if (result == TM_Ok)
		CommandCounterIncrement();
	else if (result == TM_Invisible || result == TM_SelfModified)
		elog(ERROR, "idempotency: record version not deletable (%d)", result);
	return result;
}

/*
 * Call fn for every committed record of one role, in (operation, key)
 * order, as the active snapshot sees them.  For statistics: nothing here
 * waits or locks, and responses are not read.
 */
void
idem_store_scan_role(IdemStore *store, Oid role, IdemRecordCallback fn, void *arg)
{
	ScanKeyData skey[1];
	IndexScanDesc scan;
	TupleTableSlot *slot;

	ScanKeyInit(&skey[0], Anum_role_id, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(role));
	slot = table_slot_create(store->heap, NULL);
	scan = index_beginscan(store->heap, store->index, GetActiveSnapshot(), 1, 0);
	index_rescan(scan, skey, 1, NULL, 0);

	while (index_getnext_slot(scan, ForwardScanDirection, slot))
	{
		bool		isnull;
		bool		pending;
		TimestampTz expires_at;
		text	   *operation;

		operation = DatumGetTextPP(slot_getattr(slot, Anum_operation, &isnull));
		(void) slot_getattr(slot, Anum_completed_at, &pending);
		expires_at = DatumGetTimestampTz(slot_getattr(slot, Anum_expires_at, &isnull));
		fn(arg, operation, pending, expires_at);
	}

	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
}
