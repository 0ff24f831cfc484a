
# Copyright (c) 2024, idempotency authors
#
# Distributed records on a real Citus cluster (docs/scaling-out.md): a
# coordinator and two workers, idem_distribute() run with records in
# flight, and every call made through any node.
#
#  - a key finished through one node replays through every other; a
#    pending one gets IK409 everywhere, a waiting duplicate on another node
#    waits and replays, a stale token gets IK412 from any node, a takeover
#    on another node gets a greater token;
#  - the in-transaction shape (claim, a charge, finish) through the
#    coordinator and through a worker commits or rolls back as one, and the
#    coordinator killed at its commit leaves one charge or none;
#  - what distributed records refuse: 'session' claims, a call that Citus
#    did not delegate (from PL/pgSQL), a call whose arguments the planner
#    folds from a query that reads no table (which Citus 13.2 would crash
#    on), a durability switch;
#  - under load on every node: the record shards moved (the default
#    transfer mode, and block_writes), a worker stopped and started, a
#    worker added and rebalanced onto; then every key is charged at most
#    once, exactly once when finished, and replays from every node;
#  - idem_purge on each node purges that node's shards.
#
# Where Citus cannot be asked to commit in two phases (its builds for
# PostgreSQL 16 and later: citus_can_2pc in CitusCluster.pm), the
# in-transaction shape through a worker that holds the key's record shard
# runs there in the client's own backend, and is refused (0A000), writing
# nothing: that is asserted instead, and the shape is then run through a
# node that Citus delegates the calls from (the coordinator, or the other
# worker), for the checks that follow.  The load then goes through the
# coordinator alone: which keys a worker would refuse changes as the shards
# move, and a pgbench client stops at its first error.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/../../t";
use lib $FindBin::RealBin;
use CitusCluster;
use IdemTest qw(:DEFAULT try_sql);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IPC::Run;

my @nodes = citus_cluster('d');
my ($coord, $w1, $w2) = @nodes;

$coord->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE charges (merchant_id bigint NOT NULL, key text NOT NULL, amount int NOT NULL);
	ALTER TABLE charges REPLICA IDENTITY FULL;
	SELECT create_distributed_table('charges', 'merchant_id');
	CREATE ROLE app LOGIN;
	GRANT SELECT, INSERT ON charges TO app;
});

# ---- records in flight, then idem_distribute() ----

$coord->safe_psql('postgres', q{
	SELECT idem_finish('charge', 'before-done', (idem_begin('charge', 'before-done', NULL)).token,
					   '{"charged": "before"}');
	SELECT idem_begin('charge', 'before-pending', NULL, lease => '1 hour');
});
my $before_token = $coord->safe_psql('postgres', q{SELECT token FROM idem_inspect('charge', 'before-pending')});

my ($st, $out, $err) = try_sql($coord, 'postgres', q{SET ROLE app; SELECT idem_distribute()});
is($st, '42501', 'idem_distribute() is not for PUBLIC');
($st, $out, $err) = try_sql($w1, 'postgres', q{SELECT idem_distribute()});
is($st, '0A000', 'idem_distribute() runs on the coordinator only');
is($coord->safe_psql('postgres', q{SELECT idem_distribute()}), 't', 'idem_distribute() distributes the records');
is($coord->safe_psql('postgres', q{SELECT idem_distribute()}), 'f', 'and again does nothing');
is($coord->safe_psql('postgres', q{
	SELECT string_agg(logicalrelid::text || ':' || partmethod::text, ' ' ORDER BY logicalrelid::text)
	  FROM pg_dist_partition WHERE logicalrelid::text LIKE 'idem_re%'}),
	'idem_record:h idem_result:h', 'both tables are hash-distributed');
# the placements of the record shards (citus_shards leaves out an
# extension's tables), as "shardid|port"
sub record_placements
{
	return split /\n/, $coord->safe_psql('postgres', q{
		SELECT s.shardid || '|' || n.nodeport
		  FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) JOIN pg_dist_node n USING (groupid)
		 WHERE s.logicalrelid = 'idem_record'::regclass ORDER BY s.shardid});
}

# the port of the node holding the record of $key
sub record_port
{
	my ($key) = @_;
	return $coord->safe_psql('postgres', qq{
		SELECT n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
		 WHERE p.shardid = get_shard_id_for_distribution_column('idem_record', '$key')});
}

# Is the in-transaction shape of $key through $n refused (see the top)?  A
# node that does not hold the key's record shard (the coordinator holds
# none) has Citus delegate the calls, over a connection of Citus's own whose
# transaction is part of the calling node's; the node that holds it does not.
sub tx_refused_on
{
	my ($n, $key) = @_;
	return !citus_can_2pc($n) && $n->port == record_port($key);
}

my %ports = map { (split /\|/)[1] => 1 } record_placements();
is(join(' ', sort keys %ports), join(' ', sort ($w1->port, $w2->port)), 'their shards are on both workers');
is($coord->safe_psql('postgres', q{SELECT pg_relation_size('idem_record') + pg_relation_size('idem_result')}), '0',
	'the coordinator keeps no record of its own');
is($coord->safe_psql('postgres', q{SELECT idem_durability()}), 'all', 'the records are in mode all');
for my $n (@nodes)
{
	is($n->safe_psql('postgres', q{SELECT status || '|' || response FROM idem_begin('charge', 'before-done', NULL)}),
		'replay|{"charged": "before"}', $n->name . ': a key finished before distributing replays');
	($st) = try_sql($n, 'postgres', q{SELECT idem_begin('charge', 'before-pending', NULL, in_flight => 'raise')});
	is($st, 'IK409', $n->name . ': a claim pending since before distributing is in progress');
}
$coord->safe_psql('postgres', qq{SELECT idem_finish('charge', 'before-pending', $before_token, '{"charged": "late"}')});
is($w2->safe_psql('postgres', q{SELECT response FROM idem_begin('charge', 'before-pending', NULL)}),
	'{"charged": "late"}', 'that claim finished through the coordinator replays through a worker');

# ---- one record per key, whichever node a call comes to ----

# the external-call shape: claim through worker1, duplicate through worker2
my $tok = $w1->safe_psql('postgres', q{SELECT token FROM idem_begin('charge', 'x-1', NULL, lease => '1 hour')});
($st) = try_sql($w2, 'postgres', q{SELECT idem_begin('charge', 'x-1', NULL, in_flight => 'raise')});
is($st, 'IK409', 'x-1: a duplicate through another worker is in progress');
($st) = try_sql($coord, 'postgres', q{SELECT idem_begin('charge', 'x-1', NULL, in_flight => 'raise')});
is($st, 'IK409', 'x-1: and through the coordinator');

# a waiting duplicate on the coordinator waits, then replays
my $waiter = $coord->background_psql('postgres', on_error_stop => 0);
send_sql($waiter, q{SELECT status || '|' || response FROM idem_begin('charge', 'x-1', NULL, in_flight => 'wait');});
$coord->poll_query_until('postgres', q{
	SELECT count(*) > 0 FROM pg_stat_activity
	 WHERE state = 'active' AND query LIKE '%in_flight => ''wait''%' AND pid <> pg_backend_pid()})
  or die 'the duplicate does not wait';
sleep 1;
($st) = try_sql($w2, 'postgres', qq{SELECT idem_finish('charge', 'x-1', $tok + 1, '{}')});
is($st, 'IK412', 'x-1: a token the key never had is refused, through another node');
$w2->safe_psql('postgres', qq{SELECT idem_finish('charge', 'x-1', $tok, '{"charged": "x-1"}')});
($out) = wait_sql($waiter);
is($out, 'replay|{"charged": "x-1"}', 'x-1: the waiting duplicate on the coordinator replays once finished');
$waiter->quit;

# a lapsed claim taken over through another node gets a greater token
$tok = $w2->safe_psql('postgres', q{SELECT token FROM idem_begin('charge', 'x-2', NULL, lease => '1 second')});
sleep 2;
my ($status, $tok2) = split /\|/, $coord->safe_psql('postgres', q{
	SELECT status || '|' || token FROM idem_begin('charge', 'x-2', NULL)});
is($status, 'new', 'x-2: a lapsed claim is taken over through another node');
cmp_ok($tok2, '>', $tok, 'x-2: with a greater token');
($st) = try_sql($w1, 'postgres', qq{SELECT idem_finish('charge', 'x-2', $tok, '{}')});
is($st, 'IK412', "x-2: the stale attempt's finish is refused");
$w1->safe_psql('postgres', qq{SELECT idem_finish('charge', 'x-2', $tok2, '{}')});
is($w2->safe_psql('postgres', q{SELECT count(*) FROM idem_inspect('charge', 'x-2') WHERE state = 'completed'}), '1',
	'x-2: the new attempt finished it');

# idem_inspect, idem_abort and idem_forget through any node
$tok = $coord->safe_psql('postgres', q{SELECT token FROM idem_begin('charge', 'x-3', NULL)});
is($w1->safe_psql('postgres', q{SELECT state FROM idem_inspect('charge', 'x-3')}), 'pending', 'x-3: inspected through a worker');
$w2->safe_psql('postgres', qq{SELECT idem_abort('charge', 'x-3', $tok)});
is($w1->safe_psql('postgres', q{SELECT status FROM idem_begin('charge', 'x-3', NULL)}), 'new', 'x-3: aborted through another node, new again');
$coord->safe_psql('postgres', q{SELECT idem_forget('charge', 'x-3', force => true)});
is($w2->safe_psql('postgres', q{SELECT count(*) FROM idem_inspect('charge', 'x-3')}), '0', 'x-3: forgotten');

# roles are told apart by name on every node
is($w1->safe_psql('postgres', q{SET ROLE app; SELECT status FROM idem_begin('charge', 'x-1', NULL)}), 'new',
	"another role's key of the same name is its own");

# ---- the in-transaction shape, through the coordinator and a worker ----

sub charge_script
{
	my ($key, $m, $end) = @_;
	$end //= 'COMMIT';
	return qq{
BEGIN;
SELECT status, token, status = 'new' AS is_new FROM idem_begin('charge', '$key', idem_fingerprint('$m')) \\gset
\\if :is_new
INSERT INTO charges VALUES ($m, '$key', 100);
SELECT idem_finish('charge', '$key', :'token', '{"charged": true}');
\\endif
$end;
SELECT :'status';
};
}

sub charges
{
	my ($key) = @_;
	return $coord->safe_psql('postgres', qq{SELECT count(*) FROM charges WHERE key = '$key'});
}

# "charges|records" of $key, the records as state:token, through the coordinator
sub written
{
	my ($key) = @_;
	return charges($key) . '|' . $coord->safe_psql('postgres', qq{
		SELECT coalesce(string_agg(state || ':' || token, ','), '') FROM idem_inspect('charge', '$key')});
}

# The in-transaction shape of $key through $n, which refuses it
# (tx_refused_on): the refusal, and that it changed neither the charges nor
# the record of the key
sub refused
{
	my ($n, $key, $m, $end) = @_;
	my $before = written($key);
	my ($rst, undef, $rerr) = try_sql($n, 'postgres', charge_script($key, $m, $end));
	is_tx_refusal($rst, $rerr, "$key: " . ($end // 'COMMIT') . ' through ' . $n->name
		  . ', which holds the record, is refused on this Citus');
	is(written($key), $before, "$key: and changes nothing");
}

# $n if it serves the in-transaction shape of $key, else (after asserting
# its refusal) $instead
sub tx_node
{
	my ($n, $key, $m, $instead) = @_;
	return $n unless tx_refused_on($n, $key);
	refused($n, $key, $m);
	return $instead;
}

my %refused_by;
for my $n ($coord, $w1)
{
	for my $m (1 .. 4)
	{
		my $key = $n->name . "-tx-$m";
		my $by = $n;
		if (tx_refused_on($n, $key))
		{
			refused($n, $key, $m, 'ROLLBACK');
			refused($n, $key, $m);
			$refused_by{ $n->name }++;
			$by = $coord;
		}
		my $via = $by->name eq $n->name ? '' : ' through ' . $by->name;
		($st, $out) = try_sql($by, 'postgres', charge_script($key, $m, 'ROLLBACK'));
		is($st, '00000', "$key: rolled back$via");
		is(charges($key) . '|' . $w2->safe_psql('postgres', qq{SELECT count(*) FROM idem_inspect('charge', '$key')}),
			'0|0', "$key: neither the charge nor the claim is left");
		($st, $out) = try_sql($by, 'postgres', charge_script($key, $m));
		is((split /\n/, $out)[-1], 'new', "$key: charged$via");
		my $retry = tx_node($w2, $key, $m, $w1);
		($st, $out) = try_sql($retry, 'postgres', charge_script($key, $m));
		is((split /\n/, $out)[-1], 'replay', "$key: the retry through another node replays");
		is(charges($key), '1', "$key: charged once");
	}
}
# the keys above cover both kinds of call through a worker
if (!citus_can_2pc($w1))
{
	cmp_ok($refused_by{ $w1->name } // 0, '>', 0, $w1->name . ' refused a key whose record it holds');
	cmp_ok($refused_by{ $w1->name } // 0, '<', 4, $w1->name . ' served a key whose record is elsewhere');
}

# the coordinator killed at its commit: a deferred trigger on the charges
# shards holds up each worker's PREPARE (or its COMMIT, when the record is
# on the same worker) for keys "slow-*"
hold_slow_commits($_) for ($w1, $w2);
sub no_sleeper
{
	my ($present) = @_;
	my $cond = $present ? '> 0' : '= 0';
	for (1 .. 300)
	{
		my $n = 0;
		$n += $_->safe_psql('postgres', q{SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'})
		  for ($w1, $w2);
		return 1 if $present ? $n > 0 : $n == 0;
		select(undef, undef, undef, 0.1);
	}
	die 'timed out waiting for the commit trigger';
}
for my $m (1 .. 4)
{
	my $key = "slow-$m";
	my $s = $coord->background_psql('postgres', on_error_stop => 0);
	send_sql($s, charge_script($key, $m));
	no_sleeper(1);
	$coord->stop('immediate');
	$s->{run}->kill_kill;
	no_sleeper(0);
	$coord->start;
	$coord->safe_psql('postgres', 'SELECT recover_prepared_transactions()');
	my $left = charges($key);
	ok($left eq '0' || $left eq '1', "$key: the coordinator killed at commit left $left charge");
	($st, $out) = try_sql(tx_node($w1, $key, $m, $w2), 'postgres', charge_script($key, $m));
	is((split /\n/, $out)[-1], $left eq '1' ? 'replay' : 'new', "$key: the retry agrees with the charge");
	is(charges($key), '1', "$key: charged once");
}

# ---- what distributed records refuse ----

($st, undef, $err) = try_sql($w1, 'postgres', q{SELECT idem_begin('charge', 'r-1', NULL, takeover => 'session')});
is($st, '0A000', "takeover => 'session' is refused");
($st, undef, $err) = try_sql($coord, 'postgres', q{SELECT idem_set_durability('completed')});
is($st, '0A000', 'a durability switch is refused');
is($coord->safe_psql('postgres', q{SELECT idem_set_durability('all')}), '', 'the mode they have is accepted');
# from PL/pgSQL Citus does not delegate: every key's record is elsewhere
$coord->safe_psql('postgres', q{
	CREATE FUNCTION claim_in_plpgsql(k text) RETURNS text LANGUAGE plpgsql AS $$
	BEGIN
		RETURN (idem_begin('charge', k, NULL)).status;
	END $$;});
($st, undef, $err) = try_sql($coord, 'postgres', q{SELECT claim_in_plpgsql('r-2')});
is($st, '0A000', 'a call Citus did not delegate is refused');
like($err, qr/is not on this node/, 'and says why');
is($coord->safe_psql('postgres', q{SELECT count(*) FROM idem_inspect('charge', 'r-2')}), '0', 'and wrote nothing');
# arguments the planner folds from other items of a query that reads no
# table: Citus 13.2 would delegate the call by the scribbled-on query and
# crash deparsing it, on a node without the shard
for my $n ($coord, $w1, $w2)
{
	for my $q (q{SELECT count(*) FROM (VALUES ('r-2')) v(k), idem_inspect('charge', v.k)},
		q{SELECT idem_begin('charge', k, NULL) FROM (SELECT 'r-2' AS k) s})
	{
		($st, undef, $err) = try_sql($n, 'postgres', $q);
		is($st, '0A000', $n->name . ": [$q] is refused while planned")
		  or diag($err);
	}
	is($n->safe_psql('postgres', q{SELECT count(*) FROM idem_inspect('charge', 'r-2')}), '0',
		$n->name . ': the node is up, and nothing was written');
}

# ---- under load: shard moves, a worker stopped, a worker added ----

my $script = PostgreSQL::Test::Utils::tempdir() . '/charge.sql';
PostgreSQL::Test::Utils::append_to_file($script, q{
\set k random(1, 400)
BEGIN;
SELECT status = 'new' AS is_new, token FROM idem_begin('load', 'load-:k', NULL) \gset
\if :is_new
INSERT INTO charges VALUES (:k, 'load-:k', 1);
SELECT idem_finish('load', 'load-:k', :token, '{"charged": true}');
\endif
COMMIT;
});

# pgbench on every node; a client that hits an error stops, the others go
# on.  Where a worker would refuse some of the keys (see the top), through
# the coordinator alone, with as many clients as on every node.
sub run_load
{
	my ($seconds) = @_;
	my @runs;
	my @on = grep { $_->name eq $coord->name || citus_can_2pc($_) } @nodes;
	my $clients = 3 * @nodes / @on;
	for my $n (@on)
	{
		my ($o, $e) = ('', '');
		push @runs, IPC::Run::start(
			[ $coord->config_data('--bindir') . '/pgbench', '-n', '-c', $clients, '-T', $seconds, '-f', $script,
			  '-h', $n->host, '-p', $n->port, 'postgres' ],
			'>', \$o, '2>', \$e);
	}
	return \@runs;
}

sub finish_load
{
	my ($runs) = @_;
	$_->finish for @$runs;
}

sub record_shard
{
	return (record_placements())[0];
}

for my $mode (qw(force_logical block_writes))
{
	my $load = run_load(8);
	sleep 2;
	my ($shard, $port) = split /\|/, record_shard();
	my $to = $port == $w1->port ? $w2 : $w1;
	$coord->safe_psql('postgres', sprintf(q{
		SELECT citus_move_shard_placement(%d, '%s', %d, '%s', %d, shard_transfer_mode => '%s')},
		$shard, $coord->host, $port, $to->host, $to->port, $mode));
	finish_load($load);
	is(record_shard(), "$shard|" . $to->port, "$mode: the record shard moved, under load");
}

# a worker stopped under load: calls for its keys fail, never 'new' for a finished key
my @done_on_w2;
for my $key (split /\n/, $coord->safe_psql('postgres', q{
	SELECT key FROM idem_record WHERE operation = 'load' AND completed_at IS NOT NULL ORDER BY key}))
{
	push @done_on_w2, $key if record_port($key) == $w2->port;
	last if @done_on_w2 == 5;
}
is(scalar(@done_on_w2), 5, 'finished keys whose records are on worker2');
$w2->stop('immediate');
for my $key (@done_on_w2)
{
	($st, $out) = try_sql($w1, 'postgres', qq{SELECT status FROM idem_begin('load', '$key', NULL)});
	isnt($st, '00000', "$key: while its worker is down, a claim fails ($st)");
}
$w2->start;
for my $key (@done_on_w2)
{
	is($w1->safe_psql('postgres', qq{SELECT status FROM idem_begin('load', '$key', NULL)}), 'replay',
		"$key: once its worker is back, it replays");
}

# a worker added: idem_distribute() prepares it, the rebalance moves record shards onto it
my $w3 = citus_node('dworker3');
push @nodes, $w3;
$coord->safe_psql('postgres', sprintf(q{SELECT citus_add_node('%s', %d)}, $w3->host, $w3->port));
is($coord->safe_psql('postgres', q{SELECT idem_distribute()}), 'f', 'idem_distribute() after adding a node');
is($w3->safe_psql('postgres', q{SELECT format_type(atttypid, NULL) FROM pg_attribute
	WHERE attrelid = 'idem_record'::regclass AND attname = 'role_id'}), 'name', 'and prepared its tables');
my $load = run_load(10);
$coord->safe_psql('postgres', q{SELECT citus_rebalance_start(); SELECT citus_rebalance_wait()});
finish_load($load);
cmp_ok(scalar(grep { (split /\|/)[1] == $w3->port } record_placements()),
	'>', 0, 'the rebalance moved record shards onto the new worker, under load');

# ---- every key: charged at most once, exactly once when finished ----

$coord->safe_psql('postgres', 'SELECT recover_prepared_transactions()');
is($coord->safe_psql('postgres', q{
	SELECT count(*) FROM (SELECT key FROM charges GROUP BY key HAVING count(*) > 1) c}),
	'0', 'no key was charged twice');
my $finished = $coord->safe_psql('postgres', q{
	SELECT count(*) FROM idem_record WHERE operation = 'load' AND completed_at IS NOT NULL});
cmp_ok($finished, '>', 50, "the load finished keys ($finished)");
my %charged = map { split /\|/ } split /\n/, $coord->safe_psql('postgres', q{
	SELECT key || '|' || count(*) FROM charges WHERE key LIKE 'load-%' GROUP BY key});
my @finished = split /\n/, $coord->safe_psql('postgres', q{
	SELECT key FROM idem_record WHERE operation = 'load' AND completed_at IS NOT NULL ORDER BY key});
is(join(' ', grep { ($charged{$_} // 0) != 1 } @finished), '', 'every finished key was charged exactly once');
my @sample = split /\n/, $coord->safe_psql('postgres', q{
	SELECT key FROM idem_record WHERE operation = 'load' AND completed_at IS NOT NULL ORDER BY key LIMIT 20});
for my $n (@nodes)
{
	my $replays = 0;
	for my $key (@sample)
	{
		$replays++ if $n->safe_psql('postgres', qq{SELECT status FROM idem_begin('load', '$key', NULL)}) eq 'replay';
	}
	is($replays, scalar(@sample), $n->name . ': every finished key replays');
}

# ---- idem_purge: each node purges its own shards ----

for my $i (1 .. 20)
{
	$coord->safe_psql('postgres', qq{SET ROLE app;
		SELECT token FROM idem_begin('charge', 'p-$i', NULL) \\gset
		SELECT idem_finish('charge', 'p-$i', :'token', '{}')});
}
# their retention over: a DBA's UPDATE, which Citus runs on every shard
$coord->safe_psql('postgres', q{
	UPDATE idem_record SET expires_at = now() - interval '1 second' WHERE key LIKE 'p-%'});
is($coord->safe_psql('postgres', q{SELECT idem_purge()}), '0', 'the coordinator has no shard to purge');
my %purged = map { ($_->name => $_->safe_psql('postgres', q{SELECT idem_purge()})) } ($w1, $w2, $w3);
my $purged = 0;
$purged += $_ for values %purged;
# the 20, and any claim of the load whose lease lapsed
cmp_ok($purged, '>=', 20, "the workers purged the expired records between them ($purged)");
cmp_ok($purged{$_->name}, '>', 0, $_->name . ' purged records of its own shards') for ($w1, $w2);
is($coord->safe_psql('postgres', q{SELECT count(*) FROM idem_record WHERE key LIKE 'p-%'}), '0', 'none is left');

# every worker's stats count its own shards
is($w1->safe_psql('postgres', q{SELECT count(*) >= 0 FROM idem_stats}), 't', 'idem_stats reads a worker\'s shards');
is($coord->safe_psql('postgres', q{SELECT sum(records) > 0 FROM idem_monitor WHERE operation = 'load'}), 't',
	'idem_monitor on the coordinator counts the records of every node');

$_->stop for @nodes;
done_testing();
