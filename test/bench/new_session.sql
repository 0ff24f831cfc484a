-- extension, new key, takeover => 'session': idem_begin + idem_finish in one transaction
\set k (:client_id + 1) * 1000000000000000 + random(1, 999999999999999)
BEGIN;
SELECT token FROM idem_begin('bench.op', :k, '\x3a1f0c6e9b2d4f8a7c5e3b1d9f7a5c3e1b9d7f5a3c1e9b7d5f3a1c9e7b5d3f1a', takeover => 'session') \gset
SELECT idem_finish('bench.op', :k, :token, '{"charge": "ch_1", "amount": 100}');
COMMIT;
