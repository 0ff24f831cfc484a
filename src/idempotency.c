/*-------------------------------------------------------------------------
 *
 * idempotency.c
 *	  Module entry point and the idempotency.* settings.
 *
 * in_flight, lease and ttl are defaults for arguments of idem_begin (an
 * explicit argument always wins); max_response_size limits idem_finish;
 * purge_interval, purge_batch_size, purge_delay and databases drive the
 * purge worker.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"
#include "utils/guc.h"
#include "utils/memutils.h"

#include "idempotency.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

int			idem_in_flight = IDEM_IN_FLIGHT_WAIT;
int			idem_lease_ms = 30 * 1000;
int			idem_ttl_s = 24 * 60 * 60;
int			idem_max_response_size = 64 * 1024;
int			idem_purge_interval_s = 60;
int			idem_purge_batch_size = 1000;
int			idem_purge_delay_ms = 10;
char	   *idem_purge_databases = NULL;

/*
 * Settings given before the library was loaded (SET in a session that has
 * not called an idem_* function yet, ALTER ROLE ... SET, postgresql.conf
 * without preloading) are placeholders that PostgreSQL checks only when the
 * library defines them, and an invalid one then becomes a WARNING and the
 * default.  Running with another policy than the one asked for is worse
 * than failing: such a value is remembered here, and every call fails with
 * 22023 until the setting is given a valid value.
 */
typedef struct CheckedSetting
{
	const char *name;
	char	   *placeholder;	/* its value before the library was loaded */
	char	   *invalid_value;	/* that value, if invalid; NULL: valid */
} CheckedSetting;

enum
{
	CHECKED_IN_FLIGHT,
	CHECKED_LEASE,
	CHECKED_TTL,
	CHECKED_MAX_RESPONSE_SIZE,
	NUM_CHECKED_SETTINGS
};

static CheckedSetting checked[NUM_CHECKED_SETTINGS] = {
	{"idempotency.in_flight"},
	{"idempotency.lease"},
	{"idempotency.ttl"},
	{"idempotency.max_response_size"},
};

/* A valid value was assigned: whatever was given before no longer counts */
static void
assign_in_flight(int newval, void *extra)
{
	checked[CHECKED_IN_FLIGHT].invalid_value = NULL;
}

static void
assign_lease(int newval, void *extra)
{
	checked[CHECKED_LEASE].invalid_value = NULL;
}

static void
assign_ttl(int newval, void *extra)
{
	checked[CHECKED_TTL].invalid_value = NULL;
}

static void
assign_max_response_size(int newval, void *extra)
{
	checked[CHECKED_MAX_RESPONSE_SIZE].invalid_value = NULL;
}

void
idem_check_settings(void)
{
	for (int i = 0; i < NUM_CHECKED_SETTINGS; i++)
		if (checked[i].invalid_value != NULL)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("invalid value for parameter \"%s\": \"%s\"",
							checked[i].name, checked[i].invalid_value),
					 errdetail("The value was set before the idempotency library was loaded, so it could not be checked when it was set."),
					 errhint("Set a valid value, or RESET the parameter.")));
}

/* Before the settings are defined: remember the placeholders' values */
static void
remember_placeholders(void)
{
	for (int i = 0; i < NUM_CHECKED_SETTINGS; i++)
	{
		const char *value = GetConfigOption(checked[i].name, true, false);

		if (value != NULL)
			checked[i].placeholder = MemoryContextStrdup(TopMemoryContext, value);
	}
}

/*
 * After: check each placeholder value once more, silently and without
 * applying it (PostgreSQL has applied it already, or warned and used the
 * default).
 */
static void
check_placeholders(void)
{
	for (int i = 0; i < NUM_CHECKED_SETTINGS; i++)
	{
		char	   *value = checked[i].placeholder;

		if (value != NULL &&
			set_config_option(checked[i].name, value, PGC_SUSET, PGC_S_SESSION,
							  GUC_ACTION_SET, false, DEBUG1, false) == 0)
			checked[i].invalid_value = value;
	}
}

static const struct config_enum_entry in_flight_options[] = {
	{"wait", IDEM_IN_FLIGHT_WAIT, false},
	{"raise", IDEM_IN_FLIGHT_RAISE, false},
	{NULL, 0, false}
};

void
_PG_init(void)
{
	remember_placeholders();

	DefineCustomEnumVariable("idempotency.in_flight",
							 "What idem_begin does when another attempt holds the key.",
							 "wait: block until that attempt finishes, aborts or loses its lease; "
							 "raise: fail at once with SQLSTATE IK409.",
							 &idem_in_flight,
							 IDEM_IN_FLIGHT_WAIT,
							 in_flight_options,
							 PGC_USERSET,
							 0,
							 NULL, assign_in_flight, NULL);

	DefineCustomIntVariable("idempotency.lease",
							"Default lease of a claim.",
							"A pending claim whose lease has lapsed counts as absent: "
							"the next request takes the key over.",
							&idem_lease_ms,
							30 * 1000,
							1,
							INT_MAX,
							PGC_USERSET,
							GUC_UNIT_MS,
							NULL, assign_lease, NULL);

	DefineCustomIntVariable("idempotency.ttl",
							"Default retention of a completed record.",
							"At least one minute.",
							&idem_ttl_s,
							24 * 60 * 60,
							60,
							INT_MAX,
							PGC_USERSET,
							GUC_UNIT_S,
							NULL, assign_ttl, NULL);

	DefineCustomIntVariable("idempotency.max_response_size",
							"Largest response idem_finish stores.",
							"Larger responses are refused; store a reference to them instead.",
							&idem_max_response_size,
							64 * 1024,
							1,
							IDEM_MAX_RESPONSE_SIZE,
							PGC_SUSET,
							GUC_UNIT_BYTE,
							NULL, assign_max_response_size, NULL);

	DefineCustomIntVariable("idempotency.purge_interval",
							"Time between runs of the purge worker.",
							"Only used when idempotency is in shared_preload_libraries.",
							&idem_purge_interval_s,
							60,
							1,
							INT_MAX / 1000,
							PGC_SIGHUP,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.purge_batch_size",
							"Records the purge worker deletes per transaction.",
							NULL,
							&idem_purge_batch_size,
							1000,
							1,
							1000000,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.purge_delay",
							"Pause of the purge worker between two full batches.",
							"Spreads the purge of a large backlog so that it does not take a CPU from the load.",
							&idem_purge_delay_ms,
							10,
							0,
							10000,
							PGC_SIGHUP,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	/*
	 * The workers' databases can change only at server start, so that setting
	 * exists only when preloaded -- as do the workers and the shared memory
	 * of the counters.
	 */
	if (process_shared_preload_libraries_in_progress)
		DefineCustomStringVariable("idempotency.databases",
								   "Databases the purge worker keeps clean (comma-separated).",
								   "Only used when idempotency is in shared_preload_libraries.",
								   &idem_purge_databases,
								   "postgres",
								   PGC_POSTMASTER,
								   0,
								   NULL, NULL, NULL);

	MarkGUCPrefixReserved("idempotency");
	check_placeholders();

	idem_store_init();

	if (process_shared_preload_libraries_in_progress)
	{
		idem_stats_shmem_init();
		idem_purge_workers_register();
	}
}
