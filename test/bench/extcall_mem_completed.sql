-- the storage work left to the external-call shape, mode 'completed', if pending
-- claims were held in shared memory (issue 42, lever 1): the claim is a
-- primary-key look-up that finds nothing and a token, with no write and no
-- transaction ID; the finish inserts the completed record
\set k (:client_id + 1) * 1000000000000000 + random(1, 999999999999999)
SELECT nextval('floor_token_seq') AS token FROM (SELECT 1) AS one WHERE NOT EXISTS (SELECT FROM floor_result WHERE role_id = 10 AND operation = 'bench.op' AND key = :k::text) \gset
INSERT INTO floor_result (role_id, operation, key, token, fingerprint, ttl, created_at, completed_at, expires_at, response) VALUES (10, 'bench.op', :k, :token, '\x3a1f0c6e9b2d4f8a7c5e3b1d9f7a5c3e1b9d7f5a3c1e9b7d5f3a1c9e7b5d3f1a', '24 hours', clock_timestamp(), clock_timestamp(), clock_timestamp() + interval '24 hours', '{"charge": "ch_1", "amount": 100}');
