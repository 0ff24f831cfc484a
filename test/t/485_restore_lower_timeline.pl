# Copyright (c) 2024, idempotency authors
#
# Fencing tokens after a dump is restored into a cluster on a lower
# timeline, and that cluster fails over to a standby that never saw its
# first token epoch (src/tokens.c, idem_token_cluster).
#
# Cluster A reaches timeline 3: a primary, a standby of it promoted
# (timeline 2), a standby of that one promoted (timeline 3); claims on
# each.  On timeline 3: completed keys and claims, then pg_dump -Fc: the
# dump carries idem_token_epoch (timeline 3) and idem_token_cluster (A's
# system identifier).
#
# Cluster B (timeline 1): the dump is restored into a fresh database;
# right after the restore, before any claim on B, a base backup starts two
# asynchronous streaming standbys:
#   B1  stopped before B's first claim: it lags, and never sees B's epoch
#   B2  left streaming: it sees B's epoch and claims, as far as they are
#       logged
# On B: claims (w-1..3, a worker's claim "stale" with a 1 h lease,
# pending when B dies; "lapse", whose first claim's lease lapses and is
# taken over on B by a greater token; "done", finished), every token of B
# kept.  B's first epoch is a new history (another cluster recorded the
# last one): its band is A's plus B's whole timeline (1).  Then B dies
# and each standby in turn is promoted (timeline 2):
#   - its first token is greater than every token B handed out, its band
#     above B's: a band chosen from the timelines alone (2 < 3, so no
#     raise) would be B's band and serial, the very tokens B handed out;
#   - every key B claimed, claimed again there, gets a token greater than
#     every token B handed out for it;
#   - the stale worker's idem_finish with B's token is refused (IK412),
#     so is the lapsed claim's first owner's;
#   - the keys completed on A replay.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $db = 'app';

# ---- helpers ----

# the parts of a token: epoch << 25 | count, epoch = band << 22 | serial
sub band   { return $_[0] >> 47; }
sub serial { return ($_[0] >> 25) & 4194303; }

sub describe
{
	my ($t) = @_;
	return sprintf('%d (band %d, serial %d, count %d)', $t, band($t), serial($t), $t & 33554431);
}

# idem_token_epoch: timeline << 38 | band << 22 | serial
sub epoch_seq
{
	my ($node, $d) = @_;
	my $v = $node->safe_psql($d // $db, 'SELECT last_value FROM idem_token_epoch');
	return { value => $v, timeline => $v >> 38, band => ($v >> 22) & 65535, serial => $v & 4194303 };
}

sub cluster_seq
{
	my ($node, $d) = @_;
	return $node->safe_psql($d // $db, 'SELECT last_value FROM idem_token_cluster');
}

sub sysid
{
	my ($node) = @_;
	return $node->safe_psql('postgres', 'SELECT system_identifier FROM pg_control_system()');
}

# "status|token" of a claim of $key in operation 'rt', or "ERROR sqlstate"
sub claim
{
	my ($node, $key, $extra) = @_;
	$extra = defined $extra ? ", $extra" : '';
	my ($ret, $out, $err) = $node->psql($db, qq{
		SELECT status || '|' || coalesce(token::text, '')
		  FROM idem_begin('rt', '$key', idem_fingerprint('$key')$extra)},
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	return $out if $ret == 0;
	my ($st) = $err =~ /ERROR:\s+([0-9A-Z]{5}):/;
	return 'ERROR ' . ($st // $err);
}

sub claim_token
{
	my ($node, $key, $extra) = @_;
	my $c = claim($node, $key, $extra);
	my ($t) = $c =~ /^new\|(\d+)$/ or die "not a new claim of $key: $c";
	return $t;
}

sub finish
{
	my ($node, $key, $token, $response) = @_;
	my ($ret, $out, $err) = $node->psql($db, qq{SELECT idem_finish('rt', '$key', $token, '$response')},
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	return '00000' if $ret == 0;
	my ($st) = $err =~ /ERROR:\s+([0-9A-Z]{5}):/;
	return $st // $err;
}

sub promote
{
	my ($node) = @_;
	$node->promote;
	ok($node->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'), $node->name . ': promoted');
	return;
}

# ========== cluster A, up to timeline 3 ==========

my $a1 = PostgreSQL::Test::Cluster->new('rt_a1');
$a1->init(allows_streaming => 1);
$a1->start;
$a1->safe_psql('postgres', "CREATE DATABASE $db");
$a1->safe_psql($db, 'CREATE EXTENSION idempotency');
finish($a1, 'a-tl1', claim_token($a1, 'a-tl1'), '{"tl": 1}');
$a1->backup('b');
my $a2 = PostgreSQL::Test::Cluster->new('rt_a2');
$a2->init_from_backup($a1, 'b', has_streaming => 1);
$a2->start;
$a1->wait_for_catchup($a2);
$a1->stop;
promote($a2);
finish($a2, 'a-tl2', claim_token($a2, 'a-tl2'), '{"tl": 2}');
is(epoch_seq($a2)->{timeline}, 2, 'A: the second server starts an epoch on timeline 2');
$a2->backup('b');
my $a3 = PostgreSQL::Test::Cluster->new('rt_a3');
$a3->init_from_backup($a2, 'b', has_streaming => 1);
$a3->start;
$a2->wait_for_catchup($a3);
$a2->stop;
promote($a3);
finish($a3, 'a-tl3', claim_token($a3, 'a-tl3'), '{"tl": 3}');
claim_token($a3, 'a-pending', q{lease => '1 h'});
my $a_epoch = epoch_seq($a3);
is($a_epoch->{timeline}, 3, 'A: the third server starts an epoch on timeline 3');
my $sysid_a = sysid($a3);
is(cluster_seq($a3), $sysid_a, 'A: idem_token_cluster holds A\'s system identifier');
my $a_max = $a3->safe_psql($db, "SELECT max(token) FROM $IDEM_RECORDS r");
my $dump = $a3->basedir . '/a.dump';
$a3->command_ok([ 'pg_dump', '-Fc', '-f', $dump, '-d', $a3->connstr($db) ], 'A: pg_dump -Fc on timeline 3');
$a3->stop;

# ========== cluster B, timeline 1 ==========

my $nb = PostgreSQL::Test::Cluster->new('rt_b');
$nb->init(allows_streaming => 1);
$nb->start;
my $sysid_b = sysid($nb);
isnt($sysid_b, $sysid_a, 'B is another cluster (another system identifier)');
$nb->safe_psql('postgres', "CREATE DATABASE $db");
$nb->command_ok([ 'pg_restore', '--exit-on-error', '-d', $nb->connstr($db), $dump ], 'B: pg_restore into a fresh database');
is(epoch_seq($nb)->{value}, $a_epoch->{value}, 'B: the restored idem_token_epoch is A\'s, timeline 3');
is(cluster_seq($nb), $sysid_a, 'B: the restored idem_token_cluster names A');

# the standbys, from a backup taken before any claim on B
$nb->backup('b');
my %standby;
for my $name (qw(b1 b2))
{
	my $s = $standby{$name} = PostgreSQL::Test::Cluster->new("rt_$name");
	$s->init_from_backup($nb, 'b', has_streaming => 1);
	$s->start;
}
$nb->wait_for_catchup($standby{$_}) for qw(b1 b2);
is($nb->safe_psql('postgres', q{SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'async'}), '2',
	'B: two asynchronous streaming standbys');
for my $name (qw(b1 b2))
{
	is(epoch_seq($standby{$name})->{value}, $a_epoch->{value},
		"$name: it has the restore, with A's epoch, and no epoch of B");
}
$standby{b1}->stop;    # from now on B1 lags

# ---- claims on B ----

my %btok;    # $btok{key} = [every token B handed out for it]
for my $key (map { "w-$_" } 1 .. 3)
{
	push @{ $btok{$key} }, claim_token($nb, $key);
}
my $b_first = $btok{'w-1'}[0];
note('B: first token ' . describe($b_first) . '; A\'s epoch: band ' . $a_epoch->{band} . ', serial ' . $a_epoch->{serial});
cmp_ok($b_first, '>', $a_max, 'B: its first token is greater than every token A handed out');
is(band($b_first), $a_epoch->{band} + 1,
	'B: another cluster recorded the last epoch: a new history, the band raised by B\'s whole timeline (1)');
my $b_epoch = epoch_seq($nb);
is("$b_epoch->{timeline}|" . cluster_seq($nb), "1|$sysid_b", 'B: idem_token_epoch records timeline 1, idem_token_cluster B');

# a worker's claim, pending when B dies
my $t_stale = claim_token($nb, 'stale', q{lease => '1 h'});
push @{ $btok{stale} }, $t_stale;
# a claim whose lease lapses, taken over on B
my $t_lapse1 = claim_token($nb, 'lapse', q{lease => '10 ms'});
my $c = claim($nb, 'lapse', q{in_flight => 'wait', lease => '1 h'});
like($c, qr/^new\|\d+$/, 'B: lapse, its lease over, is taken over');
my ($t_lapse2) = $c =~ /(\d+)$/;
cmp_ok($t_lapse2, '>', $t_lapse1, 'B: ... with a greater token');
is(finish($nb, 'lapse', $t_lapse1, '{}'), 'IK412', 'B: lapse\'s first owner is fenced off (IK412)');
push @{ $btok{lapse} }, $t_lapse1, $t_lapse2;
# a finished key
my $t_done = claim_token($nb, 'done');
is(finish($nb, 'done', $t_done, '{"on": "B"}'), '00000', 'B: done is finished');
push @{ $btok{done} }, $t_done;
my $b_max = token_max(map { @$_ } values %btok);
is($b_max, $nb->safe_psql($db, q{SELECT max(token) FROM (SELECT token FROM idem_record UNION ALL SELECT token FROM idem_result) r}),
	'B: the greatest token B handed out: ' . describe($b_max));
$nb->wait_for_catchup($standby{b2});
is(epoch_seq($standby{b2})->{value}, $b_epoch->{value}, 'b2: it has replayed B\'s epoch');
$nb->stop('immediate');

# ========== each standby promoted ==========

for my $name (qw(b1 b2))
{
	my $s = $standby{$name};
	$s->start if $name eq 'b1';
	is(epoch_seq($s)->{value}, $name eq 'b1' ? $a_epoch->{value} : $b_epoch->{value},
		$name eq 'b1' ? 'b1: it never saw B\'s epoch (it recorded A\'s, timeline 3)'
		  : 'b2: it saw B\'s epoch (timeline 1)');
	promote($s);

	my %stok;
	for my $key (sort keys %btok)
	{
		my $c = claim($s, $key, q{in_flight => 'raise'});
		# in mode 'completed' the claims were not replicated (unlogged): all
		# of them are new; "done" was finished on B, and is there on b2 only
		if ($name eq 'b2' && $key eq 'done')
		{
			is($c, 'replay|', 'b2: done, finished on B and streamed, replays');
			next;
		}
		like($c, qr/^new\|\d+$/, "$name: $key is new (B's claim did not reach it)");
		($stok{$key}) = $c =~ /(\d+)$/;
		cmp_ok($stok{$key}, '>', token_max(@{ $btok{$key} }),
			"$name: $key: its token is greater than every token B handed out for it");
	}
	my $first = (sort { $a <=> $b } values %stok)[0];
	note("$name: first token " . describe($first) . '; B\'s greatest ' . describe($b_max));
	cmp_ok($first, '>', $b_max, "$name: every token is greater than every token B handed out");
	cmp_ok(band($first), '>', band($b_max), "$name: its band is above B's");
	if ($name eq 'b1')
	{
		# what makes this the case idem_token_cluster exists for: from the
		# timelines alone (2 below the recorded 3) the band would stay A's,
		# the serial would be A's next -- B's own epoch
		is(serial($first), serial($b_first), 'b1: its serial is B\'s (both follow A\'s epoch)');
		is(band($first), $a_epoch->{band} + 2, 'b1: a new history, its band A\'s plus timeline 2');
	}
	my $e = epoch_seq($s);
	is("$e->{timeline}|" . cluster_seq($s), "2|$sysid_b", "$name: idem_token_epoch records timeline 2, cluster B");

	is(finish($s, 'stale', $t_stale, '{"by": "stale"}'), 'IK412',
		"$name: the stale worker's idem_finish with B's token is refused (IK412)");
	is(finish($s, 'lapse', $t_lapse2, '{"by": "B"}'), 'IK412',
		"$name: so is lapse's owner on B");
	is(finish($s, 'stale', $stok{stale}, qq{{"by": "$name"}}), '00000', "$name: the new owner finishes stale");
	for my $k (qw(a-tl1 a-tl2 a-tl3))
	{
		is(claim($s, $k), 'replay|', "$name: $k, completed on A, replays");
	}
	unlike(slurp_file($s->logfile), qr/terminated by signal|PANIC|TRAP:/, "$name: no backend crashed");
	$s->stop;
}

done_testing();
