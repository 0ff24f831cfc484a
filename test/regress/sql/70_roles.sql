--
-- 70_roles: records are namespaced by the calling role (current_user), and
-- nobody but the extension's functions can touch the record table.
--
-- Roles (from 00_setup): regress_idem_a and regress_idem_b are two
-- applications; regress_idem_nobody is any unprivileged role.
--
-- IK412 messages name the token: start this file's tokens at a known value,
-- (1 << 32) + 70000001 (forward only; no earlier file came near it).
--
\set VERBOSITY default
SELECT setval('idem_token_seq', (1::int8 << 32) + 70000000) AS token_base;

--
-- Role namespace.
--
-- Role A claims and finishes a key.
SET ROLE regress_idem_a;
SELECT token AS a_token FROM idem_begin('role.charge', 'k', '\x0a') \gset
SELECT idem_finish('role.charge', 'k', :a_token, '"A"');
SELECT status, response FROM idem_begin('role.charge', 'k', '\x0a');
-- Role B, same operation and key: its own record, 'new' -- not A's response,
-- and A's fingerprint is no concern of B's (no IK422).
SET ROLE regress_idem_b;
SELECT status, token > :a_token AS greater_token, response
  FROM idem_begin('role.charge', 'k', '\x0b');
SELECT token AS b_token FROM idem_begin('role.charge', 'k2', NULL) \gset
-- B cannot finish or abort A's claim with A's token.
SELECT idem_finish('role.charge', 'k', :a_token, '"B overwrites A"');
\echo :SQLSTATE
SELECT idem_abort('role.charge', 'k', :a_token);
-- ... nor A B's pending claim with B's token.
SET ROLE regress_idem_a;
SELECT idem_abort('role.charge', 'k2', :b_token);
SELECT idem_finish('role.charge', 'k2', :b_token, '"A overwrites B"');
\echo :SQLSTATE
-- A's record is unchanged.
SELECT status, response FROM idem_begin('role.charge', 'k', '\x0a');
RESET ROLE;
-- Two records under one operation and key, one per role; B's k2 still
-- pending under B.
SELECT role_id::regrole AS role, key, completed_at IS NOT NULL AS completed, response
  FROM idem_record WHERE operation = 'role.charge' ORDER BY key, role;

-- current_user is the namespace: the session user is a superuser, but
-- under SET ROLE B the records are B's.
SET ROLE regress_idem_b;
SELECT idem_finish('role.charge', 'k2', :b_token, '"B"');
RESET ROLE;
SELECT status FROM idem_begin('role.charge', 'k2', NULL);
SELECT role_id::regrole AS role, key, response
  FROM idem_record WHERE operation = 'role.charge' AND key = 'k2' ORDER BY role;

--
-- Inside a SECURITY DEFINER function, current_user is the function's owner,
-- and so is the namespace: a function owned by A called by B records under
-- A.  A SECURITY INVOKER function records under its caller.
--
CREATE FUNCTION charge_definer(k text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public AS $$
DECLARE
  c idem_claim;
BEGIN
  c := idem_begin('role.definer', k, NULL);
  IF c.status = 'new' THEN
    PERFORM idem_finish('role.definer', k, c.token, to_jsonb(current_user::text));
    RETURN 'new';
  END IF;
  RETURN 'replay ' || c.response::text;
END
$$;
CREATE FUNCTION charge_invoker(k text) RETURNS text
LANGUAGE plpgsql SECURITY INVOKER SET search_path = public AS $$
DECLARE
  c idem_claim;
BEGIN
  c := idem_begin('role.definer', k, NULL);
  IF c.status = 'new' THEN
    PERFORM idem_finish('role.definer', k, c.token, to_jsonb(current_user::text));
    RETURN 'new';
  END IF;
  RETURN 'replay ' || c.response::text;
END
$$;
ALTER FUNCTION charge_definer(text) OWNER TO regress_idem_a;
ALTER FUNCTION charge_invoker(text) OWNER TO regress_idem_a;
SET ROLE regress_idem_b;
SELECT charge_definer('d1') AS first_call, charge_definer('d1') AS second_call;
SELECT charge_invoker('d2') AS first_call, charge_invoker('d2') AS second_call;
-- B has no record of its own for d1: a direct call is 'new' ...
SELECT status FROM idem_begin('role.definer', 'd1', NULL);
-- ... while A, calling directly, replays what the definer function stored.
SET ROLE regress_idem_a;
SELECT status, response FROM idem_begin('role.definer', 'd1', NULL);
-- ... and has none for d2, which the invoker function stored under B.
SELECT status FROM idem_begin('role.definer', 'd2', NULL);
RESET ROLE;
SELECT role_id::regrole AS role, key, response
  FROM idem_record WHERE operation = 'role.definer' ORDER BY key, role;

--
-- PUBLIC has no access to the record table or the token sequences: an
-- unprivileged role gets 42501 for each, yet can use the core functions.
--
SET ROLE regress_idem_nobody;
SELECT count(*) FROM idem_record;
\echo :SQLSTATE
INSERT INTO idem_record (role_id, operation, key, token, ttl, created_at, expires_at)
VALUES ('regress_idem_a'::regrole, 'role.charge', 'forged', 1, '1 day', now(), 'infinity');
\echo :SQLSTATE
UPDATE idem_record SET response = '"forged"';
\echo :SQLSTATE
DELETE FROM idem_record;
\echo :SQLSTATE
TRUNCATE idem_record;
\echo :SQLSTATE
SELECT nextval('idem_token_seq');
\echo :SQLSTATE
SELECT setval('idem_token_seq', 1);
\echo :SQLSTATE
SELECT last_value FROM idem_token_seq;
\echo :SQLSTATE
SELECT nextval('idem_token_epoch');
\echo :SQLSTATE
SELECT setval('idem_token_epoch', 1);
\echo :SQLSTATE
-- the core functions and the fingerprint helper work
SELECT idem_finish('role.nobody', 'n1',
                   (idem_begin('role.nobody', 'n1', idem_fingerprint('n', 1))).token,
                   '"ok"');
SELECT status, response FROM idem_begin('role.nobody', 'n1', idem_fingerprint('n', 1));
SELECT idem_abort('role.nobody', 'n2', (idem_begin('role.nobody', 'n2', NULL)).token);

--
-- The administration functions are not granted to PUBLIC: 42501.
--
SELECT idem_purge();
\echo :SQLSTATE
SELECT idem_purge(1);
\echo :SQLSTATE
SELECT idem_set_logged(true);
\echo :SQLSTATE
RESET ROLE;

-- Once granted, they work for that role (they run with the extension
-- owner's rights, so the role needs no rights on the table) and apply to
-- every role's records.  One expired record of role A to purge:
SELECT idem_purge() >= 0 AS expired_records_cleared;
UPDATE idem_record SET expires_at = now() - interval '1 s'
 WHERE role_id = 'regress_idem_a'::regrole AND operation = 'role.charge' AND key = 'k';
GRANT EXECUTE ON FUNCTION idem_purge(integer) TO regress_idem_nobody;
GRANT EXECUTE ON FUNCTION idem_set_logged(boolean) TO regress_idem_nobody;
SET ROLE regress_idem_nobody;
SELECT idem_purge() AS purged;
SELECT idem_set_logged(true);
SELECT relpersistence FROM pg_class WHERE oid = 'idem_record'::regclass;
SELECT idem_set_logged(false);
SELECT relpersistence FROM pg_class WHERE oid = 'idem_record'::regclass;
-- ... which still gives no direct access to the table.
SELECT count(*) FROM idem_record;
\echo :SQLSTATE
RESET ROLE;
SELECT count(*) AS a_k_records FROM idem_record
 WHERE role_id = 'regress_idem_a'::regrole AND operation = 'role.charge' AND key = 'k';

-- The caller's search_path cannot make the administration functions run
-- the caller's code with the owner's rights: a clock_timestamp() that would
-- make every record look expired is not picked up.
SELECT count(*) AS records_before FROM idem_record \gset
CREATE SCHEMA regress_evil AUTHORIZATION regress_idem_nobody;
SET ROLE regress_idem_nobody;
CREATE FUNCTION regress_evil.clock_timestamp() RETURNS timestamptz
LANGUAGE sql AS $$ SELECT 'infinity'::timestamptz $$;
SET search_path = regress_evil, pg_catalog, public;
SELECT idem_purge() AS purged;
RESET search_path;
RESET ROLE;
SELECT count(*) = :records_before AS live_records_kept FROM idem_record;

REVOKE EXECUTE ON FUNCTION idem_purge(integer) FROM regress_idem_nobody;
REVOKE EXECUTE ON FUNCTION idem_set_logged(boolean) FROM regress_idem_nobody;
SET ROLE regress_idem_nobody;
SELECT idem_purge();
\echo :SQLSTATE
RESET ROLE;
