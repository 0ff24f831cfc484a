/*
 * handwritten.sql: the peer the extension is measured against -- the same
 * contract (claim, fingerprint, lease, fencing token, replay) written in
 * PL/pgSQL the way a careful user would, without the extension.
 *
 *   hw_begin(operation, key, fingerprint, in_flight, lease, ttl) -> hw_claim
 *   hw_finish(operation, key, token, response)
 *   hw_abort(operation, key, token) -> boolean
 *
 * Same signatures, same record shape (an unlogged reservation table keyed
 * by role, operation, key), same results on the paths the bench measures
 * (a new key, a completed key).  How it is built:
 *
 *   - pg_advisory_xact_lock(hashtext(operation), hashtext(key)) serializes
 *     the attempts on one key until the claiming transaction ends, so a
 *     duplicate of an uncommitted claim waits and then sees its outcome.
 *     (This is the per-key transaction lock that fills the shared lock
 *     table when one transaction claims ~20,000 keys; the bench never
 *     does that.)
 *   - INSERT ... ON CONFLICT DO UPDATE ... WHERE expired takes a key that
 *     is absent or expired, atomically, with a fresh token.
 *   - the fingerprint is compared before anything else (IK422 with both).
 *   - a duplicate of a committed pending claim (external-call shape) can
 *     only poll: PL/pgSQL has no way to sleep until another session's
 *     finish.  It polls every 10 ms until finish, abort or the lease end.
 *   - hw_finish / hw_abort are a single UPDATE / DELETE fenced by the
 *     token; they take no advisory lock (a poller holds it while it waits).
 *   - no SECURITY DEFINER (current_user must stay the caller) and no SET
 *     search_path clause (it would cost a GUC save/restore per call):
 *     every name is schema-qualified instead.
 *
 * Installed into schema public of the bench database by test/bench/run.
 */

CREATE UNLOGGED TABLE public.hw_record (
	role_id			pg_catalog.oid NOT NULL,
	operation		pg_catalog.text COLLATE "C" NOT NULL,
	key				pg_catalog.text COLLATE "C" NOT NULL,
	token			pg_catalog.int8 NOT NULL,
	fingerprint		pg_catalog.bytea,
	ttl				pg_catalog.interval NOT NULL,
	created_at		pg_catalog.timestamptz NOT NULL,
	completed_at	pg_catalog.timestamptz,
	expires_at		pg_catalog.timestamptz NOT NULL,
	response		pg_catalog.jsonb,
	CONSTRAINT hw_record_pkey PRIMARY KEY (role_id, operation, key)
);

CREATE SEQUENCE public.hw_token_seq AS pg_catalog.int8 NO CYCLE;

CREATE TYPE public.hw_claim AS (
	status		pg_catalog.text,
	token		pg_catalog.int8,
	response	pg_catalog.jsonb
);

CREATE FUNCTION public.hw_begin(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	fingerprint	pg_catalog.bytea,
	in_flight	pg_catalog.text DEFAULT NULL,
	lease		pg_catalog.interval DEFAULT NULL,
	ttl			pg_catalog.interval DEFAULT NULL)
RETURNS public.hw_claim
LANGUAGE plpgsql VOLATILE
AS $fn$
#variable_conflict use_column
DECLARE
	v_role		pg_catalog.oid := pg_catalog.current_user()::pg_catalog.regrole::pg_catalog.oid;
	v_policy	pg_catalog.text := COALESCE(hw_begin.in_flight, 'wait');
	v_lease		pg_catalog.interval := COALESCE(hw_begin.lease, pg_catalog.interval '30 seconds');
	v_ttl		pg_catalog.interval := COALESCE(hw_begin.ttl, pg_catalog.interval '24 hours');
	v_now		pg_catalog.timestamptz;
	v_token		pg_catalog.int8;
	v_fp		pg_catalog.bytea;
	v_done		pg_catalog.timestamptz;
	v_expires	pg_catalog.timestamptz;
	v_response	pg_catalog.jsonb;
	v_mine		pg_catalog.bool;
BEGIN
	IF hw_begin.operation IS NULL OR hw_begin.key IS NULL THEN
		RAISE EXCEPTION 'idempotency operation and key must not be null'
			USING ERRCODE = '22004';
	END IF;
	IF pg_catalog.length(hw_begin.operation) NOT BETWEEN 1 AND 255
	   OR pg_catalog.length(hw_begin.key) NOT BETWEEN 1 AND 255 THEN
		RAISE EXCEPTION 'idempotency operation and key must have 1 to 255 characters'
			USING ERRCODE = '22023';
	END IF;
	IF v_policy NOT IN ('wait', 'raise') THEN
		RAISE EXCEPTION 'unknown in_flight policy "%"', v_policy USING ERRCODE = '22023';
	END IF;
	IF v_lease <= pg_catalog.interval '0' OR v_ttl < pg_catalog.interval '1 minute'
	   OR v_lease > v_ttl THEN
		RAISE EXCEPTION 'invalid lease or ttl' USING ERRCODE = '22023';
	END IF;

	-- one attempt at a time per key, until this transaction ends
	IF v_policy = 'raise' THEN
		IF NOT pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtext(hw_begin.operation),
													pg_catalog.hashtext(hw_begin.key)) THEN
			RAISE EXCEPTION 'request with idempotency key "%" is already in progress', hw_begin.key
				USING ERRCODE = 'IK409';
		END IF;
	ELSE
		PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext(hw_begin.operation),
												 pg_catalog.hashtext(hw_begin.key));
	END IF;

	LOOP
		v_now := pg_catalog.clock_timestamp();

		SELECT h.fingerprint, h.completed_at, h.expires_at, h.response,
			   h.xmin OPERATOR(pg_catalog.=) pg_catalog.pg_current_xact_id_if_assigned()::pg_catalog.xid
		  INTO v_fp, v_done, v_expires, v_response, v_mine
		  FROM public.hw_record h
		 WHERE h.role_id OPERATOR(pg_catalog.=) v_role
		   AND h.operation OPERATOR(pg_catalog.=) hw_begin.operation
		   AND h.key OPERATOR(pg_catalog.=) hw_begin.key;

		IF FOUND AND v_expires OPERATOR(pg_catalog.>) v_now THEN
			-- a live record: the fingerprint decides first
			IF v_fp IS DISTINCT FROM hw_begin.fingerprint THEN
				RAISE EXCEPTION 'idempotency key "%" was already used for a different request', hw_begin.key
					USING ERRCODE = 'IK422',
						  DETAIL = pg_catalog.format('Stored fingerprint: %s. Request fingerprint: %s.',
											 COALESCE(v_fp::pg_catalog.text, 'NULL'),
											 COALESCE(hw_begin.fingerprint::pg_catalog.text, 'NULL'));
			END IF;
			IF v_done IS NOT NULL THEN
				RETURN ROW('replay', NULL, v_response)::public.hw_claim;
			END IF;
			IF COALESCE(v_mine, false) OR v_policy = 'raise' THEN
				RAISE EXCEPTION 'request with idempotency key "%" is already in progress', hw_begin.key
					USING ERRCODE = 'IK409';
			END IF;
			-- a committed claim (external call): poll until it settles or lapses
			PERFORM pg_catalog.pg_sleep(0.01);
			CONTINUE;
		END IF;

		-- absent or expired: take it with a fresh token
		INSERT INTO public.hw_record AS h
			(role_id, operation, key, token, fingerprint, ttl,
			 created_at, completed_at, expires_at, response)
		VALUES (v_role, hw_begin.operation, hw_begin.key,
				pg_catalog.nextval('public.hw_token_seq'), hw_begin.fingerprint, v_ttl,
				v_now, NULL, v_now OPERATOR(pg_catalog.+) v_lease, NULL)
		ON CONFLICT ON CONSTRAINT hw_record_pkey DO UPDATE
			SET token = EXCLUDED.token, fingerprint = EXCLUDED.fingerprint,
				ttl = EXCLUDED.ttl, created_at = EXCLUDED.created_at,
				completed_at = NULL, expires_at = EXCLUDED.expires_at,
				response = NULL
			WHERE h.expires_at OPERATOR(pg_catalog.<=) v_now
		RETURNING h.token INTO v_token;

		IF FOUND THEN
			RETURN ROW('new', v_token, NULL)::public.hw_claim;
		END IF;
		-- settled by its owner meanwhile: look again
	END LOOP;
END
$fn$;

CREATE FUNCTION public.hw_finish(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	token		pg_catalog.int8,
	response	pg_catalog.jsonb)
RETURNS pg_catalog.void
LANGUAGE plpgsql VOLATILE
AS $fn$
#variable_conflict use_column
DECLARE
	v_now		pg_catalog.timestamptz := pg_catalog.clock_timestamp();
BEGIN
	IF hw_finish.response IS NULL THEN
		RAISE EXCEPTION 'idempotency response must not be null' USING ERRCODE = '22004';
	END IF;
	UPDATE public.hw_record h
	   SET completed_at = v_now,
		   expires_at = v_now OPERATOR(pg_catalog.+) h.ttl,
		   response = hw_finish.response
	 WHERE h.role_id OPERATOR(pg_catalog.=) pg_catalog.current_user()::pg_catalog.regrole::pg_catalog.oid
	   AND h.operation OPERATOR(pg_catalog.=) hw_finish.operation
	   AND h.key OPERATOR(pg_catalog.=) hw_finish.key
	   AND h.token OPERATOR(pg_catalog.=) hw_finish.token
	   AND h.completed_at IS NULL;
	IF NOT FOUND THEN
		RAISE EXCEPTION 'token % does not hold idempotency key "%"', hw_finish.token, hw_finish.key
			USING ERRCODE = 'IK412';
	END IF;
END
$fn$;

CREATE FUNCTION public.hw_abort(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	token		pg_catalog.int8)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE
AS $fn$
#variable_conflict use_column
BEGIN
	DELETE FROM public.hw_record h
	 WHERE h.role_id OPERATOR(pg_catalog.=) pg_catalog.current_user()::pg_catalog.regrole::pg_catalog.oid
	   AND h.operation OPERATOR(pg_catalog.=) hw_abort.operation
	   AND h.key OPERATOR(pg_catalog.=) hw_abort.key
	   AND h.token OPERATOR(pg_catalog.=) hw_abort.token
	   AND h.completed_at IS NULL;
	RETURN FOUND;
END
$fn$;
