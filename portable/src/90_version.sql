/*
 * 90_version.sql: which version of the portable edition this is.  The psql
 * script (idempotency--schema.sql) reads it to know what it updates from.
 */
CREATE FUNCTION @extschema@.idem_portable_version()
RETURNS pg_catalog.text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT '@VERSION@'::pg_catalog.text $$;
