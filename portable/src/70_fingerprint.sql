/*
 * 70_fingerprint.sql: idem_fingerprint, SHA-256 over the C edition's
 * encoding: each argument is a byte 0 for NULL, or a byte 1, the length of
 * its text form in bytes (four bytes, big-endian) and the text form, in
 * the database's encoding.  sha256() is core (PostgreSQL 11): no pgcrypto.
 *
 * SQL and PL/pgSQL functions cannot take VARIADIC "any".  What they can
 * take, without ever hashing another text form than the C edition would:
 *
 *	idem_fingerprint(VARIADIC text[])		any number of text arguments (and
 *											literals, and idem_fingerprint(
 *											VARIADIC ARRAY[...]) of text)
 *	idem_fingerprint(anyelement)			one argument of any type
 *	idem_fingerprint(anyelement, anycompatible)
 *	idem_fingerprint(text, anycompatible)	two arguments of any types
 *
 * A value's text form is format('%s', value), its type's output function,
 * as the C edition takes it; a literal is its own text.  Each polymorphic
 * argument is alone in its family of polymorphic types, so PostgreSQL
 * never converts it to another argument's type (a literal '012' next to
 * the integer 5 stays '012').  Three or more arguments of types other than
 * text fail with "function ... does not exist": pass them as text
 * (x::text), which is their text form except for boolean (true::text is
 * 'true', its text form 't') and char(n) (the cast drops trailing blanks).
 */
CREATE FUNCTION @extschema@.idem_fingerprint(VARIADIC pg_catalog.text[])
RETURNS pg_catalog.bytea
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
	SELECT CASE WHEN $1 IS NOT NULL THEN
		sha256(coalesce(
			(SELECT string_agg(CASE WHEN a.v IS NULL THEN '\x00'::bytea
									ELSE '\x01'::bytea || int4send(octet_length(a.v))
										 || convert_to(a.v, getdatabaseencoding()) END,
							   ''::bytea ORDER BY a.n)
			   FROM unnest($1) WITH ORDINALITY AS a(v, n)),
			''::bytea)) END
$$;

/* a value's text form, NULL for NULL (num_nulls: a row of NULLs is a value) */
CREATE FUNCTION @extschema@._idem_text_form(value anyelement)
RETURNS pg_catalog.text
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
	SELECT CASE WHEN num_nulls(value) = 0 THEN format('%s', value) END
$$;

CREATE FUNCTION @extschema@.idem_fingerprint(a anyelement)
RETURNS pg_catalog.bytea
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
	SELECT idem_fingerprint(VARIADIC ARRAY[_idem_text_form(a)])
$$;

CREATE FUNCTION @extschema@.idem_fingerprint(a anyelement, b anycompatible)
RETURNS pg_catalog.bytea
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
	SELECT idem_fingerprint(VARIADIC ARRAY[_idem_text_form(a), _idem_text_form(b)])
$$;

CREATE FUNCTION @extschema@.idem_fingerprint(a pg_catalog.text, b anycompatible)
RETURNS pg_catalog.bytea
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
	SELECT idem_fingerprint(VARIADIC ARRAY[a, _idem_text_form(b)])
$$;

GRANT EXECUTE ON FUNCTION
	@extschema@.idem_fingerprint(pg_catalog.text[]),
	@extschema@.idem_fingerprint(anyelement),
	@extschema@.idem_fingerprint(anyelement, anycompatible),
	@extschema@.idem_fingerprint(pg_catalog.text, anycompatible)
TO PUBLIC;
