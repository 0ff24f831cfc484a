
# Copyright (c) 2024, idempotency authors
#
# Mode 'completed': retries racing an in-transaction finish (issue 19,
# item 6) -- a stress oracle.
#
# In mode 'completed' an in-transaction finish moves its record from
# idem_record (claims, unlogged) to idem_result (logged) in the finishing
# transaction.  Version 1.3 looked a key up in idem_result, then in
# idem_record, without the key lock: a finish that committed between the
# two reads left the retry seeing nothing, so it got 'new' and ran the
# request again, and its own finish then failed with 23505 on idem_result's
# primary key.  1.4 reads idem_record first, then idem_result, so the
# record is seen in exactly one of them in every interleaving.
#
# The window is the moment a finishing transaction commits, between two
# index look-ups of a retry a few microseconds apart: a load hits it by
# chance, not on demand, so this file cannot fail deterministically on the
# old ordering -- it is an oracle that catches the race when the load hits
# it.  (Each hot key is fought over from its first claim on, by retries
# that do nothing but look it up, so commits of finishes and look-ups
# overlap all the time.)
#
# 8 pgbench clients for 10 s, in mode 'completed', over a small hot key set
# that moves on every 20 ms (four keys per 20 ms slot: ttl cannot be
# shortened to recycle keys, so fresh keys have to keep coming for the
# first claims and their finishes to go on), two transaction shapes:
#
#   wait   BEGIN; idem_begin (in_flight 'wait'); on 'new' INSERT the effect
#          row and idem_finish with {"effect_id": id}; COMMIT
#   raise  the same with in_flight 'raise' in a PL/pgSQL function that
#          catches IK409 and ends the transaction: a duplicate that looks
#          the key up again and again while it is in flight
#
# Every replay checks that the replayed effect_id is the key's effect row
# (else a division by zero aborts the client).  Afterwards:
#   - pgbench: no failed transaction, no aborted client, nothing on stderr;
#     the server log has no 23505 (duplicate key) and no other ERROR but
#     the IK409 refusals of the 'raise' shape;
#   - the race was exercised: the counters (shared_preload_libraries) show
#     claims that waited for an in-flight claim and refusals of 'raise';
#   - the oracle: every key with a completed record has exactly one effect
#     row, with the record's token and id; no effect row lacks its
#     record; nothing is pending; no completed record is in idem_record;
#   - every finished key replays its response to one more retry.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $clients = 8;
my $seconds = 10;

my $node = PostgreSQL::Test::Cluster->new('completed_race');
$node->init;
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
log_statement = none
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	-- no unique constraint: a second effect of a key must be possible, to be seen
	CREATE TABLE effect (id bigserial PRIMARY KEY, key text NOT NULL, token bigint NOT NULL);
	CREATE INDEX ON effect (key);

	-- a claim with 'raise': 1 new, 0 replay, 2 in flight (IK409, caught:
	-- the claim is made in a subtransaction)
	CREATE FUNCTION claim_raise(key text, OUT st int, OUT token bigint, OUT eid bigint)
	LANGUAGE plpgsql AS $$
	DECLARE
		c idem_claim;
	BEGIN
		c := idem_begin('race', key, idem_fingerprint(key), in_flight => 'raise');
		st := CASE c.status WHEN 'new' THEN 1 ELSE 0 END;
		token := coalesce(c.token, 0);
		eid := coalesce((c.response->>'effect_id')::bigint, 0);
	EXCEPTION WHEN SQLSTATE 'IK409' THEN
		st := 2; token := 0; eid := 0;
	END $$;
});
is($node->safe_psql('postgres', 'SELECT idem_durability()'), 'completed', 'mode completed');

# the key: 'r' || :kk, kk = the current 20 ms slot * 10 + k, k in 1..4
my $pick_key = q{
\set k random(1, 4)
SELECT floor(extract(epoch FROM clock_timestamp()) * 50)::bigint * 10 + :k AS kk \gset
};
my $effect_and_finish = q{
INSERT INTO effect (key, token) VALUES ('r' || :kk, :token) RETURNING id AS new_eid \gset
SELECT idem_finish('race', 'r' || :kk, :token, jsonb_build_object('effect_id', :new_eid));
COMMIT;
};
my $check_replay = q{
SELECT 1 / count(*) FROM effect WHERE id = :eid AND key = 'r' || :kk;
COMMIT;
};
my %scripts = (
	'wait@1' => $pick_key . q{
BEGIN;
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS token,
       coalesce(response->>'effect_id', '0') AS eid
  FROM idem_begin('race', 'r' || :kk, idem_fingerprint('r' || :kk)) b \gset
\if :is_new
} . $effect_and_finish . q{
\else
} . $check_replay . q{
\endif
},
	'raise@1' => $pick_key . q{
BEGIN;
SELECT st, token, eid FROM claim_raise('r' || :kk) \gset
\if :st = 1
} . $effect_and_finish . q{
\elif :st = 0
} . $check_replay . q{
\else
ROLLBACK;
\endif
},
);

my $log_offset = -s $node->logfile;
$node->pgbench(
	"--no-vacuum --client=$clients --jobs=2 --time=$seconds",
	0,
	[ qr{processed: \d+}, qr{number of failed transactions: 0 } ],
	[qr{^$}],
	"$clients clients for ${seconds}s on hot keys: no error, no aborted client (no 23505, no wrong replay)",
	\%scripts);

my $log = slurp_file($node->logfile, $log_offset);
unlike($log, qr/duplicate key value|23505/, 'the server log shows no duplicate key error');
is(join('', grep { /ERROR:/ && !/is already being processed|in progress/ } split /^/, $log),
	'', 'the server log shows no ERROR but the in-flight refusals of the raise shape');

# ---- the race was exercised ----

my ($claims, $replays, $waits, $refusals) = split /\|/, $node->safe_psql('postgres', q{
	SELECT claims || '|' || replays || '|' || waits || '|' || in_progress_refusals FROM idem_stats_counters});
my ($completed, $pending, $in_record, $effects, $effect_keys) = split /\|/, $node->safe_psql('postgres', qq{
	SELECT (SELECT count(*) FROM $IDEM_RECORDS r WHERE completed_at IS NOT NULL) || '|' ||
	       (SELECT count(*) FROM $IDEM_RECORDS r WHERE completed_at IS NULL) || '|' ||
	       (SELECT count(*) FROM idem_record WHERE completed_at IS NOT NULL) || '|' ||
	       (SELECT count(*) FROM effect) || '|' ||
	       (SELECT count(DISTINCT key) FROM effect)});
diag("$claims claims, $replays replays, $waits waits for an in-flight claim, "
	  . "$refusals in-flight refusals; $completed keys completed, $effects effect rows");
cmp_ok($completed, '>', 200, 'fresh hot keys kept coming: many keys were completed');
cmp_ok($replays, '>', $completed, 'retries of finished keys replayed');
cmp_ok($waits, '>', 0, 'retries waited for in-flight claims (a finish committed under them)');
cmp_ok($refusals, '>', 0, 'retries looked keys up while they were in flight (raise)');

# ---- the oracle ----

is($effects, $effect_keys, 'no key has two effect rows');
is($node->safe_psql('postgres', qq{
	SELECT count(*) FROM $IDEM_RECORDS r
	 WHERE r.completed_at IS NOT NULL
	   AND (SELECT count(*) FROM effect e
	         WHERE e.key = r.key AND e.token = r.token
	           AND r.response = jsonb_build_object('effect_id', e.id)) <> 1}),
	'0', 'every completed key has exactly one effect row, with its token and id');
is($node->safe_psql('postgres', qq{
	SELECT count(*) FROM effect e
	 WHERE NOT EXISTS (SELECT 1 FROM $IDEM_RECORDS r WHERE r.key = e.key AND r.completed_at IS NOT NULL)}),
	'0', 'no effect row lacks its completed record');
is($pending, '0', 'no claim is left pending');
is($in_record, '0', 'mode completed: no completed record is in idem_record');
is($node->safe_psql('postgres', q{
	SELECT count(*) FILTER (WHERE b.status IS DISTINCT FROM 'replay'
	                           OR b.response IS DISTINCT FROM jsonb_build_object('effect_id', e.id))
	       || '|' || count(*)
	  FROM effect e, LATERAL idem_begin('race', e.key, idem_fingerprint(e.key), in_flight => 'raise') b}),
	"0|$effects", "every finished key ($effects) replays its response");

unlike(slurp_file($node->logfile), qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');
$node->stop;
done_testing();
