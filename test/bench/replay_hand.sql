-- hand-written PL/pgSQL peer, replay: hw_begin on a completed key
\set r random(1, 100000)
SELECT status, token, response FROM hw_begin('bench.op', :r, '\x3a1f0c6e9b2d4f8a7c5e3b1d9f7a5c3e1b9d7f5a3c1e9b7d5f3a1c9e7b5d3f1a');
