/*-------------------------------------------------------------------------
 *
 * citus_tokens.c
 *	  Fencing tokens across the nodes of a Citus cluster.
 *
 * A node draws a key's tokens from its own
 * sequences (tokens.c), and those of two nodes are unrelated: after a
 * shard moves, its keys' next tokens come from another node's counter,
 * which may be behind the one that issued their earlier tokens -- and a
 * key whose record was deleted (idem_abort, idem_forget, the purge) has
 * no record whose token the next claim could go above.  So before a node
 * issues a token for a shard that came to it since it last looked, it
 * starts an epoch above the epoch of every other node of the cluster
 * (idem_citus_other_epochs): every token a node issued before that is
 * below the new epoch's first.
 *
 * "Came since it last looked": the placement's row on this node was
 * written (by the move's switch, after the source node issued its last
 * token for the shard) by a transaction not older than the transaction
 * counter's value when the node last began to read the epochs.  The node
 * keeps that value in shared memory, per database (and each backend its
 * own, which is enough without shared memory); it reads the epochs again
 * after a restart, and when the value is a billion transactions old.
 *
 * A dump of the coordinator carries its epoch sequence, not the workers'.
 * So a worker raises the coordinator's epoch sequence to each epoch it
 * starts, before it issues the epoch's first token
 * (idem_citus_record_epoch): the coordinator's epoch is then at or above
 * every epoch the cluster has used, and a cluster restored from its dump,
 * whose nodes read the coordinator's epoch before their first token for a
 * shard, issues tokens above every dumped one -- also for a key whose
 * record was deleted before the dump.  A worker therefore starts an epoch
 * (after a restart, for a shard that came to it, every 32 million tokens)
 * only while the coordinator can be reached.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/relation.h"
#include "access/transam.h"
#include "access/xlog.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lock.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"

#include "citus.h"
#include "citus_tokens.h"

#define SYNC_SLOTS 16
#define SYNC_MAX_AGE (UINT64CONST(1) << 30)

typedef struct TokenSync
{
	slock_t		mutex;
	Oid			database[SYNC_SLOTS];
	FullTransactionId synced[SYNC_SLOTS];
} TokenSync;

static TokenSync *token_sync = NULL;
static FullTransactionId backend_synced = {0};
static shmem_request_hook_type prev_shmem_request = NULL;
static shmem_startup_hook_type prev_shmem_startup = NULL;

static void
token_sync_request(void)
{
	if (prev_shmem_request != NULL)
		prev_shmem_request();
	RequestAddinShmemSpace(MAXALIGN(sizeof(TokenSync)));
}

static void
token_sync_startup(void)
{
	bool		found;

	if (prev_shmem_startup != NULL)
		prev_shmem_startup();
	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	token_sync = ShmemInitStruct("idempotency token sync", sizeof(TokenSync), &found);
	if (!found)
	{
		memset(token_sync, 0, sizeof(TokenSync));
		SpinLockInit(&token_sync->mutex);
	}
	LWLockRelease(AddinShmemInitLock);
}

/* When this node (or backend) began its last read of every node's epochs, for this database */
static FullTransactionId
last_synced(void)
{
	FullTransactionId synced = backend_synced;

	if (token_sync != NULL)
	{
		SpinLockAcquire(&token_sync->mutex);
		for (int i = 0; i < SYNC_SLOTS; i++)
			if (token_sync->database[i] == MyDatabaseId &&
				FullTransactionIdFollows(token_sync->synced[i], synced))
				synced = token_sync->synced[i];
		SpinLockRelease(&token_sync->mutex);
	}
	return synced;
}

/* The read of every node's epochs that began at before is done */
void
idem_citus_tokens_synced(FullTransactionId before)
{
	if (FullTransactionIdFollows(before, backend_synced))
		backend_synced = before;
	if (token_sync == NULL)
		return;
	SpinLockAcquire(&token_sync->mutex);
	for (int i = 0; i < SYNC_SLOTS; i++)
	{
		if (token_sync->database[i] == MyDatabaseId || token_sync->database[i] == InvalidOid)
		{
			token_sync->database[i] = MyDatabaseId;
			if (FullTransactionIdFollows(before, token_sync->synced[i]))
				token_sync->synced[i] = before;
			break;
		}
	}
	SpinLockRelease(&token_sync->mutex);
}

/* Must a token for the key's shard (idem_citus_route's *locked) wait for a read of every node's epoch? */
bool
idem_citus_tokens_need_sync(const IdemObjects *objects, int64 shardid)
{
	RouteCache *rc = idem_citus_layout(objects);
	FullTransactionId synced = last_synced();
	FullTransactionId next = ReadNextFullTransactionId();

	if (rc == NULL || !rc->distributed)
		return false;
	if (!FullTransactionIdIsValid(synced) ||
		U64FromFullTransactionId(next) - U64FromFullTransactionId(synced) > SYNC_MAX_AGE)
		return true;
	for (int i = 0; i < rc->nshards; i++)
	{
		TransactionId xmin = rc->shards[i].placed_xmin;

		if (rc->shards[i].shardid != shardid)
			continue;
		return TransactionIdIsNormal(xmin) &&
			!TransactionIdPrecedes(xmin, XidFromFullTransactionId(synced));
	}
	return true;
}

/* A node's answer to a command run on it through Citus (run_on_nodes) */
typedef struct NodeAnswer
{
	bool		success;
	char	   *result;			/* NULL: none */
} NodeAnswer;

/*
 * The schema-qualified name of the sequence seqid, for a command run on
 * the other nodes, and its owner, who runs it there
 */
static char *
sequence_name(Oid seqid, Oid *owner)
{
	Relation	seq = relation_open(seqid, AccessShareLock);
	char	   *name = quote_qualified_identifier(get_namespace_name(RelationGetNamespace(seq)),
												  RelationGetRelationName(seq));

	*owner = seq->rd_rel->relowner;
	relation_close(seq, NoLock);
	return name;
}

/*
 * Run command on Citus nodes through Citus's function runner
 * (run_command_on_all_nodes, run_command_on_coordinator), as owner, over
 * Citus's connections: the nodes' answers, a list of NodeAnswer
 */
static List *
run_on_nodes(const char *runner, const char *command, Oid owner, bool read_only)
{
	MemoryContext caller = CurrentMemoryContext;
	char	   *query = psprintf("SELECT n.success, n.result FROM pg_catalog.%s(%s) n",
								 runner, quote_literal_cstr(command));
	Oid			save_userid;
	int			save_sec_context;
	List	   *answers = NIL;

	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(owner, save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	PG_TRY();
	{
		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "SPI_connect failed");
		if (SPI_execute(query, read_only, 0) != SPI_OK_SELECT)
			elog(ERROR, "could not run a command on the Citus nodes through %s", runner);
		for (uint64 i = 0; i < SPI_processed; i++)
		{
			HeapTuple	tuple = SPI_tuptable->vals[i];
			TupleDesc	desc = SPI_tuptable->tupdesc;
			MemoryContext spi = MemoryContextSwitchTo(caller);
			NodeAnswer *answer = palloc(sizeof(NodeAnswer));
			bool		isnull;

			answer->success = DatumGetBool(SPI_getbinval(tuple, desc, 1, &isnull));
			answer->result = SPI_getvalue(tuple, desc, 2);
			answers = lappend(answers, answer);
			MemoryContextSwitchTo(spi);
		}
		SPI_finish();
	}
	PG_FINALLY();
	{
		SetUserIdAndSecContext(save_userid, save_sec_context);
	}
	PG_END_TRY();
	return answers;
}

/*
 * The greatest epoch recorded in epoch_seq (its last value, bits of the
 * epoch only: mask) on the other nodes of the cluster, 0 if none; as the
 * sequence's owner, the extension's, over Citus's connections to every
 * node.  Refused (08006) if a node cannot be read: its epoch might be the
 * greatest.
 */
int64
idem_citus_other_epochs(Oid epoch_seq, int64 mask)
{
	Oid			owner;
	char	   *name = sequence_name(epoch_seq, &owner);
	int64		self = (int64) GetSystemIdentifier();
	int64		greatest = 0;
	List	   *answers;
	ListCell   *lc;

	answers = run_on_nodes("run_command_on_all_nodes",
						   psprintf("SELECT (SELECT system_identifier FROM pg_catalog.pg_control_system()) "
									"OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) last_value FROM %s",
									name),
						   owner, true);
	foreach(lc, answers)
	{
		NodeAnswer *answer = lfirst(lc);
		char	   *colon = answer->result != NULL ? strchr(answer->result, ':') : NULL;
		int64		node;
		int64		epoch;

		if (!answer->success || colon == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_CONNECTION_FAILURE),
					 errmsg("could not read the fencing token epoch of every Citus node"),
					 errdetail("A node answered: %s", answer->result != NULL ? answer->result : "(nothing)"),
					 errhint("A node that holds a shard that came to it since it last read them reads every node's epoch before it issues a token; retry when every node is up.")));
		*colon = '\0';
		node = pg_strtoint64(answer->result);
		epoch = pg_strtoint64(colon + 1) & mask;
		if (node != self && epoch > greatest)
			greatest = epoch;
	}
	return greatest;
}

/*
 * The lock (pg_advisory_xact_lock's, by a bigint) under which an epoch
 * sequence is raised to another node's epoch, and under which a node with
 * distributed records starts an epoch of its own: the raise reads the
 * sequence, then sets it.
 */
#define EPOCH_RAISE_LOCK	INT64CONST(0x494B45706F636801)

/*
 * Take (lock) or give back EPOCH_RAISE_LOCK, around the start of an epoch
 * on a node with distributed records
 */
void
idem_citus_lock_epochs(bool lock)
{
	LOCKTAG		tag;

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) (EPOCH_RAISE_LOCK >> 32),
						 (uint32) EPOCH_RAISE_LOCK, 1);
	if (lock)
		(void) LockAcquire(&tag, ExclusiveLock, false, false);
	else
		LockRelease(&tag, ExclusiveLock, false);
}

/*
 * Raise the coordinator's epoch_seq to epoch (epoch_bits wide, below the
 * timeline), which this worker has started and not yet used (see the top); as
 * the sequence's owner, over Citus's connection to the coordinator.  The
 * sequence keeps its timeline (1 where no epoch has set one), so that the
 * coordinator's own next epoch is above it.  Refused (08006) if the
 * coordinator cannot be reached: the epoch is then never used.
 */
void
idem_citus_record_epoch(const IdemObjects *objects, Oid epoch_seq, int64 epoch, int epoch_bits)
{
	int64		mask = (INT64CONST(1) << epoch_bits) - 1;
	RouteCache *rc = idem_citus_layout(objects);
	Oid			owner;
	char	   *name;
	List	   *answers;
	NodeAnswer *answer;

	if (rc == NULL || !rc->distributed || rc->group == CITUS_COORDINATOR_GROUP)
		return;
	name = sequence_name(epoch_seq, &owner);
	answers = run_on_nodes("run_command_on_coordinator",
						   psprintf("DO $idem_epoch$ BEGIN "
									"PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true); "
									"PERFORM pg_advisory_xact_lock(" INT64_FORMAT "); "
									"PERFORM setval(%s, greatest(s.last_value >> %d, 1) << %d | " INT64_FORMAT ", true) "
									"FROM %s s WHERE (s.last_value & " INT64_FORMAT ") < " INT64_FORMAT "; "
									"END $idem_epoch$",
									EPOCH_RAISE_LOCK, quote_literal_cstr(name), epoch_bits, epoch_bits,
									epoch, name, mask, epoch),
						   owner, false);
	answer = list_length(answers) == 1 ? linitial(answers) : NULL;
	if (answer == NULL || !answer->success)
		ereport(ERROR,
				(errcode(ERRCODE_CONNECTION_FAILURE),
				 errmsg("could not record a fencing token epoch on the Citus coordinator"),
				 errdetail("The coordinator answered: %s",
						   answer != NULL && answer->result != NULL ? answer->result : "(nothing)"),
				 errhint("A worker records each epoch it starts on the coordinator, whose dump then carries it; retry when the coordinator is up.")));
}

/*
 * Called from _PG_init where Citus is loaded (first in
 * shared_preload_libraries, as it must be): reserve the token sync's
 * shared memory, when this library is preloaded too
 */
void
idem_citus_tokens_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_shmem_request = shmem_request_hook;
	shmem_request_hook = token_sync_request;
	prev_shmem_startup = shmem_startup_hook;
	shmem_startup_hook = token_sync_startup;
}
