
# Copyright (c) 2024, idempotency authors
#
# Durability-mode switches under load lose nothing.
#
# Two loads (pgbench), over 100,000 keys each, so that new keys keep coming
# all along:
#   intx  BEGIN; idem_begin; on 'new' INSERT the effect row and idem_finish
#         with {"effect_id": id}; COMMIT (one in ten ROLLBACK)
#   ext   autocommit idem_begin, autocommit INSERT of the effect row,
#         autocommit idem_finish, then INSERT into "finished": a claim
#         that a switch can move past between its begin and its finish
# On 'replay' both check that the response names this key's effect (a
# division by zero otherwise).
#
# While they run the mode goes none -> completed -> all -> completed ->
# none, three times, each idem_set_durability in its own transaction, with
# 150 newly completed keys between two switches.  After each switch:
# idem_durability() reports it, the tables' persistence is the mode's, and
# the completed records are where the mode keeps them (in 'completed' none
# is in idem_record; otherwise idem_result is empty).
#
# Afterwards (the loads stopped through a flag, so that no attempt is cut
# off half-way): both loads ran without an error; every effect replays its
# response (intx and finished ext keys), every completed record has its
# effect, no key has two effects, no claim is left pending;
# bt_index_check(index, heapallindexed => true) is clean on every index of
# idem_record and idem_result; idem_durability() reports the last mode.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :bench);

my $nkeys = 100000;
my @cycle = qw(completed all completed none);
my $cycles = 3;
my %persistence = (none => 'u|u', completed => 'u|p', all => 'p|p');   # idem_record|idem_result

my $node = PostgreSQL::Test::Cluster->new('durability_switch');
$node->init;
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE EXTENSION amcheck;
	SELECT idem_set_durability('none');
	CREATE TABLE effect (id bigserial PRIMARY KEY, op text NOT NULL, key text NOT NULL,
	                     k int NOT NULL, token bigint NOT NULL);
	CREATE TABLE finished (op text NOT NULL, key text NOT NULL, eid bigint NOT NULL);
	CREATE TABLE ctl (stop int NOT NULL);
	INSERT INTO ctl VALUES (0);
});
is($node->safe_psql('postgres', 'SELECT idem_durability()'), 'none', 'start in mode none');

# the loads (IdemTest's start_bench): the options of their scripts (each
# attempt first checks the stop flag in ctl), and the pgbench clients of
# each shape
my %load = (keys => $nkeys, stop_flag => 1, seconds => 300);
my %clients = (intx => 4, ext => 2);

# wait until the loads completed $n more keys
sub progressed
{
	my ($n) = @_;
	my $q = q{SELECT count(*) FROM effect};
	my $base = $node->safe_psql('postgres', $q);
	return $node->poll_query_until('postgres', "SELECT ($q) >= $base + $n");
}

# ---- the switches, under load ----

my @bench = map { start_bench($node, 'postgres', %load, shape => $_, clients => $clients{$_}) } qw(intx ext);
ok(progressed(300), 'the loads are under way');

my ($switch_fail, $state_fail, @mode_seq) = (0, 0);
my $last;
for my $round (1 .. $cycles)
{
	for my $mode (@cycle)
	{
		ok(progressed(150), "round $round, before $mode: the loads progress");
		my ($rc, $out, $err) = $node->psql('postgres',
			qq{BEGIN; SELECT idem_set_durability('$mode'); COMMIT;},
			extra_params => [ '-v', 'VERBOSITY=verbose' ], on_error_stop => 1);
		if ($rc != 0)
		{
			$switch_fail++;
			diag("round $round: idem_set_durability('$mode') failed: $err");
			next;
		}
		$last = $mode;
		push @mode_seq, $mode;
		my $got = $node->safe_psql('postgres', qq{
			SELECT idem_durability() || ' ' ||
			       (SELECT string_agg(relpersistence::text, '|' ORDER BY relname)
			          FROM pg_class WHERE relname IN ('idem_record', 'idem_result')) || ' ' ||
			       CASE WHEN '$mode' = 'completed'
			            THEN (SELECT count(*) FROM idem_record WHERE completed_at IS NOT NULL)
			            ELSE (SELECT count(*) FROM idem_result) END});
		if ($got ne "$mode $persistence{$mode} 0")
		{
			$state_fail++;
			diag("round $round, after switching to $mode: got '$got', want '$mode $persistence{$mode} 0'");
		}
	}
}
is($switch_fail, 0, 'every idem_set_durability under load succeeded (' . scalar(@mode_seq) . ' switches)');
is($state_fail, 0, 'after every switch the mode, the persistence and the place of the completed records are the mode\'s');
is(join(' ', @mode_seq), join(' ', (@cycle) x $cycles), 'the switches went ' . join(' -> ', 'none', @mode_seq));
my $before_end = $node->safe_psql('postgres', q{SELECT count(*) FROM effect});
ok(progressed(300), 'the loads go on completing new keys after the last switch');
ok(!grep({ !$_->{run}->pumpable } @bench), 'both loads are still running');

# stop: the clients stop claiming; once every attempt under way has ended
# (nothing pending, every external effect finished, nothing changes for a
# second), pgbench is interrupted
$node->safe_psql('postgres', 'UPDATE ctl SET stop = 1');
my ($quiet, $prev) = (0, '');
for (1 .. 60)
{
	sleep 1;
	my $now = $node->safe_psql('postgres', qq{
		SELECT (SELECT count(*) FROM effect) || '|' ||
		       (SELECT count(*) FROM $IDEM_RECORDS r WHERE completed_at IS NULL) || '|' ||
		       (SELECT count(*) FROM effect e WHERE op = 'ext'
		           AND NOT EXISTS (SELECT 1 FROM finished f WHERE f.eid = e.id))});
	if ($now =~ /\|0\|0$/ && $now eq $prev) { $quiet = 1; last; }
	$prev = $now;
}
ok($quiet, "the loads came to rest after the stop flag ($prev: effects|pending|unfinished)");

for my $h (@bench)
{
	finish_bench($h, stop => 1);
	unlike($h->{stderr}, qr/ERROR|aborted/, "$h->{name}: the load met no error (no replay named a wrong effect)");
}

# ---- nothing lost ----

my $n_intx = $node->safe_psql('postgres', q{SELECT count(*) FROM effect WHERE op = 'intx'});
my $n_ext = $node->safe_psql('postgres', q{SELECT count(*) FROM finished});
cmp_ok($n_intx + $n_ext, '>', $before_end, "new keys were still being completed after the last switch ($before_end before it)");
cmp_ok($n_intx, '>', 500, "the in-transaction load completed keys ($n_intx)");
cmp_ok($n_ext, '>', 300, "the external load finished keys ($n_ext)");

my $probe = sub {
	my ($from) = @_;
	return $node->safe_psql('postgres', qq{
		BEGIN;
		SELECT count(*) FILTER (WHERE b.status IS DISTINCT FROM 'replay'
		                           OR b.response IS DISTINCT FROM jsonb_build_object('effect_id', e.id))
		       || '|' || count(*)
		  FROM $from, LATERAL idem_begin(e.op, e.key, idem_fingerprint(e.k), in_flight => 'raise') b;
		ROLLBACK;});
};
is($probe->(q{(SELECT * FROM effect e WHERE op = 'intx') e}), "0|$n_intx",
	"every in-transaction key completed under the switches ($n_intx) replays its response");
is($probe->(q{(SELECT e.* FROM finished f JOIN effect e ON e.id = f.eid) e}), "0|$n_ext",
	"every external key finished under the switches ($n_ext) replays its response");
is($node->safe_psql('postgres', qq{
	SELECT count(*) FROM $IDEM_RECORDS r
	 WHERE r.completed_at IS NOT NULL
	   AND NOT EXISTS (SELECT 1 FROM effect e
	                    WHERE e.op = r.operation AND e.key = r.key AND e.token = r.token
	                      AND r.response = jsonb_build_object('effect_id', e.id))}),
	'0', 'every completed record has its effect row, token and id');
is($node->safe_psql('postgres', qq{
	SELECT count(*) FROM (SELECT operation, key FROM $IDEM_RECORDS r GROUP BY 1, 2 HAVING count(*) > 1) d}),
	'0', 'no key has a record in both tables');
is($node->safe_psql('postgres', q{
	SELECT count(*) FROM (SELECT op, key FROM effect GROUP BY op, key HAVING count(*) > 1) d}),
	'0', 'no key has two effects');
is($node->safe_psql('postgres', q{
	SELECT count(*) FROM effect e WHERE e.op = 'ext'
	   AND NOT EXISTS (SELECT 1 FROM finished f WHERE f.eid = e.id)}),
	'0', 'every external effect was finished');
is($node->safe_psql('postgres', qq{SELECT count(*) FROM $IDEM_RECORDS r WHERE completed_at IS NULL}),
	'0', 'no claim is left pending');

# ---- the indexes ----

my $nidx = $node->safe_psql('postgres', q{
	SELECT count(*) FROM pg_index WHERE indrelid IN ('idem_record'::regclass, 'idem_result'::regclass)});
cmp_ok($nidx, '>=', 2, "idem_record and idem_result have $nidx indexes");
my ($rc, $out, $err) = $node->psql('postgres', q{
	SELECT count(*) FROM (
		SELECT bt_index_check(indexrelid, true) FROM pg_index
		 WHERE indrelid IN ('idem_record'::regclass, 'idem_result'::regclass)) s});
is("$rc|$out", "0|$nidx", "amcheck (heapallindexed) clean on all $nidx indexes of idem_record and idem_result")
  or diag($err);

is($node->safe_psql('postgres', 'SELECT idem_durability()'), $last, "idem_durability() reports the last mode, $last");

unlike(slurp_file($node->logfile), qr/terminated by signal|PANIC|TRAP:|deadlock/, 'no backend crashed, no deadlock');
$node->stop;
done_testing();
