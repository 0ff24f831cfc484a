/*
 * 90_version.sql: which version of the portable edition this is.  The psql
 * script (idempotency--schema.sql) reads it to know what it updates from.
 */
CREATE FUNCTION @extschema@.idem_portable_version()
RETURNS pg_catalog.text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT '@VERSION@'::pg_catalog.text $$;

/*
 * The functions resolve names through search_path pg_catalog, then this
 * schema: a role that could create objects in it could put a function there
 * that matches a call better than pg_catalog's, and run it with a caller's
 * rights.  So the schema must be one where PUBLIC cannot create (PostgreSQL
 * 15's public schema, or a schema of its own), checked at every install and
 * update.
 */
CREATE FUNCTION @extschema@._idem_check_schema()
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $_idem_check_schema$
DECLARE
	schema CONSTANT oid := (SELECT c.relnamespace FROM pg_class c
							 WHERE c.oid = 'idem_record'::regclass);
BEGIN
	IF has_schema_privilege('public', schema, 'CREATE') THEN
		RAISE EXCEPTION 'idempotency cannot be installed in schema %, where every role may create objects',
						schema::regnamespace
			USING ERRCODE = '42501',
				  HINT = 'Install it in a schema of its own: CREATE SCHEMA idempotency; CREATE EXTENSION idempotency SCHEMA idempotency; or revoke CREATE on the schema from PUBLIC.';
	END IF;
END
$_idem_check_schema$;

SELECT FROM @extschema@._idem_check_schema();
