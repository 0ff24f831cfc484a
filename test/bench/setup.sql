/*
 * setup.sql: the bench database, besides the extension and the
 * hand-written peer (handwritten.sql).
 *
 * floor_record is the "floor": the same shape as idem_record, unlogged,
 * with the same primary key, and a token sequence configured like
 * idem_token_seq (unlogged, no cache).  The floor scripts do on it, in bare
 * SQL, the storage work a claim + finish or a replay needs and nothing else.
 */
CREATE EXTENSION idempotency;

CREATE UNLOGGED TABLE public.floor_record (
	role_id			oid NOT NULL,
	operation		text COLLATE "C" NOT NULL,
	key				text COLLATE "C" NOT NULL,
	token			int8 NOT NULL,
	fingerprint		bytea,
	ttl				interval NOT NULL,
	created_at		timestamptz NOT NULL,
	completed_at	timestamptz,
	expires_at		timestamptz NOT NULL,
	response		jsonb,
	CONSTRAINT floor_record_pkey PRIMARY KEY (role_id, operation, key)
);
CREATE UNLOGGED SEQUENCE public.floor_token_seq AS int8 NO CYCLE;

/*
 * The floor of durability mode 'completed': the claim in the unlogged
 * floor_record, moved at the finish to this logged table, as the extension
 * moves it to idem_result.
 */
CREATE TABLE public.floor_result (LIKE public.floor_record INCLUDING ALL);

/*
 * Hot key, in-transaction shape: the whole request in one statement (one
 * transaction): claim, a 50 ms action that writes its effect, finish.
 * Duplicates wait on the owner's transaction and replay its response.
 */
CREATE UNLOGGED TABLE public.bench_action (key text NOT NULL, token int8 NOT NULL);

CREATE FUNCTION public.bench_hot_tx(p_key text, p_action_ms int)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
	c idem_claim;
	r jsonb;
BEGIN
	SELECT * INTO c FROM idem_begin('bench.hot', p_key, '\x01'::bytea, 'wait');
	IF c.status = 'replay' THEN
		RETURN c.response;
	END IF;
	PERFORM pg_sleep(p_action_ms / 1000.0);
	INSERT INTO public.bench_action VALUES (p_key, c.token);
	r := jsonb_build_object('charge', 'ch_' || c.token);
	PERFORM idem_finish('bench.hot', p_key, c.token, r);
	RETURN r;
END
$$;
