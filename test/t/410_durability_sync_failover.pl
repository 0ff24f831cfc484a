
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

use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $nkeys = 2000;

# ---- helpers ----

# Run $sql; returns (sqlstate, stdout, stderr): 00000 on success
sub try_sql
{
	my ($node, $sql) = @_;
	my ($rc, $out, $err) = $node->psql('postgres', $sql,
		extra_params => [ '-v', 'VERBOSITY=verbose' ],
		on_error_stop => 1);
	return ('00000', $out, $err) if $rc == 0;
	my ($state) = $err =~ /(?:ERROR|FATAL|PANIC):\s+([0-9A-Z]{5}):/;
	return ($state // "rc=$rc", $out, $err);
}

my $records = q{(SELECT operation, key, token, completed_at, response FROM idem_record
	UNION ALL SELECT operation, key, token, completed_at, response FROM idem_result)};

my %scripts = (
	intx => qq{
\\set k random(1, $nkeys)
\\set r random(1, 10)
BEGIN;
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS token,
       coalesce(response->>'effect_id', '0') AS eid
  FROM idem_begin('intx', 'intx-' || :k, idem_fingerprint(:k)) b \\gset
\\if :is_new
INSERT INTO effect (op, key, k, token, epoch) VALUES ('intx', 'intx-' || :k, :k, :token, :epoch)
  RETURNING id AS new_eid \\gset
SELECT idem_finish('intx', 'intx-' || :k, :token, jsonb_build_object('effect_id', :new_eid));
\\if :r = 1
ROLLBACK;
\\else
COMMIT;
\\endif
\\else
SELECT 1 / count(*) FROM effect WHERE id = :eid AND op = 'intx' AND key = 'intx-' || :k;
COMMIT;
\\endif
},
	ext => qq{
\\set k random(1, $nkeys)
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS token,
       coalesce(response->>'effect_id', '0') AS eid
  FROM idem_begin('ext', 'ext-' || :k, idem_fingerprint(:k), lease => '4 s') b \\gset
\\if :is_new
INSERT INTO effect (op, key, k, token, epoch) VALUES ('ext', 'ext-' || :k, :k, :token, :epoch)
  RETURNING id AS new_eid \\gset
SELECT idem_finish('ext', 'ext-' || :k, :token, jsonb_build_object('effect_id', :new_eid));
INSERT INTO finished (op, key, eid, epoch) VALUES ('ext', 'ext-' || :k, :new_eid, :epoch);
\\else
SELECT 1 / count(*) FROM effect WHERE id = :eid AND op = 'ext' AND key = 'ext-' || :k;
\\endif
},
);
my %clients = (intx => 4, ext => 3);

sub start_bench
{
	my ($node, $shape, $epoch, $seconds) = @_;
	my $base = $node->basedir . "/bench-$shape-$epoch";
	append_to_file("$base.sql", $scripts{$shape});
	my $h = { out => "$base.out", err => "$base.err", name => "$shape/epoch $epoch" };
	$h->{run} = IPC::Run::start(
		[ 'pgbench', '-n', '-c', $clients{$shape}, '-j', 1, '-T', $seconds,
			'-D', "epoch=$epoch", '-f', "$base.sql", $node->connstr('postgres') ],
		'>', $h->{out}, '2>', $h->{err});
	return $h;
}

sub finish_bench
{
	my ($h) = @_;
	eval { $h->{run}->finish; };
	$h->{rc} = $h->{run}->result(0);
	$h->{stdout} = slurp_file($h->{out});
	$h->{stderr} = slurp_file($h->{err});
	return $h;
}

# "status|token|response" of a claim of det's $key, or "ERROR sqlstate"
sub claim
{
	my ($node, $key, $extra) = @_;
	$extra = defined $extra ? ", $extra" : '';
	my ($st, $out, $err) = try_sql($node, qq{
		SELECT status || '|' || coalesce(token::text, '') || '|' || coalesce(response::text, '')
		  FROM idem_begin('det', '$key', idem_fingerprint('$key')$extra) b});
	return $st eq '00000' ? $out : "ERROR $st";
}

# One retry of every key 1..$nkeys of $shape, one after the other, with
# psql (the loads' scripts without the random parts, always committing).
sub start_sweep
{
	my ($node, $shape, $epoch) = @_;
	my $body = $scripts{$shape};
	$body =~ s/^\\set [kr] .*\n//mg;
	$body =~ s/^\\if :r = 1\nROLLBACK;\n\\else\n(COMMIT;)\n\\endif\n/$1\n/m;
	my $file = $node->basedir . "/sweep-$shape.sql";
	append_to_file($file, join '', map { "\\set k $_\n$body" } 1 .. $nkeys);
	my $h = { out => '', err => '', name => "$shape/sweep" };
	$h->{run} = IPC::Run::start(
		[ 'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', '-v', "epoch=$epoch", '-f', $file,
			'-o', '/dev/null', '-d', $node->connstr('postgres') ],
		'>', \$h->{out}, '2>', \$h->{err});
	return $h;
}

sub token_of
{
	my ($c) = @_;
	my ($t) = $c =~ /^new\|(\d+)\|$/ or die "not a new claim: $c";
	return $t;
}

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
my $t = token_of(claim($primary, 'det-done'));
$primary->safe_psql('postgres', qq{SELECT idem_finish('det', 'det-done', $t, '{"det": "done"}')});
my $fx_id = $primary->safe_psql('postgres', q{
	BEGIN;
	SELECT token FROM idem_begin('det', 'det-fx', idem_fingerprint('det-fx')) b \gset
	INSERT INTO effect (op, key, k, token, epoch) VALUES ('det', 'det-fx', 0, :token, 1)
	  RETURNING id AS fx_id \gset
	SELECT idem_finish('det', 'det-fx', :token, jsonb_build_object('effect_id', :fx_id)) \gset
	COMMIT;
	SELECT id FROM effect WHERE key = 'det-fx';});
my $t_pending = token_of(claim($primary, 'det-pending', q{lease => '1 h'}));
$primary->wait_for_catchup($standby);

# on the standby: the results are replicated, the claims are not
is($standby->safe_psql('postgres',
		q{SELECT string_agg(key, ',' ORDER BY key) FROM idem_result WHERE operation = 'det'}),
	'det-done,det-fx', 'standby: idem_result holds the finished records, replicated');
{
	my ($st, $out, $err) = try_sql($standby, 'SELECT count(*) FROM idem_record');
	is($st, '0A000', 'standby: idem_record (unlogged) cannot be read in recovery') or diag($err);
}

# ---- a fail-over in the middle of the loads ----

my @bench1 = map { start_bench($primary, $_, 1, 120) } qw(intx ext);
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

is(claim($new, 'det-done'), 'replay||{"det": "done"}', 'new primary: det-done replays its response');
is(claim($new, 'det-fx'), qq{replay||{"effect_id": $fx_id}}, 'new primary: det-fx replays its effect\'s id');
{
	my ($st, $out, $err) = try_sql($new, q{
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
	SELECT count(*) FROM $records r
	 WHERE r.completed_at IS NOT NULL AND r.operation IN ('intx', 'ext')
	   AND NOT EXISTS (SELECT 1 FROM effect e
	                    WHERE e.op = r.operation AND e.key = r.key AND e.token = r.token
	                      AND r.response = jsonb_build_object('effect_id', e.id))}),
	'0', 'new primary: every completed record has its effect row, token and id');

# a fresh claim: its token is above the old primary's epoch
my $t_fresh = token_of(claim($new, 'det-fresh'));
cmp_ok($t_fresh, '>=', $bound, 'new primary: a new token is greater than every token of the old primary');

# ---- the loads again, over the same keys ----

my @bench2 = map { start_bench($new, $_, 2, 6) } qw(intx ext);
for my $h (@bench2)
{
	finish_bench($h);
	is($h->{rc}, 0, "$h->{name}: the load on the new primary exits 0") or diag($h->{stderr});
	unlike($h->{stderr}, qr/ERROR|aborted/, "$h->{name}: the load on the new primary met no error");
	my ($n) = $h->{stdout} =~ /number of transactions actually processed: (\d+)/;
	cmp_ok($n // 0, '>', 100, "$h->{name}: the load on the new primary ran (" . ($n // 0) . ' transactions)');
}
# then one retry of every key of both loads
for my $h (map { start_sweep($new, $_, 3) } qw(intx ext))
{
	eval { $h->{run}->finish; };
	is($h->{run}->result(0), 0, "$h->{name}: a retry of every key ($nkeys) on the new primary ran without an error")
	  or diag($h->{err});
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
