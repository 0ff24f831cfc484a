/*
 * 20_args.sql: what a call asks for -- the settings that give the idem_*
 * functions' defaults, and the checks of their arguments.
 *
 * The settings are custom settings, read with current_setting(name, true):
 * SET, ALTER ROLE ... SET and ALTER DATABASE ... SET all work.  Nothing
 * checks a value when it is set (no library defines them), so each call
 * checks the values it reads, and an invalid one fails the call with 22023
 * naming the setting -- never a call that runs with another policy than
 * the one asked for.  Values take the units the C edition's settings take
 * (a lease of '30s' or '30000', in ms; a ttl of '24h' or '86400', in s; a
 * size of '64kB' or '65536', in bytes).
 */

/* 22023 for an invalid value of setting name */
CREATE FUNCTION @extschema@._idem_invalid_setting(name pg_catalog.text, value pg_catalog.text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $_idem_invalid_setting$
BEGIN
	RAISE EXCEPTION 'invalid value for parameter "%": "%"', name, value
		USING ERRCODE = '22023',
			  HINT = 'Set a valid value or RESET the parameter.';
END
$_idem_invalid_setting$;

/*
 * A setting's value as a number of base units (microseconds for times,
 * bytes for sizes), or NULL when it is not set.  unit is the unit of a
 * bare number: 'ms' or 's' for a time, 'B' for a size.
 */
CREATE FUNCTION @extschema@._idem_setting_number(name pg_catalog.text, unit pg_catalog.text,
												 lo pg_catalog.int8, hi pg_catalog.int8)
RETURNS pg_catalog.int8
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $_idem_setting_number$
DECLARE
	value CONSTANT text := current_setting(name, true);
	parts text[];
	n numeric;
	u text;
	result numeric;
BEGIN
	IF value IS NULL OR value = '' THEN
		RETURN NULL;
	END IF;
	parts := regexp_match(value, '^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$');
	IF parts IS NULL THEN
		PERFORM _idem_invalid_setting(name, value);
	END IF;
	n := parts[1]::numeric;
	u := coalesce(nullif(parts[2], ''), unit);
	result := n * CASE u
		WHEN 'us' THEN 1 WHEN 'ms' THEN 1000 WHEN 's' THEN 1000000
		WHEN 'min' THEN 60000000 WHEN 'h' THEN 3600000000 WHEN 'd' THEN 86400000000
		WHEN 'B' THEN 1 WHEN 'kB' THEN 1024 WHEN 'MB' THEN 1048576
		WHEN 'GB' THEN 1073741824 WHEN 'TB' THEN 1099511627776
		END;
	/* a time's unit where a size's is asked for, or the other way round */
	IF result IS NULL OR (unit = 'B') <> (u IN ('B', 'kB', 'MB', 'GB', 'TB'))
	   OR result < lo OR result > hi THEN
		PERFORM _idem_invalid_setting(name, value);
	END IF;
	RETURN round(result)::bigint;
END
$_idem_setting_number$;

/* A setting of a list of words, lower case, or NULL when not set */
CREATE FUNCTION @extschema@._idem_setting_word(name pg_catalog.text, words pg_catalog.text[])
RETURNS pg_catalog.text
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $_idem_setting_word$
DECLARE
	value CONSTANT text := lower(btrim(current_setting(name, true)));
BEGIN
	IF value IS NULL OR value = '' THEN
		RETURN NULL;
	END IF;
	IF NOT value = ANY (words) THEN
		PERFORM _idem_invalid_setting(name, current_setting(name, true));
	END IF;
	RETURN value;
END
$_idem_setting_word$;

/* idempotency.max_response_size, in bytes (64kB; superuser-only in the C edition) */
CREATE FUNCTION @extschema@._idem_max_response_size()
RETURNS pg_catalog.int8
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
	SELECT coalesce(_idem_setting_number('idempotency.max_response_size', 'B', 1, 268435456), 65536)
$$;

/* An interval in microseconds, months counted as 30 days (as interval comparison does) */
CREATE FUNCTION @extschema@._idem_usecs(iv pg_catalog.interval, name pg_catalog.text)
RETURNS pg_catalog.int8
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $_idem_usecs$
DECLARE
	/* extract(epoch) counts a year as 365.25 days, a month as 30 */
	usecs CONSTANT numeric := (extract(epoch FROM iv)
							   - extract(year FROM iv) * 5.25 * 86400) * 1000000;
BEGIN
	IF usecs > 36500 * 86400000000::numeric THEN
		RAISE EXCEPTION 'argument "%" is too long', name
			USING ERRCODE = '22023', DETAIL = 'At most 36500 days are allowed.';
	END IF;
	RETURN greatest(usecs, -9223372036854775808)::bigint;
END
$_idem_usecs$;

/* An operation or a key: 1 to 255 characters */
CREATE FUNCTION @extschema@._idem_check_name(value pg_catalog.text, name pg_catalog.text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $_idem_check_name$
DECLARE
	chars CONSTANT int := char_length(value);
BEGIN
	IF value IS NULL THEN
		RAISE EXCEPTION 'argument "%" must not be null', name USING ERRCODE = '22004';
	END IF;
	IF chars = 0 THEN
		RAISE EXCEPTION 'argument "%" must not be empty', name USING ERRCODE = '22023';
	END IF;
	IF chars > 255 THEN
		RAISE EXCEPTION 'argument "%" is too long', name
			USING ERRCODE = '22023',
				  DETAIL = format('It has %s characters; at most %s are allowed.', chars, 255);
	END IF;
END
$_idem_check_name$;

/* 22004 for a NULL where a value is required */
CREATE FUNCTION @extschema@._idem_require(missing pg_catalog.bool, name pg_catalog.text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $_idem_require$
BEGIN
	IF missing THEN
		RAISE EXCEPTION 'argument "%" must not be null', name USING ERRCODE = '22004';
	END IF;
END
$_idem_require$;

/*
 * A response or checkpoint state: not NULL, and both its stored form and
 * its text form (what a replay sends) within idempotency.max_response_size
 */
CREATE FUNCTION @extschema@._idem_check_response(value pg_catalog.jsonb, name pg_catalog.text)
RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $_idem_check_response$
DECLARE
	max_size CONSTANT bigint := _idem_max_response_size();
	size bigint;
	hint CONSTANT text := CASE WHEN name = 'state'
		THEN 'Keep the state elsewhere and checkpoint a reference to it.'
		ELSE 'Store the response elsewhere and finish with a reference to it.' END;
BEGIN
	IF value IS NULL THEN
		IF name = 'response' THEN
			RAISE EXCEPTION 'argument "%" must not be null', name
				USING ERRCODE = '22004',
					  HINT = 'Use idem_abort to release a claim without a result.';
		END IF;
		RAISE EXCEPTION 'argument "%" must not be null', name USING ERRCODE = '22004';
	END IF;
	size := pg_column_size(value);
	IF size > max_size THEN
		RAISE EXCEPTION 'idempotency % is too large', name
			USING ERRCODE = '54000',
				  DETAIL = format('The %s takes %s bytes; idempotency.max_response_size is %s bytes.',
								  name, size, max_size),
				  HINT = hint;
	END IF;
	size := octet_length(value::text);
	IF size > max_size THEN
		RAISE EXCEPTION 'idempotency % is too large', name
			USING ERRCODE = '54000',
				  DETAIL = format('Its text form takes %s bytes; idempotency.max_response_size is %s bytes.',
								  size, max_size),
				  HINT = hint;
	END IF;
END
$_idem_check_response$;

/* 25006 in a read-only transaction, as the C edition says it */
CREATE FUNCTION @extschema@._idem_check_writable(fname pg_catalog.text)
RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $_idem_check_writable$
BEGIN
	IF current_setting('transaction_read_only') = 'on' THEN
		RAISE EXCEPTION 'cannot execute % in a read-only transaction', fname
			USING ERRCODE = '25006';
	END IF;
END
$_idem_check_writable$;
