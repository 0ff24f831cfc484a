--
-- 40_fingerprint: the idem_fingerprint helper, and how idem_begin compares
-- fingerprints (equal: replay; different: IK422 with both in the DETAIL).
--
\set VERBOSITY default

--
-- idem_fingerprint: SHA-256 over an unambiguous encoding of the arguments'
-- text forms.  Per argument: 0x00 for NULL; otherwise 0x01, the text
-- form's length in bytes as 4 bytes big-endian, and the text form's bytes.
--
-- 32 bytes
SELECT length(idem_fingerprint('a')) AS bytes,
       length(idem_fingerprint('a', 2, NULL::text, now()::date)) AS bytes_4_args;
-- unambiguous: ('a','bc') and ('ab','c') differ, NULL and '' differ, and
-- one argument differs from two
SELECT idem_fingerprint('a', 'bc') <> idem_fingerprint('ab', 'c') AS split_matters,
       idem_fingerprint(NULL::text) <> idem_fingerprint('') AS null_is_not_empty,
       idem_fingerprint(''::text, ''::text) <> idem_fingerprint(''::text) AS count_matters,
       idem_fingerprint('a', NULL::text) <> idem_fingerprint(NULL::text, 'a') AS order_matters;

-- Deterministic, the same in every session and on every server: here is
-- the constant for (1, 'x') ...
SELECT idem_fingerprint(1, 'x');
SELECT idem_fingerprint(1, 'x') =
       '\x4f6d750d6d368731c522c203c4a920154c81031f326746fe2da2320e44ef07d8'::bytea
       AS known_constant;
-- ... and the same value built by hand from the documented encoding, hashed
-- with the built-in sha256() and with pgcrypto's digest().
CREATE FUNCTION fp_part(t text) RETURNS bytea LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN t IS NULL THEN '\x00'::bytea
              ELSE '\x01'::bytea || int4send(octet_length(t)) || convert_to(t, 'UTF8')
         END
$$;
SELECT fp_part('1') || fp_part('x') AS encoding_of_1_x;
SELECT sha256(fp_part('1') || fp_part('x')) = idem_fingerprint(1, 'x') AS builtin_sha256,
       digest(fp_part('1') || fp_part('x'), 'sha256') = idem_fingerprint(1, 'x') AS pgcrypto_sha256;
-- The same for NULLs, empty strings and multibyte text (lengths in bytes).
SELECT sha256(fp_part('é') || fp_part(NULL) || fp_part('') || fp_part('42'))
       = idem_fingerprint('é'::text, NULL::text, ''::text, 42) AS by_hand;

-- Only the text form counts: 100 the integer, '100' the text and 100 the
-- bigint are the same; 100.0 is not.  Text forms of some types follow
-- settings (timestamptz follows TimeZone): pass such values as text of a
-- fixed format.
SELECT idem_fingerprint(100) = idem_fingerprint('100'::text) AS int_eq_text,
       idem_fingerprint(100) = idem_fingerprint(100::bigint) AS int_eq_bigint,
       idem_fingerprint(100) = idem_fingerprint(100.0) AS int_eq_numeric;
SET TimeZone = 'UTC';
SELECT idem_fingerprint('2024-01-01 12:00:00+00'::timestamptz) AS fp_utc \gset
SET TimeZone = 'Asia/Tokyo';
SELECT idem_fingerprint('2024-01-01 12:00:00+00'::timestamptz) = :'fp_utc' AS same_in_tokyo;
RESET TimeZone;

-- VARIADIC: an array passed with VARIADIC is the same as its elements
-- passed one by one; an array passed as one argument is one value (its
-- text form).  VARIADIC NULL gives NULL, as concat(VARIADIC NULL) does.
SELECT idem_fingerprint(VARIADIC ARRAY['a', 'bc']) = idem_fingerprint('a', 'bc') AS text_array,
       idem_fingerprint(VARIADIC ARRAY[1, 2, 3]) = idem_fingerprint(1, 2, 3) AS int_array,
       idem_fingerprint(VARIADIC ARRAY['a', NULL]) = idem_fingerprint('a', NULL::text) AS with_null,
       idem_fingerprint(ARRAY[1, 2, 3]) = idem_fingerprint('{1,2,3}'::text) AS one_array_arg,
       idem_fingerprint(VARIADIC NULL::text[]) IS NULL AS variadic_null;

--
-- idem_begin compares fingerprints exactly.
--
SELECT token AS f1_token FROM idem_begin('fp', 'f1', idem_fingerprint('order-42', 100)) \gset
SELECT idem_finish('fp', 'f1', :f1_token, '{"charge": "ch_1"}');
-- equal: replay
SELECT status, response FROM idem_begin('fp', 'f1', idem_fingerprint('order-42', 100));
-- different: IK422, both fingerprints in hex in the DETAIL
SELECT idem_begin('fp', 'f1', idem_fingerprint('order-42', 5));
\echo :SQLSTATE
-- ... and the record is untouched.
SELECT status, response FROM idem_begin('fp', 'f1', idem_fingerprint('order-42', 100));

-- The fingerprint is compared before anything else: a duplicate of a
-- pending claim with another fingerprint gets IK422, not IK409 -- in the
-- owner's own transaction too.
SELECT token AS f2_token FROM idem_begin('fp', 'f2', '\x01') \gset
SELECT idem_begin('fp', 'f2', '\x02', in_flight => 'raise');
\echo :SQLSTATE
SELECT idem_begin('fp', 'f2', '\x02', in_flight => 'wait');
\echo :SQLSTATE
SELECT idem_abort('fp', 'f2', :f2_token);
BEGIN;
SELECT status FROM idem_begin('fp', 'f3', '\x01');
SELECT idem_begin('fp', 'f3', '\x02');
\echo :SQLSTATE
ROLLBACK;

-- NULL equals only NULL: a claim without a fingerprint is replayed only to
-- requests without one.
SELECT idem_finish('fp', 'n1', (idem_begin('fp', 'n1', NULL)).token, '"n1"');
SELECT status, response FROM idem_begin('fp', 'n1', NULL);
SELECT idem_begin('fp', 'n1', '\x01');
\echo :SQLSTATE
-- ... and the other way round.
SELECT idem_finish('fp', 'n2', (idem_begin('fp', 'n2', '\x01')).token, '"n2"');
SELECT idem_begin('fp', 'n2', NULL);
\echo :SQLSTATE
-- An empty bytea is a fingerprint, not NULL.
SELECT idem_finish('fp', 'n3', (idem_begin('fp', 'n3', '\x')).token, '"n3"');
SELECT status, response FROM idem_begin('fp', 'n3', '\x');
SELECT idem_begin('fp', 'n3', NULL);
\echo :SQLSTATE

--
-- Any bytea is a fingerprint: pgcrypto's digest() and, for keyed
-- fingerprints that do not reveal the request, hmac().
--
SELECT idem_finish('payment.charge', 'pg1',
                   (idem_begin('payment.charge', 'pg1',
                               digest('order-42|100', 'sha256'))).token,
                   '{"charge": "ch_pg1"}');
SELECT status, response
  FROM idem_begin('payment.charge', 'pg1', digest('order-42|100', 'sha256'));
SELECT idem_begin('payment.charge', 'pg1', digest('order-42|5', 'sha256'));
\echo :SQLSTATE

SELECT idem_finish('payment.charge', 'pg2',
                   (idem_begin('payment.charge', 'pg2',
                               hmac('order-42|100', 'secret', 'sha256'))).token,
                   '{"charge": "ch_pg2"}');
SELECT status, response
  FROM idem_begin('payment.charge', 'pg2', hmac('order-42|100', 'secret', 'sha256'));
SELECT idem_begin('payment.charge', 'pg2', hmac('order-42|5', 'secret', 'sha256'));
\echo :SQLSTATE
-- the same request under another secret is a different fingerprint
SELECT idem_begin('payment.charge', 'pg2', hmac('order-42|100', 'other', 'sha256'));
\echo :SQLSTATE
