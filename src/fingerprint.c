/*-------------------------------------------------------------------------
 *
 * fingerprint.c
 *	  idem_fingerprint(VARIADIC "any"): SHA-256 of the arguments' text forms.
 *
 * The encoding is unambiguous: each argument is a one-byte tag (0 for NULL,
 * 1 for a value) and, for a value, its text form's length as four bytes
 * big-endian followed by the text.  So ('a', 'bc') and ('ab', 'c') differ,
 * and so do NULL and ''.  It depends on nothing but the text forms, so it
 * is the same in every session and on every server -- as long as the text
 * forms are: timestamptz and float output follow TimeZone and
 * extra_float_digits, so pass such values as text of a fixed format.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "lib/stringinfo.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/lsyscache.h"

PG_FUNCTION_INFO_V1(idem_fingerprint);

static void
append_part(StringInfo buf, const char *text)
{
	if (text == NULL)
		appendStringInfoChar(buf, 0);
	else
	{
		uint32		len = (uint32) strlen(text);
		char		header[5];

		header[0] = 1;
		header[1] = (char) (len >> 24);
		header[2] = (char) (len >> 16);
		header[3] = (char) (len >> 8);
		header[4] = (char) len;
		appendBinaryStringInfo(buf, header, sizeof(header));
		appendBinaryStringInfo(buf, text, len);
	}
}

static char *
text_form(Oid type, Datum value)
{
	Oid			typoutput;
	bool		typisvarlena;

	getTypeOutputInfo(type, &typoutput, &typisvarlena);
	return OidOutputFunctionCall(typoutput, value);
}

Datum
idem_fingerprint(PG_FUNCTION_ARGS)
{
	StringInfoData buf;
	bytea	   *encoded;

	initStringInfo(&buf);

	if (get_fn_expr_variadic(fcinfo->flinfo))
	{
		/* idem_fingerprint(VARIADIC array): the array's elements */
		ArrayType  *array;
		Oid			elemtype;
		int16		elemlen;
		bool		elembyval;
		char		elemalign;
		Datum	   *elems;
		bool	   *elemnulls;
		int			nelems;

		if (PG_ARGISNULL(0))
			PG_RETURN_NULL();	/* as concat(VARIADIC NULL) does */
		array = PG_GETARG_ARRAYTYPE_P(0);
		elemtype = ARR_ELEMTYPE(array);
		get_typlenbyvalalign(elemtype, &elemlen, &elembyval, &elemalign);
		deconstruct_array(array, elemtype, elemlen, elembyval, elemalign,
						  &elems, &elemnulls, &nelems);
		for (int i = 0; i < nelems; i++)
			append_part(&buf, elemnulls[i] ? NULL : text_form(elemtype, elems[i]));
	}
	else
	{
		for (int i = 0; i < PG_NARGS(); i++)
		{
			Oid			type = get_fn_expr_argtype(fcinfo->flinfo, i);

			if (!OidIsValid(type))
				elog(ERROR, "idem_fingerprint: could not determine the type of argument %d", i + 1);
			append_part(&buf, PG_ARGISNULL(i) ? NULL : text_form(type, PG_GETARG_DATUM(i)));
		}
	}

	encoded = (bytea *) palloc(VARHDRSZ + buf.len);
	SET_VARSIZE(encoded, VARHDRSZ + buf.len);
	memcpy(VARDATA(encoded), buf.data, buf.len);
	pfree(buf.data);

	return DirectFunctionCall1(sha256_bytea, PointerGetDatum(encoded));
}
