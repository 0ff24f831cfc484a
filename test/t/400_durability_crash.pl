
# Copyright (c) 2024, idempotency authors
#
# Crash (immediate shutdown in the middle of a load, then start) in each
# durability mode of 1.3: one database per mode (dur_none, dur_completed,
# dur_all) on one cluster, one crash for all three.
#
# Two loads per database (pgbench), over the same few thousand keys:
#   intx  in-transaction shape: BEGIN; idem_begin; on 'new' INSERT the
#         effect row (a LOGGED table) and idem_finish with
#         {"effect_id": id}; COMMIT (one time in ten ROLLBACK).  An effect
#         row of this shape exists <=> its finish committed.
#   ext   external-call shape: autocommit idem_begin (lease 4 s); on 'new'
#         an autocommit INSERT of the effect row, then an autocommit
#         idem_finish, then an autocommit INSERT into "finished" (LOGGED):
#         a "finished" row means that the finish committed.
# On 'replay' both check that the response names this key's effect row (a
# division by zero otherwise).  Every effect row carries the epoch (1:
# before the crash, 2: after it).
#
# Besides the loads, per database: det-done (external shape, finished),
# det-fx (in-transaction, with its effect row) and det-pending (committed
# claim, lease 1 h, never finished).
#
# After the crash:
#   completed, all: every key whose finish committed before the crash
#     replays its stored response (det-done, det-fx, every intx effect row,
#     every "finished" ext key); every completed record has its effect row;
#     det-pending is lost in 'completed' (a retry gets 'new', no error --
#     allowed) and still held in 'all' (IK409 with raise).  The loads run
#     again over the same keys (6 s of pgbench, then one retry of every key
#     with psql) without an error, and afterwards no intx key and no ext
#     key finished before the crash has two effect rows.
#   none: every record is gone (documented), det-* and every key of the
#     load get 'new'; the loads afterwards (and the retry of every key) run
#     without an error, keys completed before the crash run again, and
#     after the crash no key has two effects and every effect replays.
#   every mode: the mode and the tables' persistence are unchanged, new
#     tokens are greater than every token before the crash.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :bench);

my $nkeys = 2000;
my @modes = qw(none completed all);
my %persistence = (none => 'u|u', completed => 'u|p', all => 'p|p');   # idem_record|idem_result

my $node = PostgreSQL::Test::Cluster->new('durability_crash');
$node->init;
$node->append_conf('postgresql.conf', q{
max_connections = 60
checkpoint_timeout = 30s
});
$node->start;

# ---- helpers ----

sub db_of { return "dur_$_[0]"; }

sub sql
{
	my ($mode, $sql) = @_;
	return $node->safe_psql(db_of($mode), $sql);
}

# the loads (IdemTest's start_bench and start_sweep): the options of their
# scripts, and the pgbench clients of each shape
my %load = (keys => $nkeys, lease => '4 s');
my %clients = (intx => 3, ext => 2);

# ---- set-up ----

my %det;    # $det{$mode}{done|fx|fx_id|pending}
for my $mode (@modes)
{
	$node->safe_psql('postgres', 'CREATE DATABASE ' . db_of($mode));
	sql($mode, qq{
		CREATE EXTENSION idempotency;
		SELECT idem_set_durability('$mode');
		CREATE TABLE effect (id bigserial PRIMARY KEY, op text NOT NULL, key text NOT NULL,
		                     k int NOT NULL, token bigint NOT NULL, epoch int NOT NULL);
		CREATE TABLE finished (op text NOT NULL, key text NOT NULL, eid bigint NOT NULL,
		                       epoch int NOT NULL);
	});
	is(sql($mode, 'SELECT idem_durability()'), $mode, "$mode: idem_durability() reports the mode");
	is(sql($mode, q{SELECT string_agg(relpersistence::text, '|' ORDER BY relname)
		FROM pg_class WHERE relname IN ('idem_record', 'idem_result')}),
		$persistence{$mode}, "$mode: idem_record|idem_result persistence is $persistence{$mode}");
	is(sql($mode, q{SELECT relpersistence FROM pg_class WHERE relname IN ('effect', 'finished')
		GROUP BY 1}), 'p', "$mode: the side tables are logged");

	my $t = token_of(claim($node, db_of($mode), 'det-done'));
	sql($mode, qq{SELECT idem_finish('det', 'det-done', $t, '{"det": "done"}')});
	$det{$mode}{done} = $t;
	$det{$mode}{fx_id} = sql($mode, q{
		BEGIN;
		SELECT token FROM idem_begin('det', 'det-fx', idem_fingerprint('det-fx')) b \gset
		INSERT INTO effect (op, key, k, token, epoch) VALUES ('det', 'det-fx', 0, :token, 1)
		  RETURNING id AS fx_id \gset
		SELECT idem_finish('det', 'det-fx', :token, jsonb_build_object('effect_id', :fx_id)) \gset
		COMMIT;
		SELECT id FROM effect WHERE key = 'det-fx';});
	$det{$mode}{pending} = token_of(claim($node, db_of($mode), 'det-pending', q{lease => '1 h'}));
	is(claim($node, db_of($mode), 'det-done'), 'replay||{"det": "done"}', "$mode: det-done replays before the crash");
}
# in 'completed' the finished records are in idem_result, the claim in idem_record
is(sql('completed', q{
	SELECT (SELECT string_agg(key || ':' || (completed_at IS NOT NULL), ',' ORDER BY key)
	          FROM idem_record WHERE operation = 'det') || ' / ' ||
	       (SELECT string_agg(key || ':' || (completed_at IS NOT NULL), ',' ORDER BY key)
	          FROM idem_result WHERE operation = 'det')}),
	'det-pending:false / det-done:true,det-fx:true',
	'completed: the claim is in idem_record, the finished records in idem_result');

# ---- a crash in the middle of the loads ----

my @bench1;
for my $mode (@modes)
{
	push @bench1, map { start_bench($node, db_of($mode), %load, shape => $_, clients => $clients{$_},
		epoch => 1, seconds => 120, name => "$mode/$_/epoch 1") } qw(intx ext);
}
for my $mode (@modes)
{
	ok( $node->poll_query_until(db_of($mode), q{
			SELECT (SELECT count(*) FROM effect WHERE op = 'intx') >= 300
			   AND (SELECT count(*) FROM finished) >= 150}),
		"$mode: the loads are under way");
}
ok(!grep({ !$_->{run}->pumpable } @bench1), 'all six loads are still running at the crash');
my %max_token_before;
for my $mode (@modes)
{
	# the epoch in use: every token of it is below (epoch + 1) << 25
	$max_token_before{$mode} = sql($mode, q{
		SELECT ((last_value >> 25) + 1) << 25 FROM idem_token_seq});
}
$node->stop('immediate');
for my $h (@bench1)
{
	finish_bench($h);
	like($h->{stderr}, qr/aborted|connection|terminat/i, "$h->{name}: the crash cut the load off");
	unlike($h->{stderr}, qr/division by zero/, "$h->{name}: no replay before the crash named a wrong effect");
}
$node->start;

# ---- after the crash ----

for my $mode (@modes)
{
	is(sql($mode, 'SELECT idem_durability()'), $mode, "$mode, after the crash: the mode is unchanged");
	is(sql($mode, q{SELECT string_agg(relpersistence::text, '|' ORDER BY relname)
		FROM pg_class WHERE relname IN ('idem_record', 'idem_result')}),
		$persistence{$mode}, "$mode, after the crash: persistence unchanged");

	my $n_intx = sql($mode, q{SELECT count(*) FROM effect WHERE op = 'intx' AND epoch = 1});
	my $n_ext = sql($mode, q{SELECT count(*) FROM finished WHERE epoch = 1});
	note("$mode: $n_intx in-transaction keys and $n_ext external keys finished before the crash");

	# probes every intx effect / finished ext key in one rolled-back
	# transaction: "not replaying|replaying|all"
	my $probe = sub {
		my ($from) = @_;
		return sql($mode, qq{
			BEGIN;
			SELECT count(*) FILTER (WHERE b.status = 'new') || '|' ||
			       count(*) FILTER (WHERE b.status = 'replay'
			                          AND b.response = jsonb_build_object('effect_id', e.id)) || '|' ||
			       count(*)
			  FROM $from, LATERAL idem_begin(e.op, e.key, idem_fingerprint(e.k), in_flight => 'raise') b;
			ROLLBACK;});
	};
	my $intx_from = q{(SELECT e.* FROM effect e WHERE e.op = 'intx' AND e.epoch = 1) e};
	my $ext_from = q{(SELECT e.* FROM finished f JOIN effect e ON e.id = f.eid WHERE f.epoch = 1) e};

	if ($mode eq 'none')
	{
		is(sql($mode, 'SELECT (SELECT count(*) FROM idem_record) + (SELECT count(*) FROM idem_result)'),
			'0', 'none, after the crash: every record is gone (documented)');
		like(claim($node, db_of($mode), 'det-done', q{in_flight => 'raise'}), qr/^new\|\d+\|$/,
			'none: det-done is forgotten: new');
		like(claim($node, db_of($mode), 'det-fx', q{in_flight => 'raise'}), qr/^new\|\d+\|$/,
			'none: det-fx is forgotten: new');
		like(claim($node, db_of($mode), 'det-pending', q{in_flight => 'raise'}), qr/^new\|\d+\|$/,
			'none: det-pending is forgotten: new (no IK409)');
		is($probe->($intx_from), "$n_intx|0|$n_intx",
			"none: every in-transaction key finished before the crash ($n_intx) runs again");
		is($probe->($ext_from), "$n_ext|0|$n_ext",
			"none: every external key finished before the crash ($n_ext) runs again");
	}
	else
	{
		is(claim($node, db_of($mode), 'det-done'), 'replay||{"det": "done"}',
			"$mode: det-done replays its response after the crash");
		is(claim($node, db_of($mode), 'det-fx'), qq{replay||{"effect_id": $det{$mode}{fx_id}}},
			"$mode: det-fx replays its effect's id after the crash");
		is($probe->($intx_from), "0|$n_intx|$n_intx",
			"$mode: every in-transaction key finished before the crash ($n_intx) replays its response");
		is($probe->($ext_from), "0|$n_ext|$n_ext",
			"$mode: every external key finished before the crash ($n_ext) replays its response");
		is(sql($mode, qq{
			SELECT count(*) FROM $IDEM_RECORDS r
			 WHERE r.completed_at IS NOT NULL AND r.operation IN ('intx', 'ext')
			   AND NOT EXISTS (SELECT 1 FROM effect e
			                    WHERE e.op = r.operation AND e.key = r.key AND e.token = r.token
			                      AND r.response = jsonb_build_object('effect_id', e.id))}),
			'0', "$mode: every completed record has its effect row, token and id");
		if ($mode eq 'completed')
		{
			is(sql($mode, q{SELECT count(*) FROM idem_record WHERE completed_at IS NOT NULL}),
				'0', 'completed: no completed record in idem_record');
			my ($st, $out, $err) = try_sql($node, db_of($mode), q{
				SELECT status FROM idem_begin('det', 'det-pending', idem_fingerprint('det-pending'),
				                              in_flight => 'raise')});
			is("$st|$out", '00000|new',
				'completed: det-pending was lost with idem_record: a retry gets new, no error (allowed)')
			  or diag($err);
		}
		else
		{
			my ($st, $out, $err) = try_sql($node, db_of($mode), q{
				SELECT status FROM idem_begin('det', 'det-pending', idem_fingerprint('det-pending'),
				                              in_flight => 'raise')});
			is($st, 'IK409', 'all: det-pending is still held after the crash (raise: IK409)')
			  or diag($err);
		}
	}
}

# ---- the same loads again, over the same keys ----

my @bench2;
for my $mode (@modes)
{
	push @bench2, map { start_bench($node, db_of($mode), %load, shape => $_, clients => $clients{$_},
		epoch => 2, seconds => 6, name => "$mode/$_/epoch 2") } qw(intx ext);
}
for my $h (@bench2)
{
	finish_bench($h);
	is($h->{rc}, 0, "$h->{name}: the load after the crash exits 0")
	  or diag($h->{stderr});
	unlike($h->{stderr}, qr/ERROR|aborted/, "$h->{name}: the load after the crash met no error");
	my ($n) = $h->{stdout} =~ /number of transactions actually processed: (\d+)/;
	cmp_ok($n // 0, '>', 100, "$h->{name}: the load after the crash ran (" . ($n // 0) . ' transactions)');
}

# then one retry of every key of both loads
my @sweeps;
for my $mode (@modes)
{
	push @sweeps, map { start_sweep($node, db_of($mode), %load, shape => $_, epoch => 3,
		name => "$mode/$_/sweep") } qw(intx ext);
}
for my $h (@sweeps)
{
	finish_bench($h);
	is($h->{rc}, 0, "$h->{name}: a retry of every key ($nkeys) ran without an error")
	  or diag($h->{stderr});
}

for my $mode (@modes)
{
	cmp_ok(sql($mode, q{SELECT coalesce(min(token), 0) FROM effect WHERE epoch >= 2}), '>',
		$max_token_before{$mode} - 1,
		"$mode: new tokens are greater than every token of the epoch before the crash");
	is(sql($mode, q{
		SELECT count(*) FROM (SELECT op, key FROM effect WHERE epoch >= 2
		                       GROUP BY op, key HAVING count(*) > 1) d}),
		'0', "$mode: no key has two effects after the crash");
	is(sql($mode, qq{
		BEGIN;
		SELECT count(*) FILTER (WHERE b.status IS DISTINCT FROM 'replay'
		                           OR b.response IS DISTINCT FROM jsonb_build_object('effect_id', e.id))
		  FROM effect e, LATERAL idem_begin(e.op, e.key, idem_fingerprint(e.k), in_flight => 'raise') b
		 WHERE e.epoch >= 2 AND e.op = 'intx';
		ROLLBACK;}),
		'0', "$mode: every in-transaction effect after the crash replays its response");
	is(sql($mode, q{SELECT count(DISTINCT key) FROM effect WHERE op = 'intx'}), $nkeys,
		"$mode: every in-transaction key has its effect (the retry of every key reached all of them)");
	if ($mode eq 'none')
	{
		cmp_ok(sql($mode, q{
			SELECT count(*) FROM effect e1 JOIN effect e2 USING (op, key)
			 WHERE e1.epoch = 1 AND e2.epoch = 2}), '>', 0,
			'none: keys completed before the crash ran again after it (documented)');
	}
	else
	{
		is(sql($mode, q{
			SELECT count(*) FROM (SELECT key FROM effect WHERE op = 'intx'
			                       GROUP BY key HAVING count(*) > 1) d}),
			'0', "$mode: no in-transaction key has two effects, across the crash");
		is(sql($mode, q{
			SELECT count(*) FROM finished f
			 WHERE f.epoch = 1
			   AND (SELECT count(*) FROM effect e WHERE e.op = 'ext' AND e.key = f.key) <> 1}),
			'0', "$mode: no external key finished before the crash has a second effect");
		is(sql($mode, q{
			BEGIN;
			SELECT count(*) FILTER (WHERE b.status IS DISTINCT FROM 'replay'
			                           OR b.response IS DISTINCT FROM jsonb_build_object('effect_id', e.id))
			  FROM finished f JOIN effect e ON e.id = f.eid,
			       LATERAL idem_begin(e.op, e.key, idem_fingerprint(e.k), in_flight => 'raise') b;
			ROLLBACK;}),
			'0', "$mode: every finished external key, before or after the crash, replays its response");
	}
}

my $log = slurp_file($node->logfile);
unlike($log, qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');

$node->stop;
done_testing();
