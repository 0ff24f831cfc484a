
# Copyright (c) 2024, idempotency authors
#
# Records colocated with a tenant's table on a real Citus cluster
# (docs/scaling-out.md, "Colocated with a tenant's table"): a coordinator
# and two workers, charges distributed by merchant_id, and
# idem_distribute('charges').
#
#  - what it refuses: a table that is not hash-distributed, records in
#    flight, a call without a tenant; the records' tenant column has the
#    type of merchant_id and the tables share the colocation group;
#  - a key is the tenant's: the same key under two tenants is two records;
#  - replay, IK409, IK412 and a takeover through any node;
#  - the in-transaction shape (claim, a charge, finish) through every node
#    is one worker's transaction: no two-phase commit, and it commits or
#    rolls back as one; so is a distributed function delegated by the
#    tenant, with the claim and the finish inside it;
#  - the worker killed at its commit, and the coordinator killed while the
#    worker commits: one charge or none, and the retry agrees;
#  - the colocation group's shards moved: every key replays from every node.
#
# Where Citus cannot be asked to commit in two phases (its builds for
# PostgreSQL 16 and later: citus_can_2pc in CitusCluster.pm), the
# in-transaction shape through the worker that holds the tenant's shards
# runs there in the client's own backend, and is refused (0A000), writing
# nothing: that is asserted instead, and the shape is then run through a
# node that Citus delegates the calls from (the coordinator, or the other
# worker), for the checks that follow.

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

my @nodes = citus_cluster('c');
my ($coord, $w1, $w2) = @nodes;

$coord->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE charges (merchant_id bigint NOT NULL, key text NOT NULL, amount int NOT NULL);
	ALTER TABLE charges REPLICA IDENTITY FULL;
	SELECT create_distributed_table('charges', 'merchant_id');
	CREATE TABLE local_notes (note text);
});

# ---- the step ----

my ($st, $out, $err) = try_sql($coord, 'postgres', q{SELECT idem_distribute('local_notes')});
is($st, '22023', 'a table that is not hash-distributed is refused');
$coord->safe_psql('postgres', q{SELECT idem_begin('charge', 'early', NULL)});
($st, $out, $err) = try_sql($coord, 'postgres', q{SELECT idem_distribute('charges')});
is($st, '55006', 'records in flight, which have no tenant, are refused');
$coord->safe_psql('postgres', q{SELECT idem_forget('charge', 'early', force => true)});
is($coord->safe_psql('postgres', q{SELECT idem_distribute('charges')}), 't', 'colocated with charges');
is($coord->safe_psql('postgres', q{SELECT idem_distribute('charges')}), 'f', 'and again does nothing');
is($coord->safe_psql('postgres', q{SELECT idem_distribute()}), 'f', 'nor does idem_distribute()');
is($coord->safe_psql('postgres', q{
	SELECT count(DISTINCT colocationid) || ' ' || string_agg(column_to_column_name(logicalrelid, partkey), ',' ORDER BY logicalrelid::text)
	  FROM pg_dist_partition WHERE logicalrelid IN ('charges'::regclass, 'idem_record'::regclass, 'idem_result'::regclass)}),
	'1 merchant_id,tenant,tenant', 'one colocation group, the records distributed by their tenant');
for my $n (@nodes)
{
	is($n->safe_psql('postgres', q{SELECT format_type(atttypid, NULL) FROM pg_attribute
		WHERE attrelid = 'idem_record'::regclass AND attname = 'tenant'}), 'bigint',
		$n->name . ': the tenant column has the type of merchant_id');
	($st, $out, $err) = try_sql($n, 'postgres', q{SELECT idem_begin('charge', 'no-tenant', NULL)});
	is($st, '0A000', $n->name . ': a call without a tenant is refused');
}
like($err, qr/must name the tenant/, 'and says why');

# ---- one record per tenant and key, through any node ----

my $tok = $w1->safe_psql('postgres', q{SELECT token FROM idem_begin(1, 'charge', 'k-1', NULL)});
is($w2->safe_psql('postgres', q{SELECT status FROM idem_begin(2, 'charge', 'k-1', NULL)}), 'new',
	"another tenant's key of the same name is its own");
($st) = try_sql($coord, 'postgres', q{SELECT idem_begin(1, 'charge', 'k-1', NULL, 'raise')});
is($st, 'IK409', 'a duplicate through another node gets IK409');
($st) = try_sql($w2, 'postgres', qq{SELECT idem_finish(1, 'charge', 'k-1', $tok - 1, '{}')});
is($st, 'IK412', 'a stale token through another node gets IK412');
$coord->safe_psql('postgres', qq{SELECT idem_finish(1, 'charge', 'k-1', $tok, '{"n": 1}')});
for my $n (@nodes)
{
	is($n->safe_psql('postgres', q{SELECT status || ' ' || response FROM idem_begin(1, 'charge', 'k-1', NULL)}),
		'replay {"n": 1}', $n->name . ': replays');
}
$tok = $w1->safe_psql('postgres', q{SELECT token FROM idem_begin(1, 'charge', 'k-2', NULL, lease => '1 second', ttl => '1 minute')});
sleep 2;
my $tok2 = $w2->safe_psql('postgres', q{SELECT token FROM idem_begin(1, 'charge', 'k-2', NULL)});
cmp_ok($tok2, '>', $tok, 'a lapsed claim taken over through another node gets a greater token');
($st) = try_sql($coord, 'postgres', qq{SELECT idem_finish(1, 'charge', 'k-2', $tok, '{}')});
is($st, 'IK412', 'and the first attempt is fenced off');
is($coord->safe_psql('postgres', q{SELECT state FROM idem_inspect(1, 'charge', 'k-2')}), 'pending',
	'idem_inspect takes the tenant too');

# ---- the in-transaction shape: one worker's transaction ----

# the worker of tenant $m
sub worker_of
{
	my ($m) = @_;
	my $port = $coord->safe_psql('postgres', qq{
		SELECT n.nodeport FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) JOIN pg_dist_node n USING (groupid)
		 WHERE s.logicalrelid = 'idem_record'::regclass AND s.shardid = get_shard_id_for_distribution_column('idem_record', $m)});
	return $port == $w1->port ? $w1 : $w2;
}

# Is the in-transaction shape of tenant $m through $n refused (see the
# top)?  A node that does not hold the tenant's shards (the coordinator
# holds none) has Citus delegate the calls, over a connection of Citus's own
# whose transaction is part of the calling node's; the node that holds them
# does not.
sub tx_refused_on
{
	my ($n, $m) = @_;
	return !citus_can_2pc($n) && $n->port == worker_of($m)->port;
}

sub charge_script
{
	my ($key, $m, $end) = @_;
	$end //= 'COMMIT';
	return qq{
SET citus.log_remote_commands = on;
BEGIN;
SELECT status, token, status = 'new' AS is_new FROM idem_begin($m, 'charge', '$key', idem_fingerprint('$m')) \\gset
\\if :is_new
INSERT INTO charges VALUES ($m, '$key', 100);
SELECT idem_finish($m, 'charge', '$key', :'token', '{"charged": true}');
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

# "charges|records" of tenant $m's $key, the records as state:token,
# through the coordinator
sub written
{
	my ($key, $m) = @_;
	return charges($key) . '|' . $coord->safe_psql('postgres', qq{
		SELECT coalesce(string_agg(state || ':' || token, ','), '') FROM idem_inspect($m, 'charge', '$key')});
}

# The in-transaction shape of tenant $m's $key through $n, which refuses it
# (tx_refused_on): the refusal, and that it changed neither the charges nor
# the record of the key
sub refused
{
	my ($n, $key, $m, $end) = @_;
	my $before = written($key, $m);
	my ($rst, undef, $rerr) = try_sql($n, 'postgres', charge_script($key, $m, $end));
	is_tx_refusal($rst, $rerr, "$key: " . ($end // 'COMMIT') . ' through ' . $n->name
		  . ", which holds tenant $m, is refused on this Citus");
	is(written($key, $m), $before, "$key: and changes nothing");
}

# $n if it serves the in-transaction shape of tenant $m, else (after
# asserting its refusal of $key) $instead
sub tx_node
{
	my ($n, $key, $m, $instead) = @_;
	return $n unless tx_refused_on($n, $m);
	refused($n, $key, $m);
	return $instead;
}

my %refused_by;
for my $n (@nodes)
{
	for my $m (1 .. 3)
	{
		my $key = $n->name . "-tx-$m";
		my $by = $n;
		if (tx_refused_on($n, $m))
		{
			refused($n, $key, $m, 'ROLLBACK');
			refused($n, $key, $m);
			$refused_by{ $n->name }++;
			$by = $coord;
		}
		my $via = $by->name eq $n->name ? '' : ' through ' . $by->name;
		($st, $out) = try_sql($by, 'postgres', charge_script($key, $m, 'ROLLBACK'));
		is(charges($key) . '|' . $w2->safe_psql('postgres', qq{SELECT count(*) FROM idem_inspect($m, 'charge', '$key')}),
			'0|0', "$key: rolled back$via, neither the charge nor the claim is left");
		($st, $out, $err) = try_sql($by, 'postgres', charge_script($key, $m));
		is((split /\n/, $out)[-1], 'new', "$key: charged$via");
		unlike($err, qr/PREPARE TRANSACTION/, "$key: in one phase, on one worker");
		my $retry = tx_node($w2, $key, $m, $w1);
		($st, $out) = try_sql($retry, 'postgres', charge_script($key, $m));
		is((split /\n/, $out)[-1], 'replay', "$key: the retry through another node replays");
		is(charges($key), '1', "$key: charged once");
	}
}
# the tenants above cover both kinds of call through each worker
if (!citus_can_2pc($w1))
{
	for my $w ($w1, $w2)
	{
		cmp_ok($refused_by{ $w->name } // 0, '>', 0, $w->name . ' refused a tenant whose shards it holds');
		cmp_ok($refused_by{ $w->name } // 0, '<', 3, $w->name . ' served a tenant whose shards are elsewhere');
	}
}

# a function delegated by the tenant: claim, charge and finish inside it
$coord->safe_psql('postgres', q{
	CREATE FUNCTION charge(merchant bigint, k text, amount int) RETURNS text LANGUAGE plpgsql AS $$
	DECLARE
		c idem_claim;
	BEGIN
		c := idem_begin(merchant, 'charge', k, NULL);
		IF c.status = 'replay' THEN
			RETURN 'replay';
		END IF;
		INSERT INTO charges VALUES (merchant, k, amount);
		PERFORM idem_finish(merchant, 'charge', k, c.token, jsonb_build_object('charged', amount));
		RETURN c.status;
	END $$;
	SELECT create_distributed_function('charge(bigint, text, int)', '$1', colocate_with => 'charges');
});
for my $m (1 .. 3)
{
	($st, $out, $err) = try_sql($coord, 'postgres', qq{SET citus.log_remote_commands = on; SELECT charge($m, 'fn-$m', 5)});
	is($out, 'new', "fn-$m: charged by the delegated function");
	is(scalar(() = $err =~ /issuing /g), 1, "fn-$m: one command to one worker");
	is(join(' ', map { $_->safe_psql('postgres', qq{SELECT charge($m, 'fn-$m', 5)}) } @nodes),
		'replay replay replay', "fn-$m: the retries through every node replay");
	is(charges("fn-$m"), '1', "fn-$m: charged once");
}

# ---- killed at commit ----

# a deferred trigger on the charges shards holds up the worker's commit
# for keys "slow-*"
hold_slow_commits($_) for ($w1, $w2);

sub sleeping
{
	my ($w, $present) = @_;
	for (1 .. 300)
	{
		my $n = $w->safe_psql('postgres', q{SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'});
		return 1 if $present ? $n > 0 : $n == 0;
		select(undef, undef, undef, 0.1);
	}
	die 'timed out waiting for the commit trigger';
}

for my $victim (qw(worker coordinator))
{
	for my $m (11 .. 12)
	{
		my $key = "slow-$victim-$m";
		my $w = worker_of($m);
		my $s = $coord->background_psql('postgres', on_error_stop => 0);
		send_sql($s, charge_script($key, $m));
		sleeping($w, 1);
		if ($victim eq 'worker')
		{
			$w->stop('immediate');
			$w->start;
		}
		else
		{
			$coord->stop('immediate');
			sleeping($w, 0);
			$coord->start;
		}
		$s->{run}->kill_kill;
		my $left = charges($key);
		my $claims = $w1->safe_psql('postgres', qq{SELECT count(*) FROM idem_inspect($m, 'charge', '$key')});
		ok(($left eq '0' && $claims eq '0') || ($left eq '1' && $claims eq '1'),
			"$key: the $victim killed at commit left $left charge and $claims record");
		($st, $out) = try_sql(tx_node($w1, $key, $m, $w2), 'postgres', charge_script($key, $m));
		is((split /\n/, $out)[-1], $left eq '1' ? 'replay' : 'new', "$key: the retry agrees with the charge");
		is(charges($key), '1', "$key: charged once");
	}
}

# ---- the colocation group moved: every key still replays from every node ----

my ($shard, $port) = split /\|/, $coord->safe_psql('postgres', q{
	SELECT s.shardid || '|' || n.nodeport
	  FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) JOIN pg_dist_node n USING (groupid)
	 WHERE s.logicalrelid = 'idem_record'::regclass AND s.shardid = get_shard_id_for_distribution_column('idem_record', 1)});
my $to = $port == $w1->port ? $w2 : $w1;
$coord->safe_psql('postgres', sprintf(q{
	SELECT citus_move_shard_placement(%d, '%s', %d, '%s', %d)}, $shard, $coord->host, $port, $to->host, $to->port));
is(worker_of(1)->port, $to->port, "tenant 1's record shard moved");
is($coord->safe_psql('postgres', q{
	SELECT count(DISTINCT n.nodeport) FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) JOIN pg_dist_node n USING (groupid)
	 WHERE s.shardid IN (get_shard_id_for_distribution_column('idem_record', 1),
						 get_shard_id_for_distribution_column('charges', 1))}), '1',
	'with the charges of the tenant');
# tenant, key and the fingerprint to claim it with, as SQL
my @finished = split /\n/, $coord->safe_psql('postgres', q{
	SELECT tenant || '|' || key || '|' || coalesce(quote_literal(fingerprint) || '::bytea', 'NULL')
	  FROM idem_record WHERE completed_at IS NOT NULL ORDER BY 1});
cmp_ok(scalar(@finished), '>=', 15, 'finished keys of several tenants');
for my $n (@nodes)
{
	my $replays = 0;
	for (@finished)
	{
		my ($m, $key, $fp) = split /\|/;
		$replays++ if $n->safe_psql('postgres', qq{SELECT status FROM idem_begin($m, 'charge', '$key', $fp)}) eq 'replay';
	}
	is($replays, scalar(@finished), $n->name . ': every finished key replays after the move');
}
is($coord->safe_psql('postgres', q{
	SELECT count(*) FROM (SELECT merchant_id, key FROM charges GROUP BY 1, 2 HAVING count(*) > 1) c}),
	'0', 'no key was charged twice');

$_->stop for @nodes;
done_testing();
