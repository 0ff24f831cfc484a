/*-------------------------------------------------------------------------
 *
 * tokens.c
 *	  Fencing tokens: each greater than every token handed out before it in
 *	  the database.
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
 * An epoch is also never below the clock: the number of seconds since
 * 2020-01-01 when it starts.  DROP EXTENSION takes the epoch sequence with
 * it, and the next CREATE EXTENSION starts over; the clock carries the order
 * across.  Tokens of a reinstalled extension are greater than the old ones
 * as long as the old installation's epochs did not run ahead of the clock
 * and the clock was not set back.  An epoch starts once per crash, restore
 * or four billion tokens, and a crash moves the epoch up to 33 ahead (a
 * sequence logs 32 values in advance): so, on average since 2020, fewer than
 * one crash per 33 seconds.
 *
 * Versions before 1.2 have a logged idem_token_seq and no epochs: there a
 * claim's commit is made synchronous, which flushes the sequence's WAL.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/relation.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "commands/sequence.h"
#include "miscadmin.h"
#include "replication/syncrep.h"
#include "replication/walsender.h"
#include "replication/walsender_private.h"
#include "storage/bufmgr.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "utils/fmgrprotos.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/timestamp.h"
#include "pgstat.h"

#include "idempotency.h"

#define TOKEN_COUNT_BITS	32
#define TOKEN_COUNT_MASK	((INT64CONST(1) << TOKEN_COUNT_BITS) - 1)
#define TOKEN_COUNT_LIMIT	(TOKEN_COUNT_MASK - (INT64CONST(1) << 24))
/* epoch << TOKEN_COUNT_BITS must stay within int8 */
#define TOKEN_EPOCH_LIMIT	(INT64CONST(1) << (63 - TOKEN_COUNT_BITS))
/* 2020-01-01 00:00 UTC in seconds since the PostgreSQL epoch, 2000-01-01 */
#define EPOCH_CLOCK_ORIGIN	(INT64CONST(7305) * SECS_PER_DAY)

static inline bool
token_in_epoch(int64 value)
{
	return (value >> TOKEN_COUNT_BITS) > 0 &&
		(value & TOKEN_COUNT_MASK) < TOKEN_COUNT_LIMIT;
}

/* The lowest epoch the clock allows now */
static int64
epoch_clock_floor(void)
{
	int64		secs = GetCurrentTimestamp() / USECS_PER_SEC - EPOCH_CLOCK_ORIGIN;

	return Max(secs, 1);
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
						 10L, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
}

/*
 * Take the next epoch, make it durable, and move the count to its start.
 * The caller holds the epoch lock.
 */
static void
start_epoch(IdemStore *store)
{
	int64		epoch;
	int64		floor;
	XLogRecPtr	lsn;

	/*
	 * Park the count at its minimum, far below zero, first: while this
	 * waits (for the disk, for a standby), calls keep drawing from it, and
	 * those draws must stay unusable however many there are.
	 */
	set_sequence(store->token_seq, PG_INT64_MIN, false);

	epoch = nextval_internal(store->epoch_seq, false);
	floor = epoch_clock_floor();
	if (epoch < floor)
	{
		set_sequence(store->epoch_seq, floor, true);
		epoch = floor;
	}
	if (epoch >= TOKEN_EPOCH_LIMIT)
		ereport(ERROR,
				(errcode(ERRCODE_SEQUENCE_GENERATOR_LIMIT_EXCEEDED),
				 errmsg("idempotency token epochs are exhausted")));

	/* the WAL that covers this epoch; done at once if nextval did not log */
	lsn = sequence_lsn(store->epoch_seq);
	XLogFlush(lsn);
	wait_for_sync_standbys(lsn);

	set_sequence(store->token_seq, epoch << TOKEN_COUNT_BITS, true);
}

int64
idem_next_token(IdemStore *store)
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
		store->epoch_seq = idem_store_member(store, "idem_token_epoch");
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
