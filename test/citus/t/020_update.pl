
# Copyright (c) 2024, idempotency authors
#
# ALTER EXTENSION idempotency UPDATE on a Citus coordinator, with records in
# flight: a cluster installed at 1.4 (the coordinator's CREATE EXTENSION,
# which Citus runs on the workers too), keys in every state, then the
# update to the current version.
#
#  - Citus runs the update on the workers too: every node reports the new
#    version;
#  - every key keeps its promise across the update: the completed key
#    replays its response (its charge counted once); the pending
#    claim with a live lease refuses a duplicate (IK409) and its holder
#    finishes it with the token it got before the update; the checkpointed
#    claim whose lease lapses is recovered with its checkpoint and a
#    greater token; an aborted key is new;
#  - after the update a worker refuses calls (0A000), writing nothing, and
#    the in-transaction shape through the coordinator charges once;
#  - then idem_distribute(), with claims made at 1.4 still in flight: a
#    pending one is finished through a worker with its 1.4 token, a
#    checkpointed one is recovered through a worker with a greater token,
#    and every completed key replays through every node.
#
# Where the coordinator's Citus cannot be asked to commit in two phases
# (its builds for PostgreSQL 16 and later: citus_can_2pc in CitusCluster.pm)
# the in-transaction shape is refused (0A000), at 1.4 and after the update,
# and writes nothing: that is asserted instead, and those keys are then
# completed by calls of their own, as the error's hint says, for the checks
# that follow.

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

my ($coord, $w1, $w2) = citus_cluster();
# the coordinator can make Citus commit a worker in two phases (see the top)
my $two_phase = citus_can_2pc($coord);
my $current = $coord->safe_psql('postgres',
	q{SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency'});

sub version_on
{
	my ($n) = @_;
	return $n->safe_psql('postgres', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'});
}

$coord->safe_psql('postgres', q{
	CREATE EXTENSION idempotency VERSION '1.4';
	CREATE TABLE charges (merchant_id bigint NOT NULL, key text NOT NULL, amount int NOT NULL);
	SELECT create_distributed_table('charges', 'merchant_id');
});
is(version_on($_), '1.4', $_->name . ': installed at 1.4') for ($coord, $w1, $w2);

# ---- records in flight, made through the 1.4 SQL ----

# "charges|records" of $key, through the coordinator
sub written
{
	my ($key) = @_;
	return $coord->safe_psql('postgres', qq{
		SELECT (SELECT count(*) FROM charges WHERE key = '$key') || '|'
			|| (SELECT count(*) FROM idem_inspect('charge', '$key'))});
}

# completed, with its charge
my $done_tx = q{
	BEGIN;
	SELECT token FROM idem_begin('charge', 'done', idem_fingerprint(7)) \gset
	INSERT INTO charges VALUES (7, 'done', 100);
	SELECT idem_finish('charge', 'done', :'token', '{"charge": "ch_done"}');
	COMMIT;
};
if ($two_phase)
{
	$coord->safe_psql('postgres', $done_tx);
}
else
{
	my ($dst, undef, $derr) = try_sql($coord, 'postgres', $done_tx);
	is_tx_refusal($dst, $derr, 'at 1.4 the in-transaction shape is refused on this Citus');
	is(written('done'), '0|0', 'and writes nothing');
	# the same calls, each on its own
	$coord->safe_psql('postgres', q{
		SELECT token FROM idem_begin('charge', 'done', idem_fingerprint(7)) \gset
		INSERT INTO charges VALUES (7, 'done', 100);
		SELECT idem_finish('charge', 'done', :'token', '{"charge": "ch_done"}');
	});
}
# pending, its lease live for an hour
my $live_token = $coord->safe_psql('postgres',
	q{SELECT token FROM idem_begin('charge', 'live', idem_fingerprint(8), lease => '1 hour')});
# pending with a checkpoint, its lease lapsing soon after the update
my $ckpt_token = $coord->safe_psql('postgres', q{
	SELECT token FROM idem_begin('charge', 'ckpt', idem_fingerprint(9), lease => '3 s') \gset
	SELECT idem_checkpoint('charge', 'ckpt', :'token', '{"provider_ref": "ref_9"}');
	SELECT :'token';
});
# two more for after distributing: pending, and checkpointed with a lapsing lease
my $live2_token = $coord->safe_psql('postgres',
	q{SELECT token FROM idem_begin('charge', 'live2', idem_fingerprint(12), lease => '1 hour')});
my $ckpt2_token = $coord->safe_psql('postgres', q{
	SELECT token FROM idem_begin('charge', 'ckpt2', idem_fingerprint(13), lease => '3 s') \gset
	SELECT idem_checkpoint('charge', 'ckpt2', :'token', '{"provider_ref": "ref_13"}');
	SELECT :'token';
});
# aborted
$coord->safe_psql('postgres', q{
	SELECT idem_abort('charge', 'gone', token) FROM idem_begin('charge', 'gone', idem_fingerprint(10));
});
my $ckpt_at = time;

# ---- the update ----

$coord->safe_psql('postgres', 'ALTER EXTENSION idempotency UPDATE');
is(version_on($_), $current, $_->name . ": updated to $current (Citus ran the update there)")
	for ($coord, $w1, $w2);

# ---- every key after the update, through the coordinator ----

sub begin_of
{
	my ($key, $fp, $extra) = @_;
	$extra = defined $extra ? ", $extra" : '';
	my ($st, $out) = try_sql($coord, 'postgres', qq{
		SELECT status || '|' || coalesce(token::text, '') || '|' || coalesce(response::text, '')
		  FROM idem_begin('charge', '$key', idem_fingerprint($fp)$extra)});
	return $st eq '00000' ? $out : "ERROR $st";
}

is(begin_of('done', 7), q{replay||{"charge": "ch_done"}}, 'the completed key replays its response');
is(begin_of('live', 8, q{in_flight => 'raise'}), 'ERROR IK409',
	'the pending claim with a live lease refuses a duplicate (IK409)');
my ($st) = try_sql($coord, 'postgres',
	qq{SELECT idem_finish('charge', 'live', $live_token, '{"charge": "ch_live"}')});
is($st, '00000', 'its holder finishes it with the token it got before the update');
is(begin_of('live', 8), q{replay||{"charge": "ch_live"}}, 'and it replays');

sleep 1 while time < $ckpt_at + 4;
my $ckpt = begin_of('ckpt', 9);
like($ckpt, qr/^recover\|(\d+)\|\{"provider_ref": "ref_9"\}$/,
	'the checkpointed claim, its lease lapsed, is recovered with its checkpoint');
my ($recovered) = $ckpt =~ /^recover\|(\d+)\|/;
cmp_ok($recovered // 0, '>', $ckpt_token, 'with a greater token');
like(begin_of('gone', 10), qr/^new\|\d+\|$/, 'the aborted key is new');

# ---- workers refuse, the coordinator serves both shapes ----

for my $w ($w1, $w2)
{
	my ($wst) = try_sql($w, 'postgres', q{SELECT status FROM idem_begin('charge', 'done', idem_fingerprint(7))});
	is($wst, '0A000', $w->name . ': a call after the update is refused (0A000)');
	is($w->safe_psql('postgres', 'SELECT count(*) FROM idem_record'), '0', $w->name . ': nothing written');
}

my $calls = q{
	SELECT status, token, status = 'new' AS is_new
	  FROM idem_begin('charge', 'after', idem_fingerprint(11)) \gset
	\if :is_new
	INSERT INTO charges VALUES (11, 'after', 100);
	SELECT idem_finish('charge', 'after', :'token', '{"charge": "ch_after"}');
	\endif
};
my ($tst, $tout, $terr) = try_sql($coord, 'postgres', "BEGIN;\n$calls\nCOMMIT;\n");
if ($two_phase)
{
	is($tst, '00000', 'the in-transaction shape after the update commits');
}
else
{
	is_tx_refusal($tst, $terr, 'the in-transaction shape after the update is refused on this Citus');
	is(written('after'), '0|0', 'and writes nothing');
	($tst) = try_sql($coord, 'postgres', $calls);
	is($tst, '00000', 'the same calls, each on its own, charge');
}
is(begin_of('after', 11), q{replay||{"charge": "ch_after"}}, 'and replays');
is($coord->safe_psql('postgres', q{SELECT string_agg(key || '=' || n, ',' ORDER BY key)
	FROM (SELECT key, count(*) n FROM charges GROUP BY key) c}),
	'after=1,done=1', 'each charge happened once');

# ---- then the records distributed, the 1.4 claims still in flight ----

is($coord->safe_psql('postgres', 'SELECT idem_distribute()'), 't', 'idem_distribute() after the update');
($st) = try_sql($w1, 'postgres',
	qq{SELECT idem_finish('charge', 'live2', $live2_token, '{"charge": "ch_live2"}')});
is($st, '00000', 'a claim made at 1.4 is finished through a worker with its token');
my $ckpt2 = $w2->safe_psql('postgres', q{
	SELECT status || '|' || token || '|' || response FROM idem_begin('charge', 'ckpt2', idem_fingerprint(13))});
like($ckpt2, qr/^recover\|(\d+)\|\{"provider_ref": "ref_13"\}$/,
	'a checkpointed claim made at 1.4 is recovered through a worker');
my ($recovered2) = $ckpt2 =~ /^recover\|(\d+)\|/;
cmp_ok($recovered2 // 0, '>', $ckpt2_token, 'with a greater token');
my %fp = (done => 7, live => 8, live2 => 12, after => 11);
for my $n ($coord, $w1, $w2)
{
	# one statement per key: Citus delegates a call with a constant key
	my @status = map {
		$n->safe_psql('postgres', qq{SELECT status FROM idem_begin('charge', '$_', idem_fingerprint($fp{$_}))})
	} sort keys %fp;
	is(join(',', @status), 'replay,replay,replay,replay', $n->name . ': every completed key replays');
}

$_->stop for ($coord, $w1, $w2);
done_testing();
