/*-------------------------------------------------------------------------
 *
 * tokens.c
 *	  Fencing tokens: each greater than every token handed out before it in
 *	  the database -- across crashes, fail-overs and point-in-time recovery.
 *
 * A sequence alone does not give that cheaply.  nextval() writes WAL only
 * every 32 values and leaves flushing it to the commit of a transaction
 * that writes WAL -- which a claim on the unlogged table does not -- so a
 * crash can roll the sequence back and hand a token out again, to another
 * attempt at the same key: fencing broken.  Flushing before every claim
 * commits fixes that at the price of a disk flush per 32 claims, which the
 * claims of all sessions end up waiting for.
 *
 * So a token has two parts, epoch << 25 | count:
 *
 *	count	from idem_token_seq, an UNLOGGED sequence: no WAL at all, and
 *			crash recovery (or promotion) resets it to its start, 1.
 *	epoch	recorded in idem_token_epoch, a logged sequence, flushed to disk
 *			and to synchronous standbys before the epoch's first token is
 *			used.
 *
 * A count without an epoch therefore means "no epoch since the last crash".
 * The first backend to see it, under a lock on idem_token_epoch, starts the
 * next epoch and moves the count to epoch << 25; a count nearing the end of
 * its epoch does the same.  That is one flush per crash or per 32 million
 * tokens.  Values drawn while that happens are discarded, never used:
 * tokens need not be dense.  A new epoch starts by parking the count at its
 * minimum, -2^63, so draws made while it waits stay unusable; between the
 * draw that crosses the count's limit and the parking, each backend draws
 * at most twice: the 2^20 values to spare cannot run out.
 *
 * An epoch is band << 22 | serial, and idem_token_epoch holds the last one
 * with the timeline it was started on: timeline << 38 | band << 22 | serial.
 *
 *	serial	one more than the last epoch's.
 *	band	the last epoch's, plus the number of timelines since it.
 *
 * A standby that is promoted, or a point-in-time recovery, continues on a
 * new timeline, greater than every timeline of the history it branches
 * from (PostgreSQL picks one above every timeline in the WAL archive).  The
 * band minus the timeline is the same for every epoch of one history, so
 * the new timeline's first epoch is in a greater band than every epoch the
 * old primary started after the branch -- which a lagging asynchronous
 * standby never saw, however many there were.  A timeline that goes down,
 * as it does where pg_dump's output is restored into another cluster or
 * after pg_upgrade, leaves the band as it is.  Within a band the serial
 * orders epochs.  The serial never starts over: it allows 4 million
 * epochs -- crashes, or 32 million tokens each, 10^14 tokens in all --
 * and 65535 bands hold the days until 2199 and the timelines on top.
 *
 * pg_dump carries the epoch, not the count: a restored database starts a
 * new epoch, above every dumped one.
 *
 * On a Citus cluster with distributed records each node has its own
 * sequences; a node that serves a shard that came to it from another
 * starts an epoch above every other node's first (sync_with_citus), and a
 * worker records each epoch it starts on the coordinator, whose dump
 * carries it (citus_tokens.c).
 *
 * Timeline numbers belong to one cluster.  A dump restored into another
 * cluster, or pg_upgrade's new cluster, starts over on its own timelines,
 * which may be lower than those recorded -- and a standby of that cluster,
 * promoted before it saw the cluster's first epoch, would compare its own
 * timeline with the recorded one and pick the band its primary picked.
 * So idem_token_cluster records the system identifier of the cluster
 * that started the last epoch.  An epoch recorded by another cluster (or
 * in a schema without idem_token_cluster) starts a
 * new history: the band goes
 * up by the whole current timeline, whatever the recorded one was.  A
 * promoted standby shares its primary's identifier and has a greater
 * timeline: its band is above its primary's again.
 *
 * The first epoch of an installation starts from the clock: band = days
 * since 2020-01-01 UTC (plus the timeline, as above), serial = the second of
 * that day.  DROP EXTENSION takes the epoch sequence with it, and the next
 * CREATE EXTENSION starts over; the clock carries the order across (README,
 * "Reinstalling", gives the exact limit).  A value not written by a
 * timeline epoch (timeline 0) -- a new installation's, or the plain epoch
 * number of the 32-bit layout below, updated or restored from a dump -- is
 * such a start, above every token of that layout.
 *
 * An idem_token_epoch whose maximum leaves no room for a timeline (the
 * 32-bit layout) keeps its tokens epoch << 32 | count, the epoch from
 * nextval().  A schema without idem_token_epoch has a logged
 * idem_token_seq and no epochs: there a claim's commit is made
 * synchronous, which flushes the sequence's WAL.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/htup_details.h"
#include "access/relation.h"
#include "access/transam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/pg_sequence.h"
#include "commands/sequence.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "replication/syncrep.h"
#include "replication/walsender.h"
#include "replication/walsender_private.h"
#include "storage/bufmgr.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "utils/fmgrprotos.h"
#include "utils/rel.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "catalog.h"
#include "citus_tokens.h"
#include "idempotency.h"
#include "locks.h"
#include "store.h"
#include "tokens.h"

/* a token: epoch << COUNT_BITS | count */
#define COUNT_BITS			25
#define COUNT_BITS_V12		32	/* the 32-bit layout: no timeline in the epoch */
#define COUNT_SPARE			(INT64CONST(1) << 20)

/* an epoch: band << SERIAL_BITS | serial; idem_token_epoch adds the timeline */
#define SERIAL_BITS			22
#define BAND_BITS			16
#define EPOCH_BITS			(BAND_BITS + SERIAL_BITS)
#define FIELD_MAX(bits)		((INT64CONST(1) << (bits)) - 1)
#define TIMELINE_MAX		FIELD_MAX(63 - EPOCH_BITS)

/* 2020-01-01 00:00 UTC in seconds since the PostgreSQL epoch, 2000-01-01 */
#define CLOCK_ORIGIN		(INT64CONST(7305) * SECS_PER_DAY)

StaticAssertDecl(COUNT_BITS + EPOCH_BITS == 63, "a token is a positive int8");

static inline bool
token_in_epoch(int64 value, int count_bits)
{
	return (value >> count_bits) > 0 &&
		(value & FIELD_MAX(count_bits)) < FIELD_MAX(count_bits) - COUNT_SPARE;
}

/*
 * How tokens are laid out in this installation: an idem_token_epoch whose
 * maximum leaves no room for a timeline has the 32-bit layout.
 */
static int
count_bits(IdemStore *store)
{
	HeapTuple	tup = SearchSysCache1(SEQRELID, ObjectIdGetDatum(store->epoch_seq));
	int64		seqmax;

	if (!HeapTupleIsValid(tup))
		elog(ERROR, "cache lookup failed for sequence %u",
			 store->epoch_seq);
	seqmax = ((Form_pg_sequence) GETSTRUCT(tup))->seqmax;
	ReleaseSysCache(tup);
	return seqmax > PG_INT32_MAX ? COUNT_BITS : COUNT_BITS_V12;
}

/*
 * A sequence's last value (whether or not nextval has been called since it
 * was set), and the LSN of its newest WAL record: its page's LSN.
 */
static int64
read_sequence(Oid seqid, XLogRecPtr *lsn)
{
	Relation	seq = relation_open(seqid, AccessShareLock);
	Buffer		buf = ReadBuffer(seq, 0);
	Page		page;
	HeapTupleHeader tup;
	int64		value;

	LockBuffer(buf, BUFFER_LOCK_SHARE);
	page = BufferGetPage(buf);
	tup = (HeapTupleHeader) PageGetItem(page, PageGetItemId(page, FirstOffsetNumber));
	value = ((Form_pg_sequence_data) ((char *) tup + tup->t_hoff))->last_value;
	*lsn = PageGetLSN(page);
	UnlockReleaseBuffer(buf);
	relation_close(seq, NoLock);
	return value;
}

/* setval(seqid, value, is_called) as the sequence's owner */
static void
set_sequence(Oid seqid, int64 value, bool is_called)
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
 * synchronous_commit says: an epoch serves every session.
 *
 * This is not SyncRepWaitForLSN: a cancel there is a WARNING that the
 * transaction "has already committed locally", which is not true here.
 * Here a cancel or statement_timeout is the usual error, and the epoch is
 * not used.  The walsenders publish the flush position the synchronous
 * standbys confirmed; a new epoch is rare (once per crash), so looking at
 * it every 10 ms costs nothing.
 */
static void
wait_for_sync_standbys(XLogRecPtr lsn)
{
	for (;;)
	{
		XLogRecPtr	confirmed;

		if (max_wal_senders == 0 || SyncRepStandbyNames == NULL ||
			SyncRepStandbyNames[0] == '\0')
			return;
		LWLockAcquire(SyncRepLock, LW_SHARED);
		confirmed = WalSndCtl->lsn[SYNC_REP_WAIT_FLUSH];
		LWLockRelease(SyncRepLock);
		if (confirmed >= lsn)
			return;

		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 10L, idem_wait_event(IDEM_WAIT_TOKEN_SYNC_REP));
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
}

static void
epochs_exhausted(const char *what)
{
	ereport(ERROR,
			(errcode(ERRCODE_SEQUENCE_GENERATOR_LIMIT_EXCEEDED),
			 errmsg("idempotency token epochs are exhausted"),
			 errdetail("The %s has reached its limit.", what)));
}

/*
 * The epoch after the one idem_token_epoch holds, recorded there with the
 * current timeline (and in idem_token_cluster, if the installation has
 * it, with the cluster).
 */
static int64
next_epoch(Oid seqid, Oid cluster_seqid, int64 min_epoch)
{
	XLogRecPtr	lsn;
	int64		last = read_sequence(seqid, &lsn);
	int64		cluster = (int64) GetSystemIdentifier();
	bool		other_cluster = OidIsValid(cluster_seqid) &&
		read_sequence(cluster_seqid, &lsn) != cluster;
	int64		last_timeline = last >> EPOCH_BITS;
	int64		band = (last >> SERIAL_BITS) & FIELD_MAX(BAND_BITS);
	int64		serial = last & FIELD_MAX(SERIAL_BITS);
	int64		timeline = GetWALInsertionTimeLine();

	if (last_timeline == 0)
	{
		/*
		 * The installation's first epoch: from the clock, and above every
		 * token of the 32-bit layout if last is its epoch number (its tokens
		 * are below (last + 1) << 32).  The band goes up by the timeline below.
		 */
		int64		secs = GetCurrentTimestamp() / USECS_PER_SEC - CLOCK_ORIGIN;

		secs = Max(secs, 0);
		band = Max(secs / SECS_PER_DAY,
				   ((last + 1) >> (COUNT_BITS + SERIAL_BITS - COUNT_BITS_V12)) + 1);
		serial = secs % SECS_PER_DAY;
	}
	if (other_cluster && last_timeline != 0)
		band += timeline;		/* a new history: see the file header */
	else if (timeline > last_timeline)
		band += timeline - last_timeline;
	serial++;
	/* above a token some record already holds (idem_next_token_above) */
	if ((band << SERIAL_BITS | serial) <= min_epoch)
		band = (min_epoch >> SERIAL_BITS) + 1;

	if (timeline > TIMELINE_MAX)
		epochs_exhausted("timeline");
	if (band > FIELD_MAX(BAND_BITS))
		epochs_exhausted("band, counting days since 2020 and timelines,");
	if (serial > FIELD_MAX(SERIAL_BITS))
		epochs_exhausted("number of epochs");

	if (OidIsValid(cluster_seqid))
		set_sequence(cluster_seqid, cluster, true);
	set_sequence(seqid, timeline << EPOCH_BITS | band << SERIAL_BITS | serial, true);
	return band << SERIAL_BITS | serial;
}

/*
 * Start the next epoch, make it durable, and move the count to its start.
 * The caller holds the epoch lock.
 */
static void
start_epoch(IdemStore *store, int bits, int64 min_epoch)
{
	int64		epoch;
	XLogRecPtr	lsn;

	/*
	 * Park the count at its minimum, far below zero, first: while this
	 * waits (for the disk, for a standby), calls keep drawing from it, and
	 * those draws must stay unusable however many there are.
	 */
	set_sequence(store->token_seq, PG_INT64_MIN, false);

	/* another node's epoch may be raising this one's (citus_tokens.c) */
	if (store->shard != 0)
		idem_citus_lock_epochs(true);
	if (bits == COUNT_BITS)
		epoch = next_epoch(store->epoch_seq,
						   idem_catalog_member(store->extension, store->token_seq, "idem_token_cluster"),
						   min_epoch);
	else
		epoch = nextval_internal(store->epoch_seq, false);
	if (store->shard != 0)
		idem_citus_lock_epochs(false);

	/* the WAL that covers this epoch; done at once if nextval did not log */
	(void) read_sequence(store->epoch_seq, &lsn);
	XLogFlush(lsn);
	wait_for_sync_standbys(lsn);

	/* a worker's epoch, on the coordinator too, which a dump carries */
	if (store->shard != 0 && bits == COUNT_BITS)
	{
		IdemObjects objects;

		idem_catalog_objects(store->fn_oid, &objects);
		idem_citus_record_epoch(&objects, store->epoch_seq, epoch, EPOCH_BITS);
	}

	set_sequence(store->token_seq, epoch << bits, true);
}

/*
 * Distributed records on Citus: a token for a shard that came to this node
 * since it last looked must be above every token any node issued before (citus.c, "Fencing tokens across nodes"): if another
 * node's epoch is not below this node's, start an epoch above it.
 */
static void
sync_with_citus(IdemStore *store)
{
	IdemObjects objects;
	FullTransactionId before;
	int64		others;
	XLogRecPtr	lsn;

	idem_catalog_objects(store->fn_oid, &objects);
	if (!idem_citus_tokens_need_sync(&objects, store->shard))
		return;
	if (count_bits(store) != COUNT_BITS)
		return;					/* the 32-bit layout has no bands (docs/scaling-out.md) */
	before = ReadNextFullTransactionId();
	others = idem_citus_other_epochs(store->epoch_seq, FIELD_MAX(EPOCH_BITS));

	LockRelationOid(store->epoch_seq, ShareUpdateExclusiveLock);
	if ((read_sequence(store->epoch_seq, &lsn) & FIELD_MAX(EPOCH_BITS)) <= others)
		start_epoch(store, COUNT_BITS, others);
	UnlockRelationOid(store->epoch_seq, ShareUpdateExclusiveLock);
	idem_citus_tokens_synced(before);
}

int64
idem_next_token(IdemStore *store)
{
	int64		value;
	int			bits;

	/* a schema without an epoch sequence -- unless an update added it since */
	if (!OidIsValid(store->epoch_seq))
		idem_store_find_epoch_seq(store);
	if (!OidIsValid(store->epoch_seq))
	{
		/* a logged sequence, flushed by a synchronous commit */
		ForceSyncCommit();
		return nextval_internal(store->token_seq, false);
	}

	if (store->shard != 0)
		sync_with_citus(store);

	for (;;)
	{
		/* the layout after the draw: an update of the layout cannot come between */
		value = nextval_internal(store->token_seq, false);
		bits = count_bits(store);
		if (token_in_epoch(value, bits))
			return value;

		LockRelationOid(store->epoch_seq, ShareUpdateExclusiveLock);
		value = nextval_internal(store->token_seq, false);
		bits = count_bits(store);
		if (!token_in_epoch(value, bits))
			start_epoch(store, bits, 0);
		UnlockRelationOid(store->epoch_seq, ShareUpdateExclusiveLock);
		if (token_in_epoch(value, bits))
			return value;
	}
}

/*
 * A token greater than floor, the token of the record a claim replaces.
 * Tokens of one cluster only grow, but a record can come from another
 * cluster -- restored from a dump, or replicated by logical replication
 * from a publisher whose epochs are ahead -- and must still be fenced off:
 * when the next token is not above it, the next epoch starts above it.
 */
int64
idem_next_token_above(IdemStore *store, int64 floor)
{
	for (;;)
	{
		int64		value = idem_next_token(store);
		int			bits;

		if (value > floor || !OidIsValid(store->epoch_seq))
			return value;
		bits = count_bits(store);
		if (bits != COUNT_BITS)
			return value;		/* the 32-bit layout has no bands */

		LockRelationOid(store->epoch_seq, ShareUpdateExclusiveLock);
		value = nextval_internal(store->token_seq, false);
		if (value <= floor || !token_in_epoch(value, bits))
			start_epoch(store, bits, floor >> COUNT_BITS);
		UnlockRelationOid(store->epoch_seq, ShareUpdateExclusiveLock);
	}
}
