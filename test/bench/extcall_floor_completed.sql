-- floor of the external-call shape, mode 'completed': the claim commits on
-- its own (a pending row in the unlogged floor_record), the provider would
-- be called here, then the finish commits (the row moved to the logged
-- floor_result, as a finish moves a record to idem_result)
\set k (:client_id + 1) * 1000000000000000 + random(1, 999999999999999)
INSERT INTO floor_record (role_id, operation, key, token, fingerprint, ttl, created_at, completed_at, expires_at, response) VALUES (10, 'bench.op', :k, nextval('floor_token_seq'), '\x3a1f0c6e9b2d4f8a7c5e3b1d9f7a5c3e1b9d7f5a3c1e9b7d5f3a1c9e7b5d3f1a', '24 hours', clock_timestamp(), NULL, clock_timestamp() + interval '30 seconds', NULL) RETURNING token \gset
WITH moved AS (DELETE FROM floor_record WHERE role_id = 10 AND operation = 'bench.op' AND key = :k AND token = :token RETURNING role_id, operation, key, token, fingerprint, ttl, created_at) INSERT INTO floor_result SELECT role_id, operation, key, token, fingerprint, ttl, created_at, clock_timestamp(), clock_timestamp() + ttl, '{"charge": "ch_1", "amount": 100}' FROM moved;
