--
-- 20_arguments: argument checks and limits of idem_begin, idem_finish and
-- idem_abort.  NULL where a value is required: 22004.  Any other invalid
-- argument: 22023.  A response too large to keep: 54000.
--
\set VERBOSITY default

--
-- NULLs
--
-- operation, key: 22004 in all three functions
SELECT idem_begin(NULL, 'k', NULL);
\echo :SQLSTATE
SELECT idem_begin('args', NULL, NULL);
\echo :SQLSTATE
SELECT idem_finish(NULL, 'k', 1, '{}');
\echo :SQLSTATE
SELECT idem_finish('args', NULL, 1, '{}');
\echo :SQLSTATE
SELECT idem_abort(NULL, 'k', 1);
\echo :SQLSTATE
SELECT idem_abort('args', NULL, 1);
\echo :SQLSTATE
-- token: 22004 in idem_finish and idem_abort
SELECT idem_finish('args', 'k', NULL, '{}');
\echo :SQLSTATE
SELECT idem_abort('args', 'k', NULL);
\echo :SQLSTATE
-- response: 22004, with a hint to use idem_abort.  (A JSON null is a value,
-- not a SQL NULL, and is accepted: see the end of this block.)
SELECT token AS null_token FROM idem_begin('args', 'null-response', NULL) \gset
SELECT idem_finish('args', 'null-response', :null_token, NULL);
\echo :SQLSTATE
SELECT idem_finish('args', 'null-response', :null_token, 'null');
SELECT status, response, response IS NULL AS sql_null
  FROM idem_begin('args', 'null-response', NULL);
-- The fingerprint may be NULL (a claim without one), and NULL in_flight,
-- lease and ttl take the settings' defaults.
SELECT status FROM idem_begin('args', 'all-defaults', NULL, NULL, NULL, NULL);

--
-- Empty operation or key: 22023, in all three functions.
--
SELECT idem_begin('', 'k', NULL);
\echo :SQLSTATE
SELECT idem_begin('args', '', NULL);
\echo :SQLSTATE
SELECT idem_finish('', 'k', 1, '{}');
\echo :SQLSTATE
SELECT idem_abort('args', '', 1);
\echo :SQLSTATE

--
-- Length: at most 255 characters for the operation and for the key.
--
SELECT status FROM idem_begin('args', repeat('k', 255), NULL);
SELECT idem_begin('args', repeat('k', 256), NULL);
\echo :SQLSTATE
SELECT status FROM idem_begin(repeat('o', 255), 'k', NULL);
SELECT idem_begin(repeat('o', 256), 'k', NULL);
\echo :SQLSTATE
-- idem_finish and idem_abort check the same limit.
SELECT idem_finish('args', repeat('k', 256), 1, '{}');
\echo :SQLSTATE
SELECT idem_abort(repeat('o', 256), 'k', 1);
\echo :SQLSTATE
-- Characters, not bytes: 255 two-byte characters (510 bytes) are accepted,
-- 256 are not.
SELECT octet_length(repeat('é', 255)) AS bytes;
SELECT status FROM idem_begin('args', repeat('é', 255), NULL);
SELECT idem_begin('args', repeat('é', 256), NULL);
\echo :SQLSTATE
SELECT status FROM idem_begin(repeat('é', 255), 'k', NULL);
SELECT idem_begin(repeat('é', 256), 'k', NULL);
\echo :SQLSTATE
-- The long keys were stored whole.
SELECT operation, length(key) AS key_chars, octet_length(key) AS key_bytes
  FROM idem_record
 WHERE operation = 'args' AND length(key) = 255
 ORDER BY key_bytes;

--
-- in_flight: 'wait' or 'raise' (exactly; NULL means the setting).
--
SELECT idem_begin('args', 'policy', NULL, in_flight => 'foo');
\echo :SQLSTATE
SELECT status FROM idem_begin('args', 'policy-upper', NULL, in_flight => 'RAISE');
\echo :SQLSTATE
SELECT idem_begin('args', 'policy', NULL, in_flight => '');
\echo :SQLSTATE
SELECT status FROM idem_begin('args', 'policy', NULL, in_flight => 'raise');
SELECT status FROM idem_begin('args', 'policy2', NULL, in_flight => 'wait');

--
-- ttl: at least 1 minute, however it is written; not absurdly long (the
-- limit keeps timestamps in range).
--
SELECT status FROM idem_begin('args', 'ttl-1min', NULL, lease => '1 s', ttl => '1 minute');
SELECT status FROM idem_begin('args', 'ttl-60s', NULL, lease => '1 s', ttl => '60 s');
SELECT idem_begin('args', 'ttl-59s', NULL, lease => '1 s', ttl => '59 s');
\echo :SQLSTATE
SELECT idem_begin('args', 'ttl-short', NULL, lease => '1 s', ttl => '59.999999 s');
\echo :SQLSTATE
SELECT idem_begin('args', 'ttl-zero', NULL, lease => '1 s', ttl => '0');
\echo :SQLSTATE
SELECT idem_begin('args', 'ttl-negative', NULL, lease => '1 s', ttl => '-1 day');
\echo :SQLSTATE
-- months count as interval comparison counts them: 30 days
SELECT status FROM idem_begin('args', 'ttl-month', NULL, ttl => '1 mon');
SELECT status FROM idem_begin('args', 'ttl-month-30d', NULL, lease => '30 days', ttl => '1 mon');
SELECT idem_begin('args', 'ttl-month-31d', NULL, lease => '31 days', ttl => '1 mon');
\echo :SQLSTATE
SELECT status FROM idem_begin('args', 'ttl-100y', NULL, ttl => '100 years');
SELECT idem_begin('args', 'ttl-1000y', NULL, ttl => '1000 years');
\echo :SQLSTATE
SELECT idem_begin('args', 'ttl-huge', NULL, ttl => '178000000 years');
\echo :SQLSTATE
SELECT idem_begin('args', 'ttl-huge', NULL, ttl => '-178000000 years');
\echo :SQLSTATE
-- The ttl is stored with the claim (the retention starts when the claim is
-- finished).
SELECT key, ttl FROM idem_record
 WHERE operation = 'args' AND key IN ('ttl-1min', 'ttl-60s', 'ttl-month', 'ttl-100y')
 ORDER BY key;

--
-- lease: positive, and not longer than the ttl.
--
SELECT idem_begin('args', 'lease-zero', NULL, lease => '0');
\echo :SQLSTATE
SELECT idem_begin('args', 'lease-negative', NULL, lease => '-1 s');
\echo :SQLSTATE
SELECT idem_begin('args', 'lease-negative', NULL, lease => '1 day -86401 s');
\echo :SQLSTATE
SELECT idem_begin('args', 'lease-long', NULL, lease => '2 min', ttl => '1 min');
\echo :SQLSTATE
SELECT idem_begin('args', 'lease-long', NULL, lease => '25 h');
\echo :SQLSTATE
SELECT idem_begin('args', 'lease-huge', NULL, lease => '178000000 years');
\echo :SQLSTATE
-- A lease equal to the ttl, and the shortest lease, are accepted.
SELECT status FROM idem_begin('args', 'lease-eq-ttl', NULL, lease => '1 min', ttl => '1 min');
SELECT status FROM idem_begin('args', 'lease-1us', NULL, lease => '1 microsecond');
SELECT key, expires_at - created_at AS lease FROM idem_record
 WHERE operation = 'args' AND key IN ('lease-eq-ttl', 'lease-1us')
 ORDER BY key;
-- Nothing was stored for any refused call.
SELECT count(*) AS refused_records FROM idem_record
 WHERE operation = 'args'
   AND key IN ('ttl-59s', 'ttl-short', 'ttl-zero', 'ttl-negative', 'ttl-1000y',
               'ttl-huge', 'ttl-month-31d', 'lease-zero', 'lease-negative', 'lease-long',
               'lease-huge');

--
-- Response size: at most idempotency.max_response_size bytes (the size of
-- the jsonb value, as pg_column_size reports it).  Larger: 54000, with a
-- hint to store a reference instead.  The claim is unharmed and can still
-- be finished with a smaller response or aborted.
--
SELECT pg_column_size('{"blob": "0123456789"}'::jsonb) AS blob_size;
SELECT set_config('idempotency.max_response_size',
                  pg_column_size('{"blob": "0123456789"}'::jsonb)::text, false);
SELECT token AS size_token FROM idem_begin('args', 'size', NULL) \gset
SELECT idem_finish('args', 'size', :size_token, '{"blob": "01234567890"}');
\echo :SQLSTATE
SELECT completed_at IS NULL AS still_pending FROM idem_record
 WHERE operation = 'args' AND key = 'size';
-- exactly the limit is accepted
SELECT idem_finish('args', 'size', :size_token, '{"blob": "0123456789"}');
SELECT response FROM idem_begin('args', 'size', NULL);
-- the default limit is 64kB
RESET idempotency.max_response_size;
SHOW idempotency.max_response_size;
SELECT token AS big_token FROM idem_begin('args', 'size-64k', NULL) \gset
SELECT idem_finish('args', 'size-64k', :big_token,
                   jsonb_build_object('blob', repeat('x', 65536)));
\echo :SQLSTATE
SELECT idem_finish('args', 'size-64k', :big_token,
                   jsonb_build_object('blob', repeat('x', 60000)));
SELECT length(response->>'blob') AS replayed_blob_length
  FROM idem_begin('args', 'size-64k', NULL);

--
-- The text form counts too: a replay sends the response as text, which can
-- be far larger than the stored value (a control character takes six
-- characters, a number such as 1e100000 a hundred thousand digits).  A
-- response whose text form is over the limit is refused (54000) so that
-- every stored response can be replayed.
--
SELECT token AS text_token FROM idem_begin('args', 'size-text', NULL) \gset
SELECT pg_column_size('[1e100000]'::jsonb) < 100 AS small_when_stored;
SELECT idem_finish('args', 'size-text', :text_token, '[1e100000]');
\echo :SQLSTATE
SELECT idem_finish('args', 'size-text', :text_token,
                   jsonb_build_array(repeat(chr(1), 12000)));
\echo :SQLSTATE
SELECT idem_finish('args', 'size-text', :text_token, '[1e1000]');
SELECT length(response::text) AS replayed_text_length
  FROM idem_begin('args', 'size-text', NULL);

--
-- Fingerprints are at most 1024 bytes (a SHA-256 takes 32): a larger one
-- is refused with 22023 and changes nothing.  IK422 shows a stored or
-- requested fingerprint in hex, whole up to 64 bytes, cut beyond.
--
SELECT idem_begin('args', 'fp-huge', decode(repeat('ab', 1025), 'hex'));
\echo :SQLSTATE
SELECT count(*) AS fp_huge_records FROM idem_record WHERE key = 'fp-huge';
SELECT idem_finish('args', 'fp-long',
                   (idem_begin('args', 'fp-long', decode(repeat('ab', 1024), 'hex'))).token,
                   '"long"');
SELECT idem_begin('args', 'fp-long', decode(repeat('cd', 40), 'hex'));
\echo :SQLSTATE

--
-- NULL arguments of idem_inspect are 22004, as everywhere else.
--
SELECT * FROM idem_inspect(NULL, 'k');
\echo :SQLSTATE
SELECT * FROM idem_inspect('args', NULL);
\echo :SQLSTATE
