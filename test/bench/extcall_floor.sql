-- floor of the external-call shape, mode 'none': the claim commits on its
-- own (a pending row in the unlogged floor_record), the provider would be
-- called here, then the finish commits (the row updated to completed)
\set k (:client_id + 1) * 1000000000000000 + random(1, 999999999999999)
INSERT INTO floor_record (role_id, operation, key, token, fingerprint, ttl, created_at, completed_at, expires_at, response) VALUES (10, 'bench.op', :k, nextval('floor_token_seq'), '\x3a1f0c6e9b2d4f8a7c5e3b1d9f7a5c3e1b9d7f5a3c1e9b7d5f3a1c9e7b5d3f1a', '24 hours', clock_timestamp(), NULL, clock_timestamp() + interval '30 seconds', NULL) RETURNING token \gset
UPDATE floor_record SET completed_at = clock_timestamp(), expires_at = clock_timestamp() + ttl, response = '{"charge": "ch_1", "amount": 100}' WHERE role_id = 10 AND operation = 'bench.op' AND key = :k AND token = :token;
