/*-------------------------------------------------------------------------
 *
 * args.c
 *	  What a call asks for: the arguments of the idem_* functions, checked,
 *	  and the settings that give their defaults.
 *
 * idempotency.in_flight, idempotency.lease, idempotency.ttl,
 * idempotency.takeover and idempotency.remember are the defaults of
 * idem_begin's arguments (an explicit argument always wins);
 * idempotency.max_response_size limits idem_finish's response.
 *
 * Every check raises the SQLSTATE the README's table names: 22004 for a
 * NULL where a value is required, 22023 for an invalid value, 54000 for a
 * response too large; a tenant where the records have none, or none where
 * they have one, is 0A000 (idem_key_check_tenant, which the store and the
 * Citus route call once they know the records' tenant type).
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include <limits.h>

#include "access/xact.h"
#include "common/hashfn.h"
#include "common/int.h"
#include "fmgr.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/typcache.h"

#include "args.h"
#include "idempotency.h"
#include "pg_compat.h"

/* The settings: defaults of the idem_* functions' arguments */
static int	idem_in_flight = IDEM_IN_FLIGHT_WAIT;
static int	idem_lease_ms = 30 * 1000;
static int	idem_ttl_s = 24 * 60 * 60;
static int	idem_max_response_size = 64 * 1024;
static int	idem_takeover = IDEM_TAKEOVER_LEASE;
static int	idem_remember_s = 0;

/* ---- arguments ---- */

/* 22004 when argument argno, called name, is NULL */
void
idem_require_arg(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("argument \"%s\" must not be null", name)));
}

/* An operation or a key: 1 to IDEM_MAX_KEY_CHARS characters */
static text *
name_arg(FunctionCallInfo fcinfo, int argno, const char *name)
{
	text	   *value;
	int			chars;

	idem_require_arg(fcinfo, argno, name);

	value = PG_GETARG_TEXT_PP(argno);
	chars = pg_mbstrlen_with_len(VARDATA_ANY(value), VARSIZE_ANY_EXHDR(value));
	if (chars == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" must not be empty", name)));
	if (chars > IDEM_MAX_KEY_CHARS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" is too long", name),
				 errdetail("It has %d characters; at most %d are allowed.",
						   chars, IDEM_MAX_KEY_CHARS)));
	return value;
}

/*
 * The calling role's key from the arguments: (operation, key), or, in an
 * idem_* function's tenant form, (tenant, operation, key).  Returns the
 * number of the argument after the key.
 */
int
idem_key_from_args(FunctionCallInfo fcinfo, IdemKey *key, bool tenant)
{
	int			a = tenant ? 1 : 0;

	key->role = GetUserId();
	key->has_tenant = tenant;
	key->tenant_type = InvalidOid;
	key->tenant = (Datum) 0;
	if (tenant)
	{
		idem_require_arg(fcinfo, 0, "tenant");
		key->tenant_type = get_fn_expr_argtype(fcinfo->flinfo, 0);
		if (!OidIsValid(key->tenant_type))
			elog(ERROR, "the type of argument \"tenant\" is unknown");
		key->tenant = PG_GETARG_DATUM(0);
	}
	key->operation = name_arg(fcinfo, a, "operation");
	key->key = name_arg(fcinfo, a + 1, "key");
	idem_key_hash(key);
	return a + 2;
}

/*
 * key->hash, which names the key's locks, from the role, operation and key,
 * and the tenant's hash (by its type's hash function: a tenant equal to
 * another hashes alike) if it has one
 */
void
idem_key_hash(IdemKey *key)
{
	uint64		h;

	/* unambiguous: a length always precedes the variable parts */
	h = hash_bytes_uint32_extended(key->role,
								   VARSIZE_ANY_EXHDR(key->operation));
	h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(key->operation),
							VARSIZE_ANY_EXHDR(key->operation), h);
	h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(key->key),
							VARSIZE_ANY_EXHDR(key->key), h);
	if (key->has_tenant)
	{
		TypeCacheEntry *type = lookup_type_cache(key->tenant_type,
												 TYPECACHE_HASH_EXTENDED_PROC_FINFO);

		if (OidIsValid(type->hash_extended_proc_finfo.fn_oid))
			h = DatumGetUInt64(FunctionCall2Coll(&type->hash_extended_proc_finfo,
												 type->typcollation, key->tenant,
												 UInt64GetDatum(h)));
	}
	key->hash = h;
}

/*
 * A key names its tenant exactly where the records have one, of their
 * tenant's type (InvalidOid: they have none): records colocated with a
 * tenant's table are told apart by it, and a call without it could not
 * find the right one.
 */
void
idem_key_check_tenant(const IdemKey *key, Oid tenant_type)
{
	if (OidIsValid(tenant_type) && !key->has_tenant)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idempotency records are colocated with a tenant's table: the call must name the tenant"),
				 errdetail("Records are told apart by tenant, operation and key."),
				 errhint("Call the tenant form, with the tenant first: idem_begin(tenant, operation, key, ...).")));
	if (!OidIsValid(tenant_type) && key->has_tenant)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idempotency records have no tenant"),
				 errdetail("They are not colocated with a tenant's table."),
				 errhint("Call the idem_* functions without a tenant.")));
	if (key->has_tenant && key->tenant_type != tenant_type)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("idempotency tenant of type %s given, the records' tenant is of type %s",
						format_type_be(key->tenant_type), format_type_be(tenant_type))));
}

int64
idem_token_arg(FunctionCallInfo fcinfo, int argno)
{
	idem_require_arg(fcinfo, argno, "token");
	return PG_GETARG_INT64(argno);
}

/* A fingerprint, NULL or at most IDEM_MAX_FINGERPRINT_BYTES */
bytea *
idem_fingerprint_arg(FunctionCallInfo fcinfo, int argno)
{
	bytea	   *fingerprint;

	if (PG_ARGISNULL(argno))
		return NULL;
	fingerprint = PG_GETARG_BYTEA_PP(argno);
	if (VARSIZE_ANY_EXHDR(fingerprint) > IDEM_MAX_FINGERPRINT_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" is too long", "fingerprint"),
				 errdetail("It has %zu bytes; at most %d are allowed.",
						   (Size) VARSIZE_ANY_EXHDR(fingerprint),
						   IDEM_MAX_FINGERPRINT_BYTES),
				 errhint("Pass a hash of the request, such as idem_fingerprint(...).")));
	return fingerprint;
}

/*
 * An interval as microseconds, months counted as 30 days as interval
 * comparison does.  Out-of-range values are an invalid argument, not an
 * overflow deep inside timestamp arithmetic.
 */
int64
idem_interval_usecs(const Interval *iv, const char *name)
{
	int64		usecs;
	int64		days = (int64) iv->month * DAYS_PER_MONTH + iv->day;

	if (pg_mul_s64_overflow(days, USECS_PER_DAY, &usecs) ||
		pg_add_s64_overflow(usecs, iv->time, &usecs))
		usecs = (days > 0 || (days == 0 && iv->time > 0)) ? PG_INT64_MAX : PG_INT64_MIN;

	if (usecs > IDEM_MAX_INTERVAL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("argument \"%s\" is too long", name),
				 errdetail("At most %d days are allowed.", IDEM_MAX_INTERVAL_DAYS)));
	return usecs;
}

IdemInFlightPolicy
idem_policy_arg(FunctionCallInfo fcinfo, int argno)
{
	char	   *name;

	if (PG_ARGISNULL(argno))
		return (IdemInFlightPolicy) idem_in_flight;

	name = text_to_cstring(PG_GETARG_TEXT_PP(argno));
	/* case-insensitive, as the setting idempotency.in_flight is */
	if (pg_strcasecmp(name, "wait") == 0)
		return IDEM_IN_FLIGHT_WAIT;
	if (pg_strcasecmp(name, "raise") == 0)
		return IDEM_IN_FLIGHT_RAISE;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("unknown in_flight policy \"%s\"", name),
			 errhint("Use 'wait' or 'raise'.")));
	pg_unreachable();
}

/*
 * idem_begin's takeover (NULL, or argno -1 for a definition without the
 * argument: idempotency.takeover)
 */
IdemTakeover
idem_takeover_arg(FunctionCallInfo fcinfo, int argno)
{
	char	   *name;

	if (argno < 0 || PG_ARGISNULL(argno))
		return (IdemTakeover) idem_takeover;

	name = text_to_cstring(PG_GETARG_TEXT_PP(argno));
	if (pg_strcasecmp(name, "lease") == 0)
		return IDEM_TAKEOVER_LEASE;
	if (pg_strcasecmp(name, "session") == 0)
		return IDEM_TAKEOVER_SESSION;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("unknown takeover policy \"%s\"", name),
			 errhint("Use 'lease' or 'session'.")));
	pg_unreachable();
}

/* idem_begin's lease, in microseconds (NULL: idempotency.lease) */
int64
idem_lease_arg(FunctionCallInfo fcinfo, int argno)
{
	if (PG_ARGISNULL(argno))
		return (int64) idem_lease_ms * 1000;
	return idem_interval_usecs(PG_GETARG_INTERVAL_P(argno), "lease");
}

/* idem_begin's ttl (NULL: idempotency.ttl) */
Interval
idem_ttl_arg(FunctionCallInfo fcinfo, int argno)
{
	Interval	ttl;

	if (!PG_ARGISNULL(argno))
		return *PG_GETARG_INTERVAL_P(argno);
	memset(&ttl, 0, sizeof(ttl));
	ttl.time = (int64) idem_ttl_s * USECS_PER_SEC;
	return ttl;
}

/*
 * idem_begin's remember, in microseconds, 0 for off (NULL, or argno -1 for
 * a definition without the argument: idempotency.remember)
 */
int64
idem_remember_arg(FunctionCallInfo fcinfo, int argno)
{
	int64		usecs;

	if (argno < 0 || PG_ARGISNULL(argno))
		return (int64) idem_remember_s * USECS_PER_SEC;
	usecs = idem_interval_usecs(PG_GETARG_INTERVAL_P(argno), "remember");
	if (usecs < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency remember must not be negative")));
	return usecs;
}

/* ---- responses and checkpoints ---- */

static void
response_too_large(const char *name, bool as_text, Size size)
{
	ereport(ERROR,
			(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
			 errmsg("idempotency %s is too large", name),
			 as_text ?
			 errdetail("Its text form takes %zu bytes; idempotency.max_response_size is %d bytes.",
					   size, idem_max_response_size) :
			 errdetail("The %s takes %zu bytes; idempotency.max_response_size is %d bytes.",
					   name, size, idem_max_response_size),
			 strcmp(name, "state") == 0 ?
			 errhint("Keep the state elsewhere and checkpoint a reference to it.") :
			 errhint("Store the response elsewhere and finish with a reference to it.")));
}

/*
 * A response, which must always be replayable: both its stored form and its
 * text form, which is what a replay sends, must fit
 * idempotency.max_response_size.  The text form can be far larger than the
 * stored one (a control character takes six characters, a number such as
 * 1e100000 a hundred thousand digits); the setting's maximum keeps it, even
 * quoted inside a row, well below PostgreSQL's 1 GB limit for one value.
 */
Jsonb *
idem_response_arg(FunctionCallInfo fcinfo, int argno, const char *name)
{
	Jsonb	   *response;
	char	   *text;

	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("argument \"%s\" must not be null", name),
				 strcmp(name, "response") == 0 ?
				 errhint("Use idem_abort to release a claim without a result.") : 0));
	response = PG_GETARG_JSONB_P(argno);

	if (VARSIZE(response) > (Size) idem_max_response_size)
		response_too_large(name, false, VARSIZE(response));
	text = JsonbToCString(NULL, &response->root, VARSIZE(response));
	if (strlen(text) > (Size) idem_max_response_size)
		response_too_large(name, true, strlen(text));
	pfree(text);
	return response;
}

/* ---- settings ---- */

/*
 * The library belongs in shared_preload_libraries or
 * session_preload_libraries (the README says so): then every SET is checked
 * when it is made.  A value given before the library is loaded
 * (postgresql.conf, ALTER ROLE ... SET, or a SET in a session that has not
 * called an idem_* function yet) is a placeholder that PostgreSQL checks only
 * when the library defines the setting, and an invalid one then becomes a
 * WARNING and the default.  Running with another policy than the one asked
 * for is worse than failing: while such a value would be in effect, every
 * call fails with 22023.  It stops being in effect when the setting is
 * assigned again (SET or RESET), or when what gave it ends: a SET LOCAL or
 * a function's SET clause with its transaction or function, a SET made in
 * a transaction (or a savepoint) that rolls back with the rollback.
 * PostgreSQL keeps no trace of a rejected value, so that scope is taken
 * from the placeholder's own stack of values when the library loads, and
 * followed here.
 */
typedef enum InvalidScope
{
	SCOPE_SESSION,				/* until assigned again */
	SCOPE_SET,					/* a SET: undone by a rollback of its level */
	SCOPE_LOCAL,				/* a SET LOCAL: ends with its transaction */
	SCOPE_FUNCTION				/* a function's SET clause: ends with the call */
} InvalidScope;

typedef struct CheckedSetting
{
	const char *name;
	char	   *placeholder;	/* its value before the library was loaded */
	InvalidScope scope;			/* where that value came from */
	int			level;			/* ... the nesting level that gave it */
	char	   *invalid_value;	/* that value, while invalid and in effect */
} CheckedSetting;

enum
{
	CHECKED_IN_FLIGHT,
	CHECKED_LEASE,
	CHECKED_TTL,
	CHECKED_MAX_RESPONSE_SIZE,
	CHECKED_TAKEOVER,
	CHECKED_REMEMBER,
	NUM_CHECKED_SETTINGS
};

static CheckedSetting checked[NUM_CHECKED_SETTINGS] = {
	{"idempotency.in_flight"},
	{"idempotency.lease"},
	{"idempotency.ttl"},
	{"idempotency.max_response_size"},
	{"idempotency.takeover"},
	{"idempotency.remember"},
};

/* true while idem_args_init defines the settings */
static bool defining = false;

/*
 * A value was assigned: whatever was given before no longer counts.
 * (Defining a setting assigns its default and then the placeholder's value
 * if valid: that does not count.)
 */
static void
forget_placeholder(int i)
{
	if (!defining)
	{
		checked[i].invalid_value = NULL;
		checked[i].scope = SCOPE_SESSION;
	}
}

static void
assign_in_flight(int newval, void *extra)
{
	forget_placeholder(CHECKED_IN_FLIGHT);
}

static void
assign_lease(int newval, void *extra)
{
	forget_placeholder(CHECKED_LEASE);
}

static void
assign_ttl(int newval, void *extra)
{
	forget_placeholder(CHECKED_TTL);
}

static void
assign_max_response_size(int newval, void *extra)
{
	forget_placeholder(CHECKED_MAX_RESPONSE_SIZE);
}

static void
assign_takeover(int newval, void *extra)
{
	forget_placeholder(CHECKED_TAKEOVER);
}

static void
assign_remember(int newval, void *extra)
{
	forget_placeholder(CHECKED_REMEMBER);
}

/* The GUC nesting level now (PostgreSQL has no call that reads it) */
static int
current_guc_level(void)
{
	int			level = NewGUCNestLevel();

	AtEOXact_GUC(true, level);
	return level - 1;
}

void
idem_check_settings(void)
{
	for (int i = 0; i < NUM_CHECKED_SETTINGS; i++)
	{
		CheckedSetting *c = &checked[i];

		if (c->invalid_value != NULL && c->scope == SCOPE_FUNCTION &&
			current_guc_level() < c->level)
			c->invalid_value = NULL;	/* the function has returned */
		if (c->invalid_value != NULL)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("invalid value for parameter \"%s\": \"%s\"",
							c->name, c->invalid_value),
					 errdetail("The value was given before the idempotency library was loaded, so it could not be checked when it was given."),
					 errhint("Set a valid value or RESET the parameter. Load the library with session_preload_libraries so that values are checked when they are set.")));
	}
}

/*
 * The end of a transaction: a value given in it is undone by a rollback,
 * and ends at a commit unless a plain SET gave it.
 */
static void
settings_xact_callback(XactEvent event, void *arg)
{
	bool		commit = (event == XACT_EVENT_COMMIT ||
						  event == XACT_EVENT_PARALLEL_COMMIT ||
						  event == XACT_EVENT_PREPARE);

	if (!commit && event != XACT_EVENT_ABORT && event != XACT_EVENT_PARALLEL_ABORT)
		return;
	for (int i = 0; i < NUM_CHECKED_SETTINGS; i++)
	{
		CheckedSetting *c = &checked[i];

		if (c->scope == SCOPE_SESSION)
			continue;
		if (commit && c->scope == SCOPE_SET)
			c->scope = SCOPE_SESSION;	/* it stays, as the session's value */
		else
			c->invalid_value = NULL;
		if (c->invalid_value == NULL)
			c->scope = SCOPE_SESSION;
	}
}

/*
 * The end of a savepoint's level: a rollback undoes what it gave; a
 * release hands it to the level around.
 */
static void
settings_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
						  SubTransactionId parentSubid, void *arg)
{
	int			level = GetCurrentTransactionNestLevel();

	if (event != SUBXACT_EVENT_ABORT_SUB && event != SUBXACT_EVENT_COMMIT_SUB)
		return;
	for (int i = 0; i < NUM_CHECKED_SETTINGS; i++)
	{
		CheckedSetting *c = &checked[i];

		if (c->scope == SCOPE_SESSION || c->level < level)
			continue;
		if (event == SUBXACT_EVENT_ABORT_SUB)
		{
			c->invalid_value = NULL;
			c->scope = SCOPE_SESSION;
		}
		else
			c->level = level - 1;
	}
}

/*
 * Before the settings are defined: the placeholders' values, and which
 * action gave each (the top of its stack; none: the session's own value).
 * PostgreSQL applies each when it defines the setting, or warns and keeps
 * the default.
 */
static void
remember_placeholders(void)
{
	for (int i = 0; i < NUM_CHECKED_SETTINGS; i++)
	{
		CheckedSetting *c = &checked[i];
		const char *value = GetConfigOption(c->name, true, false);
		struct config_generic *gconf = idem_find_setting(c->name);
		GucStack   *top = gconf != NULL ? gconf->stack : NULL;

		c->scope = SCOPE_SESSION;
		if (value == NULL)
			continue;
		c->placeholder = MemoryContextStrdup(TopMemoryContext, value);
		if (top == NULL)
			continue;
		c->level = top->nest_level;
		c->scope = top->state == GUC_SAVE ? SCOPE_FUNCTION :
			top->state == GUC_SET ? SCOPE_SET : SCOPE_LOCAL;
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
	RegisterXactCallback(settings_xact_callback, NULL);
	RegisterSubXactCallback(settings_subxact_callback, NULL);
}

static const struct config_enum_entry in_flight_options[] = {
	{"wait", IDEM_IN_FLIGHT_WAIT, false},
	{"raise", IDEM_IN_FLIGHT_RAISE, false},
	{NULL, 0, false}
};

static const struct config_enum_entry takeover_options[] = {
	{"lease", IDEM_TAKEOVER_LEASE, false},
	{"session", IDEM_TAKEOVER_SESSION, false},
	{NULL, 0, false}
};

/*
 * Define the settings of this part; called from _PG_init.  Placeholders
 * given before are remembered first and checked after (see above).
 */
void
idem_args_init(void)
{
	remember_placeholders();
	defining = true;

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

	DefineCustomEnumVariable("idempotency.takeover",
							 "When a committed claim that was not finished may be taken over.",
							 "lease: when its lease lapses; session: also as soon as the "
							 "session that made it ends.",
							 &idem_takeover,
							 IDEM_TAKEOVER_LEASE,
							 takeover_options,
							 PGC_USERSET,
							 0,
							 NULL, assign_takeover, NULL);

	DefineCustomIntVariable("idempotency.remember",
							"Default time a completed key is remembered, from its completion.",
							"Past its ttl the response is gone, but a retry within this time gets "
							"SQLSTATE IK410 instead of running again. 0: off.",
							&idem_remember_s,
							0,
							0,
							INT_MAX,
							PGC_USERSET,
							GUC_UNIT_S,
							NULL, assign_remember, NULL);
	defining = false;

	check_placeholders();
}
