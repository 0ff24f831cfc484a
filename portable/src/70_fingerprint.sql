/*
 * 70_fingerprint.sql: idem_fingerprint, SHA-256 over the C edition's
 * encoding: each argument is a byte 0 for NULL, or a byte 1, the length of
 * its text in bytes (four bytes, big-endian) and the text, in the
 * database's encoding.  PL/pgSQL and SQL functions cannot take VARIADIC
 * "any", so the arguments are text: callers pass x::text for a value of
 * another type, which is the value's text form (its output function), as
 * the C edition takes it -- except for boolean, whose cast to text is
 * 'true'/'false' where its text form is 't'/'f'.  The same text arguments
 * give the same bytes in both editions.  sha256() is core (PostgreSQL 11):
 * no pgcrypto needed.
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

GRANT EXECUTE ON FUNCTION @extschema@.idem_fingerprint(pg_catalog.text[]) TO PUBLIC;
