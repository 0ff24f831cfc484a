/*-------------------------------------------------------------------------
 *
 * reply.c
 *	  What the claim functions answer: idem_begin's row (status, token,
 *	  response), and the errors that refuse a request, each counted
 *	  (counters.c) and worded for the one who reads it: the SQLSTATE for a
 *	  program, the DETAIL for a person.
 *
 *-------------------------------------------------------------------------
 */

#include "postgres.h"

#include "access/htup_details.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"
#include "utils/typcache.h"

#include "counters.h"
#include "read.h"
#include "reply.h"

static const char *const status_names[] = {"new", "replay", "recover"};

/* ---- errors ---- */

/*
 * A fingerprint for a message: hex, whole up to FINGERPRINT_SHOWN_BYTES
 * (a SHA-256 is 32), cut beyond.
 */
#define FINGERPRINT_SHOWN_BYTES	64

static char *
fingerprint_text(const bytea *fp)
{
	Size		len;
	Size		shown;
	char	   *hex;

	if (fp == NULL)
		return "NULL";
	len = VARSIZE_ANY_EXHDR(fp);
	shown = Min(len, FINGERPRINT_SHOWN_BYTES);
	hex = palloc(shown * 2 + 1);
	hex[hex_encode(VARDATA_ANY(fp), shown, hex)] = '\0';
	if (len > shown)
		return psprintf("\\x%s... (%zu bytes)", hex, len);
	return psprintf("\\x%s", hex);
}

/* IK422 for a request whose fingerprint is not the record's */
static void
raise_key_reused(const IdemKey *key, const IdemRecord *rec, const bytea *fp)
{
	idem_count(IDEM_COUNT_KEY_REUSE, 1);
	ereport(ERROR,
			(errcode(ERRCODE_IDEMPOTENCY_KEY_REUSED),
			 errmsg("idempotency key \"%s\" was already used for a different request",
					text_to_cstring(key->key)),
			 errdetail_internal("Stored fingerprint: %s. Request fingerprint: %s.",
					   fingerprint_text(rec->fingerprint),
					   fingerprint_text(fp)),
			 errhint("Use a new key for a new request.")));
}

static void
raise_in_progress(const IdemKey *key, bool ours)
{
	idem_count(IDEM_COUNT_IN_PROGRESS, 1);
	ereport(ERROR,
			(errcode(ERRCODE_IDEMPOTENCY_IN_PROGRESS),
			 errmsg("request with idempotency key \"%s\" is already in progress",
					text_to_cstring(key->key)),
			 ours ?
			 errdetail("This transaction already holds the key for operation \"%s\".",
					   text_to_cstring(key->operation)) :
			 errdetail("Another attempt holds the key for operation \"%s\".",
					   text_to_cstring(key->operation)),
			 ours ? 0 : errhint("Retry after the other attempt has finished.")));
}

/*
 * IK412 for a token that does not hold the key.  The DETAIL says what the
 * key's record shows, looked up once more for the message: no record, a
 * greater token (a later claim, or a token of another key), this claim
 * finished, or a smaller token (one this key never had).
 */
void
idem_raise_stale_token(Oid fn_oid, const IdemKey *key, int64 token)
{
	IdemStore	store;
	IdemRecord	rec;
	bool		found;
	char	   *detail;

	idem_store_open(&store, fn_oid, AccessShareLock, key);
	found = idem_store_fetch(&store, key, &rec);
	idem_store_close(&store, false);

	if (!found)
		detail = psprintf("Role \"%s\" has no record of operation \"%s\" with this key: "
						  "the claim was aborted, rolled back or purged after it expired, "
						  "or the token was never issued for this key.",
						  GetUserNameFromId(key->role, false),
						  text_to_cstring(key->operation));
	else if (rec.token > token)
		detail = psprintf("The key is held by a claim with a greater token, now %s: "
						  "this token's claim was taken over after its lease lapsed, or was aborted, "
						  "or the token was never issued for this key.",
						  IdemRecordIsPending(&rec) ? "pending" : "completed");
	else if (rec.token < token)
		detail = pstrdup("The key's record has a smaller token: "
						 "this token was never issued for this key, "
						 "or the transaction that claimed the key with it rolled back.");
	else if (!IdemRecordIsPending(&rec))
		detail = pstrdup("The claim was finished already: its response is stored.");
	else
		detail = pstrdup("The claim was changed by a concurrent transaction.");

	ereport(ERROR,
			(errcode(ERRCODE_IDEMPOTENCY_STALE_TOKEN),
			 errmsg("token %lld does not hold idempotency key \"%s\"",
					(long long) token, text_to_cstring(key->key)),
			 errdetail_internal("%s", detail)));
}

/* 22023 for a lease longer than the ttl, showing both */
void
idem_raise_lease_over_ttl(int64 lease, const Interval *ttl)
{
	Interval	lease_iv;

	memset(&lease_iv, 0, sizeof(lease_iv));
	lease_iv.time = lease;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("idempotency lease must not be longer than its ttl"),
			 errdetail("The lease is %s and the ttl is %s.",
					   DatumGetCString(DirectFunctionCall1(interval_out,
														   IntervalPGetDatum(&lease_iv))),
					   DatumGetCString(DirectFunctionCall1(interval_out,
														   IntervalPGetDatum(ttl))))));
}

/* IK410 for a remembered key */
static void
raise_response_expired(const IdemKey *key, const IdemRecord *rec)
{
	idem_count(IDEM_COUNT_EXPIRED, 1);
	ereport(ERROR,
			(errcode(ERRCODE_IDEMPOTENCY_RESPONSE_EXPIRED),
			 errmsg("request with idempotency key \"%s\" was completed, and its stored response has expired",
					text_to_cstring(key->key)),
			 errdetail("It was completed at %s; its response was kept until %s, the key is remembered until %s.",
					   pstrdup(timestamptz_to_str(rec->completed_at)),
					   pstrdup(timestamptz_to_str(rec->expires_at)),
					   pstrdup(timestamptz_to_str(rec->forget_at))),
			 errhint("Do not run the request again; use a new key for a new request.")));
}

/*
 * The error that refuses a request to idem_begin, for a record rec and a
 * request fingerprint fp
 */
void
idem_refuse_begin(BeginRefusal why, const IdemKey *key, const IdemRecord *rec,
				  const bytea *fp)
{
	switch (why)
	{
		case REFUSE_KEY_REUSED:
			raise_key_reused(key, rec, fp);
			break;
		case REFUSE_IN_PROGRESS:
			raise_in_progress(key, false);
			break;
		case REFUSE_IN_PROGRESS_OURS:
			raise_in_progress(key, true);
			break;
		case REFUSE_NOT_IN_SNAPSHOT:
			ereport(ERROR,
					(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
					 errmsg("could not serialize access due to a concurrent request with idempotency key \"%s\"",
							text_to_cstring(key->key)),
					 errdetail("Its result was committed after this transaction's snapshot was taken."),
					 errhint("Retry the transaction: the retry will replay the result.")));
			break;
		case REFUSE_RESPONSE_EXPIRED:
			raise_response_expired(key, rec);
			break;
		case REFUSE_NONE:
			break;
	}
	elog(ERROR, "unknown idem_begin refusal %d", (int) why);
}

/* ---- idem_begin's row ---- */

static Oid	result_fn_oid = InvalidOid;
static Oid	result_type = InvalidOid;

/*
 * The idem_claim row for status: 'new' and 'recover' carry the claim's
 * token (and the checkpoint to resume from), 'replay' the stored response.
 * The result type's OID is looked up once per backend (a FROM-clause call
 * gets a fresh FmgrInfo at every execution, so fn_extra would not keep
 * it), its descriptor comes from the type cache.
 */
Datum
idem_claim_result(FunctionCallInfo fcinfo, ClaimStatus status,
				  const IdemRecord *rec)
{
	TupleDesc	tupdesc;
	HeapTuple	result;
	Datum		values[3];
	bool		nulls[3] = {false, false, false};

	if (fcinfo->flinfo->fn_oid != result_fn_oid)
	{
		result_type = get_func_rettype(fcinfo->flinfo->fn_oid);
		result_fn_oid = fcinfo->flinfo->fn_oid;
	}
	tupdesc = lookup_rowtype_tupdesc(result_type, -1);

	values[0] = CStringGetTextDatum(status_names[status]);
	if (status == CLAIM_REPLAY)
	{
		nulls[1] = true;
		values[2] = JsonbPGetDatum(rec->response);
	}
	else
	{
		values[1] = Int64GetDatum(rec->token);
		values[2] = JsonbPGetDatum(rec->checkpoint);
		nulls[2] = (rec->checkpoint == NULL);
	}
	result = heap_form_tuple(tupdesc, values, nulls);
	ReleaseTupleDesc(tupdesc);
	return HeapTupleGetDatum(result);
}
