
# Copyright (c) 2024, idempotency authors
#
# Durability mode 'completed' across a fail-over to a synchronous standby.
#
# A primary (a new installation: mode 'completed') with a streaming
# standby named in synchronous_standby_names.  On the standby idem_result
# (logged) is replicated and readable; idem_record (unlogged) has no data
# there.
#
# Two loads run on the primary (pgbench), over the same 2,000 keys each:
#   intx  BEGIN; idem_begin; on 'new' INSERT the effect row (LOGGED) and
#         idem_finish with {"effect_id": id}; COMMIT (one in ten ROLLBACK):
#         an effect row exists <=> its finish committed
#   ext   autocommit idem_begin (lease 4 s), autocommit INSERT of the
#         effect row, autocommit idem_finish, then an autocommit INSERT
#         into "finished" (LOGGED): the finish committed
# In the middle of them the primary stops (immediate) and the standby is
# promoted.  On the new primary:
#   - the mode is still 'completed';
#   - every key finished before the fail-over replays its stored response
#     (det-done, det-fx, every intx effect row, every finished ext key),
#     and every completed record has its effect row;
#   - a claim pending at the fail-over may be lost: its retry gets 'new',
#     without an error;
#   - the loads run again over the same keys (6 s of pgbench, then one
#     retry of every key with psql) without an error, and no intx key and
#     no ext key finished before the fail-over gets a second effect;
#   - new tokens are greater than every token the old primary issued (all
#     of them were of the epoch the old primary was in: below
#     (epoch + 1) << 25).

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :bench);

my $nkeys = 2000;

# the loads (IdemTest's start_bench and start_sweep): the options of their
# scripts, and the pgbench clients of each shape
my %load = (keys => $nkeys, lease => '4 s');
my %clients = (intx => 4, ext => 3);

# ---- the primary and its synchronous standby ----

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
$primary->append_conf('postgresql.conf', "max_connections = 40\n");
$primary->start;
$primary->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE effect (id bigserial PRIMARY KEY, op text NOT NULL, key text NOT NULL,
	                     k int NOT NULL, token bigint NOT NULL, epoch int NOT NULL);
	CREATE TABLE finished (op text NOT NULL, key text NOT NULL, eid bigint NOT NULL,
	                       epoch int NOT NULL);
});
is($primary->safe_psql('postgres', 'SELECT idem_durability()'), 'completed',
	'a new installation is in mode completed');

$primary->backup('b1');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'b1', has_streaming => 1);
$standby->start;
# after the backup: the standby, once promoted, has no synchronous standby
$primary->append_conf('postgresql.conf', "synchronous_standby_names = '*'\n");
$primary->reload;
ok( $primary->poll_query_until('postgres',
		q{SELECT count(*) = 1 FROM pg_stat_replication WHERE sync_state = 'sync'}),
	'the standby is synchronous');

# the deterministic keys, after the standby became synchronous
my $t = token_of(claim($primary, 'postgres', 'det-done'));
$primary->safe_psql('postgres', qq{SELECT idem_finish('det', 'det-done', $t, '{"det": "done"}')});
my $fx_id = $primary->safe_psql('postgres', q{
	BEGIN;
	SELECT token FROM idem_begin('det', 'det-fx', idem_fingerprint('det-fx')) b \gset
	INSERT INTO effect (op, key, k, token, epoch) VALUES ('det', 'det-fx', 0, :token, 1)
	  RETURNING id AS fx_id \gset
	SELECT idem_finish('det', 'det-fx', :token, jsonb_build_object('effect_id', :fx_id)) \gset
	COMMIT;
	SELECT id FROM effect WHERE key = 'det-fx';});
my $t_pending = token_of(claim($primary, 'postgres', 'det-pending', q{lease => '1 h'}));
$primary->wait_for_catchup($standby);

# on the standby: the results are replicated, the claims are not
is($standby->safe_psql('postgres',
		q{SELECT string_agg(key, ',' ORDER BY key) FROM idem_result WHERE operation = 'det'}),
	'det-done,det-fx', 'standby: idem_result holds the finished records, replicated');
{
	my ($st, $out, $err) = try_sql($standby, 'postgres', 'SELECT count(*) FROM idem_record');
	is($st, '0A000', 'standby: idem_record (unlogged) cannot be read in recovery') or diag($err);
}

# ---- a fail-over in the middle of the loads ----

my @bench1 = map { start_bench($primary, 'postgres', %load, shape => $_, clients => $clients{$_},
		epoch => 1, seconds => 120) } qw(intx ext);
ok( $primary->poll_query_until('postgres', q{
		SELECT (SELECT count(*) FROM effect WHERE op = 'intx') >= 500
		   AND (SELECT count(*) FROM finished) >= 300}),
	'primary: the loads are under way');
ok(!grep({ !$_->{run}->pumpable } @bench1), 'both loads are still running at the fail-over');
# the epoch the old primary is in: every token it issued is below this
my $bound = $primary->safe_psql('postgres', q{SELECT ((last_value >> 25) + 1) << 25 FROM idem_token_seq});
my $max_token_seen = $primary->safe_psql('postgres', 'SELECT max(token) FROM effect');
$primary->stop('immediate');
for my $h (@bench1)
{
	finish_bench($h);
	like($h->{stderr}, qr/aborted|connection|terminat/i, "$h->{name}: the fail-over cut the load off");
	unlike($h->{stderr}, qr/division by zero/, "$h->{name}: no replay before the fail-over named a wrong effect");
}
$standby->promote;
ok($standby->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'), 'the standby was promoted');
my $new = $standby;

# ---- on the new primary ----

is($new->safe_psql('postgres', 'SELECT idem_durability()'), 'completed', 'new primary: mode completed');
is($new->safe_psql('postgres', q{SELECT string_agg(relpersistence::text, '|' ORDER BY relname)
	FROM pg_class WHERE relname IN ('idem_record', 'idem_result')}),
	'u|p', 'new primary: idem_record unlogged, idem_result logged');

my $n_intx = $new->safe_psql('postgres', q{SELECT count(*) FROM effect WHERE op = 'intx' AND epoch = 1});
my $n_ext = $new->safe_psql('postgres', q{SELECT count(*) FROM finished WHERE epoch = 1});
note("$n_intx in-transaction and $n_ext external keys finished on the old primary");
cmp_ok($n_intx, '>=', 500, 'the committed in-transaction effects reached the synchronous standby');
cmp_ok($n_ext, '>=', 300, 'the committed external finishes reached the synchronous standby');

is(claim($new, 'postgres', 'det-done'), 'replay||{"det": "done"}', 'new primary: det-done replays its response');
is(claim($new, 'postgres', 'det-fx'), qq{replay||{"effect_id": $fx_id}}, 'new primary: det-fx replays its effect\'s id');
{
	my ($st, $out, $err) = try_sql($new, 'postgres', q{
		SELECT status FROM idem_begin('det', 'det-pending', idem_fingerprint('det-pending'),
		                              in_flight => 'raise')});
	is("$st|$out", '00000|new',
		'new primary: det-pending (a claim, unlogged) was lost: a retry gets new, no error (allowed)')
	  or diag($err);
}

my $probe = sub {
	my ($from) = @_;
	return $new->safe_psql('postgres', qq{
		BEGIN;
		SELECT count(*) FILTER (WHERE b.status = 'new') || '|' ||
		       count(*) FILTER (WHERE b.status = 'replay'
		                          AND b.response = jsonb_build_object('effect_id', e.id)) || '|' ||
		       count(*)
		  FROM $from, LATERAL idem_begin(e.op, e.key, idem_fingerprint(e.k), in_flight => 'raise') b;
		ROLLBACK;});
};
is($probe->(q{(SELECT e.* FROM effect e WHERE e.op = 'intx' AND e.epoch = 1) e}),
	"0|$n_intx|$n_intx",
	"new primary: every in-transaction key finished before the fail-over ($n_intx) replays its response");
is($probe->(q{(SELECT e.* FROM finished f JOIN effect e ON e.id = f.eid WHERE f.epoch = 1) e}),
	"0|$n_ext|$n_ext",
	"new primary: every external key finished before the fail-over ($n_ext) replays its response");
is($new->safe_psql('postgres', qq{
	SELECT count(*) FROM $IDEM_RECORDS r
	 WHERE r.completed_at IS NOT NULL AND r.operation IN ('intx', 'ext')
	   AND NOT EXISTS (SELECT 1 FROM effect e
	                    WHERE e.op = r.operation AND e.key = r.key AND e.token = r.token
	                      AND r.response = jsonb_build_object('effect_id', e.id))}),
	'0', 'new primary: every completed record has its effect row, token and id');

# a fresh claim: its token is above the old primary's epoch
my $t_fresh = token_of(claim($new, 'postgres', 'det-fresh'));
cmp_ok($t_fresh, '>=', $bound, 'new primary: a new token is greater than every token of the old primary');

# ---- the loads again, over the same keys ----

my @bench2 = map { start_bench($new, 'postgres', %load, shape => $_, clients => $clients{$_},
		epoch => 2, seconds => 6) } qw(intx ext);
for my $h (@bench2)
{
	finish_bench($h);
	is($h->{rc}, 0, "$h->{name}: the load on the new primary exits 0") or diag($h->{stderr});
	unlike($h->{stderr}, qr/ERROR|aborted/, "$h->{name}: the load on the new primary met no error");
	my ($n) = $h->{stdout} =~ /number of transactions actually processed: (\d+)/;
	cmp_ok($n // 0, '>', 100, "$h->{name}: the load on the new primary ran (" . ($n // 0) . ' transactions)');
}
# then one retry of every key of both loads
for my $h (map { start_sweep($new, 'postgres', %load, shape => $_, epoch => 3) } qw(intx ext))
{
	finish_bench($h);
	is($h->{rc}, 0, "$h->{name}: a retry of every key ($nkeys) on the new primary ran without an error")
	  or diag($h->{stderr});
}
is($new->safe_psql('postgres', q{SELECT count(DISTINCT key) FROM effect WHERE op = 'intx'}), $nkeys,
	'every in-transaction key has its effect (the retry of every key reached all of them)');
cmp_ok($new->safe_psql('postgres', q{SELECT min(token) FROM effect WHERE epoch >= 2}), '>=', $bound,
	"new primary: every token of the load is greater than every token of the old primary");
cmp_ok($bound, '>', $max_token_seen, '(the bound is above every token seen on the old primary)');
is($new->safe_psql('postgres', q{
	SELECT count(*) FROM (SELECT key FROM effect WHERE op = 'intx' GROUP BY key HAVING count(*) > 1) d}),
	'0', 'no in-transaction key has two effects, across the fail-over');
is($new->safe_psql('postgres', q{
	SELECT count(*) FROM finished f
	 WHERE f.epoch = 1 AND (SELECT count(*) FROM effect e WHERE e.op = 'ext' AND e.key = f.key) <> 1}),
	'0', 'no external key finished before the fail-over has a second effect');
is($new->safe_psql('postgres', q{
	SELECT count(*) FROM (SELECT op, key FROM effect WHERE epoch >= 2 GROUP BY op, key HAVING count(*) > 1) d}),
	'0', 'no key has two effects on the new primary');
is($new->safe_psql('postgres', q{SELECT count(*) FROM idem_record WHERE completed_at IS NOT NULL}),
	'0', 'new primary: finished records went to idem_result, none is in idem_record');

for my $n ($primary, $new)
{
	unlike(slurp_file($n->logfile), qr/terminated by signal|PANIC|TRAP:/, $n->name . ': no backend crashed');
}
$new->stop;
done_testing();
