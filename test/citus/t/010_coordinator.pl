
# Copyright (c) 2024, idempotency authors
#
# The extension on a real Citus cluster: a coordinator and two workers,
# each its own server with citus and idempotency preloaded, and a charges
# table distributed by merchant.  The records are served by the
# coordinator (docs/scaling-out.md):
#
#  - a worker refuses every call that would open its own, separate record
#    tables (0A000), and writes nothing;
#  - the in-transaction shape through the coordinator (claim, a charge on
#    a worker, finish, one transaction) commits the worker in two phases;
#  - the coordinator killed at its commit, before its commit record (the
#    worker's PREPARE held up by a deferred trigger on the shard), and
#    after it (the commit waiting for a synchronous standby that never
#    comes); a commit whose COMMIT PREPARED never reaches its worker,
#    settled by Citus's maintenance daemon at its default interval while a
#    retry replays; a worker killed at its commit; a worker stopped; a worker
#    added and the shards rebalanced onto it: each time the charge happens
#    once, counted per key, and every finished key replays.
#
# Where the coordinator's Citus cannot be asked to commit in two phases
# (its builds for PostgreSQL 16 and later: citus_can_2pc in CitusCluster.pm)
# the in-transaction shape is refused (0A000) and writes nothing: each
# attempt above asserts that instead, the kills at commit are skipped (there
# is no such commit), and the keys whose later checks need them charged are
# charged by calls of their own, which are served.
#
# Citus comes from test/citus/install (test/run citus, or the citus suite
# of test/run check).

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

my @nodes = citus_cluster();
my ($coord, $w1, $w2) = @nodes;
my %worker = (worker1 => $w1, worker2 => $w2);
# the coordinator can make Citus commit a worker in two phases (see the top)
my $two_phase = citus_can_2pc($coord);

$coord->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE charges (merchant_id bigint NOT NULL, key text NOT NULL, amount int NOT NULL);
	-- no key, so that a second charge of a key is counted, not refused; a
	-- shard move by logical replication needs a replica identity
	ALTER TABLE charges REPLICA IDENTITY FULL;
	SELECT create_distributed_table('charges', 'merchant_id');
});
for my $w ($w1, $w2)
{
	is($w->safe_psql('postgres', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
		$coord->safe_psql('postgres', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
		$w->name . ': Citus created the extension on the worker');
}

# a merchant whose charges live on each worker, and the shard that holds them
my %merchant;
for my $m (1 .. 200)
{
	my $port = $coord->safe_psql('postgres', qq{
		SELECT nodeport FROM citus_shards
		 WHERE table_name = 'charges'::regclass
		   AND shardid = get_shard_id_for_distribution_column('charges', $m)});
	for my $name (keys %worker)
	{
		$merchant{$name} //= $m if $port == $worker{$name}->port;
	}
	last if keys %merchant == 2;
}
is(scalar(keys %merchant), 2, 'a merchant on each worker');
sub shard_of
{
	my ($name) = @_;
	return $coord->safe_psql('postgres', qq{
		SELECT shard_name('charges', get_shard_id_for_distribution_column('charges', $merchant{$name}))});
}

# charges of $key, counted through the coordinator
sub charges
{
	my ($key) = @_;
	return $coord->safe_psql('postgres', qq{SELECT count(*) FROM charges WHERE key = '$key'});
}

# The in-transaction shape, as psql script: claim, charge (only a new
# claim), finish, one transaction.  Prints the claim's status last.  The
# charge is an INSERT ... VALUES, which Citus routes to one worker and
# commits in one phase unless it is told otherwise (an INSERT ... SELECT
# would go through COPY, which always takes two).
sub charge_script
{
	my ($key, $m) = @_;
	return qq{
BEGIN;
SELECT status, token, status = 'new' AS is_new
  FROM idem_begin('charge', '$key', idem_fingerprint('$m')) \\gset
\\if :is_new
INSERT INTO charges VALUES ($m, '$key', 100);
SELECT idem_finish('charge', '$key', :'token', '{"charged": true}');
\\endif
COMMIT;
SELECT :'status';
};
}

# Run it to the end: (sqlstate, status, stderr)
sub charge
{
	my ($key, $m, %opt) = @_;
	my ($st, $out, $err) = try_sql($coord, 'postgres', ($opt{prefix} // '') . charge_script($key, $m));
	my @lines = split /\n/, $out;
	return ($st, $lines[-1] // '', $err);
}

# The same calls, each a transaction of its own (the external-call shape):
# (sqlstate, status)
sub charge_autocommit
{
	my ($key, $m) = @_;
	my ($st, $out) = try_sql($coord, 'postgres', qq{
SELECT status, token, status = 'new' AS is_new
  FROM idem_begin('charge', '$key', idem_fingerprint('$m')) \\gset
\\if :is_new
INSERT INTO charges VALUES ($m, '$key', 100);
SELECT idem_finish('charge', '$key', :'token', '{"charged": true}');
\\endif
SELECT :'status';
});
	my @lines = split /\n/, $out;
	return ($st, $lines[-1] // '');
}

# "charges|records" of $key, through the coordinator
sub written
{
	my ($key) = @_;
	return charges($key) . '|'
	  . $coord->safe_psql('postgres', qq{SELECT count(*) FROM idem_inspect('charge', '$key')});
}

# Without two phases: the in-transaction shape of a new $key is refused,
# and writes neither a charge nor a record
sub refused
{
	my ($key, $m) = @_;
	my ($st, undef, $err) = charge($key, $m);
	is_tx_refusal($st, $err, "$key: the in-transaction shape is refused on this Citus");
	is(written($key), '0|0', "$key: and writes nothing");
}

# A new $key charged through the coordinator: the in-transaction shape, or
# without two phases its refusal, then the calls each on its own
sub charge_new
{
	my ($key, $m, $what) = @_;
	my ($st, $status);
	if ($two_phase)
	{
		($st, $status) = charge($key, $m);
		is("$st|$status", '00000|new', "$key: $what");
		return;
	}
	refused($key, $m);
	($st, $status) = charge_autocommit($key, $m);
	is("$st|$status", '00000|new', "$key: $what, by calls of their own");
}

# "status|response" of a claim of $key through the coordinator
sub replay
{
	my ($key, $m) = @_;
	return $coord->safe_psql('postgres', qq{
		SELECT status || '|' || coalesce(response::text, '')
		  FROM idem_begin('charge', '$key', idem_fingerprint('$m'), in_flight => 'raise')});
}

# ---- a worker refuses ----

for my $name (sort keys %worker)
{
	my $w = $worker{$name};
	for my $call (q{SELECT * FROM idem_begin('charge', 'on-worker', NULL)},
		q{SELECT idem_finish('charge', 'on-worker', 1, '{}')},
		q{SELECT * FROM idem_inspect('charge', 'on-worker')},
		q{SELECT * FROM idem_stats})
	{
		my ($st, undef, $err) = try_sql($w, 'postgres', $call);
		is($st, '0A000', "$name refuses: $call");
		like($err, qr/served by the Citus coordinator, not by a worker/, "$name: the error says where to go");
	}
	is($w->safe_psql('postgres', "SELECT count(*) FROM $IDEM_RECORDS r"), '0', "$name: no record was written");
}

# ---- the in-transaction shape commits its worker in two phases ----

my ($st, $status, $err);
if ($two_phase)
{
	($st, $status, $err) = charge('plain-1', $merchant{worker1}, prefix => "SET citus.log_remote_commands = on;\n");
	is("$st|$status", '00000|new', 'plain-1: a new key is charged');
	like($err, qr/issuing PREPARE TRANSACTION/, 'plain-1: Citus prepared the worker before the local commit');
}
else
{
	refused('plain-1', $merchant{worker1});
	($st, $status) = charge_autocommit('plain-1', $merchant{worker1});
	is("$st|$status", '00000|new', 'plain-1: a new key is charged by calls of their own');
}
($st, undef, $err) = try_sql($coord, 'postgres', qq{
	SET citus.log_remote_commands = on;
	BEGIN;
	INSERT INTO charges VALUES ($merchant{worker1}, 'no-claim', 1);
	COMMIT;});
unlike($err, qr/PREPARE TRANSACTION/, 'a transaction that writes no record commits its worker in one phase');
is(replay('plain-1', $merchant{worker1}), 'replay|{"charged": true}', 'plain-1: a retry replays');
is(charges('plain-1'), '1', 'plain-1: charged once');

# ---- the coordinator dies at its commit, before its commit record ----

# A deferred trigger on a worker's shard holds up that worker's PREPARE
# (or its COMMIT, in one phase) for keys "slow-*".
for my $name (sort keys %worker)
{
	my $shard = shard_of($name);
	$worker{$name}->safe_psql('postgres', qq{
		SET citus.enable_ddl_propagation = off;
		SET citus.enable_manual_changes_to_shards = on;
		CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS \$\$
		BEGIN
			IF NEW.key LIKE 'slow-%' THEN
				PERFORM pg_sleep(4);
			END IF;
			RETURN NULL;
		END \$\$;
		CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON $shard
			DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();});
}

# how many prepared transactions $node holds
sub prepared
{
	my ($node) = @_;
	return $node->safe_psql('postgres', 'SELECT count(*) FROM pg_prepared_xacts');
}

# start the coordinator after its crash, and let Citus settle the prepared
# transactions it left on the workers
sub restart_and_recover
{
	$coord->start;
	$coord->safe_psql('postgres', 'SELECT recover_prepared_transactions()');
}

# wait until $node has a backend in the wait event $event; then until it has none
sub wait_event
{
	my ($node, $event, $present) = @_;
	my $cond = $present ? '>' : '=';
	$node->poll_query_until('postgres',
		qq{SELECT count(*) $cond 0 FROM pg_stat_activity WHERE wait_event = '$event'})
	  or die "timed out waiting for wait event $event on " . $node->name;
}

# wait until $node runs no PREPARE TRANSACTION or COMMIT of another backend
sub wait_commits_done
{
	my ($node) = @_;
	$node->poll_query_until('postgres', q{
		SELECT count(*) = 0 FROM pg_stat_activity
		 WHERE pid <> pg_backend_pid() AND state <> 'idle'
		   AND (query LIKE 'PREPARE TRANSACTION%' OR query LIKE 'COMMIT%')})
	  or die 'timed out waiting for the commits of ' . $node->name;
}

# Start the in-transaction shape for $key in a session of the coordinator
sub start_charge
{
	my ($key, $m) = @_;
	my $s = $coord->background_psql('postgres', on_error_stop => 0);
	send_sql($s, charge_script($key, $m));
	return $s;
}

my $no_commit = 'the in-transaction shape is refused on this Citus: no commit to kill';
my $s;
refused('slow-1', $merchant{worker1}) unless $two_phase;
SKIP:
{
	skip $no_commit, 6 unless $two_phase;
	$s = start_charge('slow-1', $merchant{worker1});
	wait_event($w1, 'PgSleep', 1);
	$coord->stop('immediate');
	$s->{run}->kill_kill;
	wait_commits_done($w1);
	is(prepared($w1), '1', 'slow-1: the worker is left with the prepared transaction, not a commit');
	restart_and_recover();
	is(prepared($w1), '0',
		'slow-1: recovery rolled it back (the coordinator never committed)');
	is(charges('slow-1'), '0', 'slow-1: no charge without the claim');
	($st, $status) = charge('slow-1', $merchant{worker1});
	is("$st|$status", '00000|new', 'slow-1: the retry is new');
	is(charges('slow-1'), '1', 'slow-1: charged once');
	is(replay('slow-1', $merchant{worker1}), 'replay|{"charged": true}', 'slow-1: then it replays');
}

# ---- the coordinator dies after its commit record, before COMMIT PREPARED ----

refused('sync-1', $merchant{worker2}) unless $two_phase;
SKIP:
{
	skip $no_commit, 4 unless $two_phase;
	# a restart, not a reload: the checkpointer has then taken the setting
	$coord->append_conf('postgresql.conf', q{synchronous_standby_names = 'nobody'});
	$coord->restart;
	$s = start_charge('sync-1', $merchant{worker2});
	wait_event($coord, 'SyncRep', 1);
	$coord->adjust_conf('postgresql.conf', 'synchronous_standby_names', "''");
	$coord->stop('immediate');
	$s->{run}->kill_kill;
	is(prepared($w2), '1', 'sync-1: the worker holds the prepared transaction');
	restart_and_recover();
	is(prepared($w2), '0',
		'sync-1: recovery committed it (the coordinator had committed)');
	is(charges('sync-1'), '1', 'sync-1: charged once');
	is(replay('sync-1', $merchant{worker2}), 'replay|{"charged": true}', 'sync-1: the result survived the crash');
}

# ---- a worker dies at its commit ----

refused('slow-2', $merchant{worker1}) unless $two_phase;
SKIP:
{
	skip $no_commit, 5 unless $two_phase;
	$s = start_charge('slow-2', $merchant{worker1});
	wait_event($w1, 'PgSleep', 1);
	$w1->stop('immediate');
	(undef, undef, $err) = wait_sql($s);
	like($err, qr/ERROR: /, "slow-2: the coordinator's commit fails");
	$s->quit;
	$w1->start;
	is($coord->safe_psql('postgres', q{SELECT count(*) FROM idem_inspect('charge', 'slow-2')}), '0',
		'slow-2: no record');
	is(charges('slow-2'), '0', 'slow-2: no charge');
	($st, $status) = charge('slow-2', $merchant{worker1});
	is("$st|$status", '00000|new', 'slow-2: the retry is new');
	is(charges('slow-2'), '1', 'slow-2: charged once');
}

# ---- in doubt until Citus settles it by itself ----
#
# The coordinator commits, but its COMMIT PREPARED never reaches the worker
# (the worker's backends of Citus's connections end while the commit waits
# for a synchronous standby, after its commit record): the client's COMMIT
# succeeds with Citus's warning, and the worker keeps the prepared
# transaction until the coordinator's maintenance daemon settles it, every
# citus.recover_2pc_interval (here its default, one minute).  Meanwhile a
# retry replays (the record is the coordinator's, committed) and charges
# nothing; the charge is unseen until Citus commits it, then counted once.

SKIP:
{
	skip $no_commit, 7 unless $two_phase;
	$coord->adjust_conf('postgresql.conf', 'citus.recover_2pc_interval', "'1min'");
	$coord->adjust_conf('postgresql.conf', 'synchronous_standby_names', "'nobody'");
	$coord->restart;
	$s = start_charge('doubt-1', $merchant{worker2});
	wait_event($coord, 'SyncRep', 1);
	is(prepared($w2), '1', 'doubt-1: the worker has prepared, the coordinator waits after its commit record');
	$w2->safe_psql('postgres', q{
		SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		 WHERE application_name LIKE 'citus_internal%' AND pid <> pg_backend_pid()});
	$coord->adjust_conf('postgresql.conf', 'synchronous_standby_names', "''");
	$coord->reload;
	my ($out, undef, $cerr) = wait_sql($s);
	$s->quit;
	like("$out|$cerr", qr/new\|.*failed to commit transaction on/s,
		"doubt-1: the client's commit succeeds, with Citus's warning that the worker's did not");
	is(prepared($w2), '1', 'doubt-1: the worker still holds the prepared transaction');
	is(replay('doubt-1', $merchant{worker2}), 'replay|{"charged": true}',
		'doubt-1: a retry meanwhile replays (the coordinator committed)');
	is(charges('doubt-1'), '0', 'doubt-1: the charge is unseen meanwhile');
	ok($w2->poll_query_until('postgres', 'SELECT count(*) = 0 FROM pg_prepared_xacts'),
		"doubt-1: Citus's maintenance daemon commits it at its default interval");
	is(charges('doubt-1'), '1', 'doubt-1: charged once');
}

# ---- a worker is down ----

charge_new('down-done', $merchant{worker2}, 'charged before the worker stops');
$w2->stop;
is(replay('down-done', $merchant{worker2}), 'replay|{"charged": true}',
	'down-done: a finished key replays while the worker holding its charge is down');
($st, undef, $err) = charge('down-1', $merchant{worker2});
if ($two_phase)
{
	isnt($st, '00000', "down-1: the in-transaction shape fails while its worker is down ($st)");
}
else
{
	is_tx_refusal($st, $err, 'down-1: the in-transaction shape is refused on this Citus, its worker down');
}
is($coord->safe_psql('postgres', q{SELECT count(*) FROM idem_inspect('charge', 'down-1')}), '0',
	'down-1: and leaves no record');
$w2->start;
charge_new('down-1', $merchant{worker2}, 'the retry after the worker is back is new');

# ---- a worker added, the shards rebalanced onto it ----

my $w3 = citus_node('worker3');
push @nodes, $w3;
$coord->safe_psql('postgres', sprintf(q{SELECT citus_add_node('%s', %d)}, $w3->host, $w3->port));
is($w3->safe_psql('postgres', q{SELECT count(*) FROM pg_extension WHERE extname = 'idempotency'}), '1',
	'worker3: Citus created the extension on the added worker');
($st) = try_sql($w3, 'postgres', q{SELECT * FROM idem_begin('charge', 'on-worker', NULL)});
is($st, '0A000', 'worker3 refuses too');
$coord->safe_psql('postgres', q{SELECT citus_rebalance_start(); SELECT citus_rebalance_wait()});
cmp_ok($coord->safe_psql('postgres', sprintf(q{
	SELECT count(*) FROM citus_shards WHERE table_name = 'charges'::regclass AND nodeport = %d}, $w3->port)),
	'>', 0, 'the rebalance moved shards of charges onto worker3');
charge_new('after-rebalance', $merchant{worker1}, 'a new key is charged');

# ---- every key: charged once, replayed from the coordinator ----

# without two phases the keys of the kills at commit were refused, never charged
my @keys = $two_phase ? qw(plain-1 slow-1 sync-1 slow-2 doubt-1 down-done down-1 after-rebalance)
  : qw(plain-1 down-done down-1 after-rebalance);
my %m = ('plain-1' => 'worker1', 'slow-1' => 'worker1', 'sync-1' => 'worker2',
	'slow-2' => 'worker1', 'doubt-1' => 'worker2', 'down-done' => 'worker2', 'down-1' => 'worker2',
	'after-rebalance' => 'worker1');
is($coord->safe_psql('postgres', q{
	SELECT string_agg(key || ':' || n, ' ' ORDER BY key)
	  FROM (SELECT key, count(*) AS n FROM charges WHERE key <> 'no-claim' GROUP BY key) c}),
	join(' ', map { "$_:1" } sort @keys), 'every key was charged exactly once');
for my $key (@keys)
{
	is(replay($key, $merchant{ $m{$key} }), 'replay|{"charged": true}', "$key replays");
}
if (!$two_phase)
{
	is(written($_), '0|0', "$_: refused, neither charged nor claimed") for qw(slow-1 sync-1 slow-2);
}
for my $w ($w1, $w2, $w3)
{
	is(prepared($w), '0', $w->name . ': no prepared transaction is left');
	is($w->safe_psql('postgres', "SELECT count(*) FROM $IDEM_RECORDS r"), '0',
		$w->name . ': no record on the worker');
}

$_->stop for @nodes;
done_testing();
