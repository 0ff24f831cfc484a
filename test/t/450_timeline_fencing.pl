
# Copyright (c) 2024, idempotency authors
#
# Fencing tokens across a new timeline: a promoted lagging standby and a
# point-in-time recovery (src/tokens.c).
#
# A token is epoch << 25 | count, an epoch band << 22 | serial, and
# idem_token_epoch (logged) holds timeline << 38 | band << 22 | serial of
# the last epoch started.  The count (the unlogged idem_token_seq) starts
# over after a crash, a promotion or a restore, and the first claim then
# starts a new epoch: serial + 1, and the band goes up by the number of
# timelines since the last epoch.  A crash stays on its timeline: the
# serial alone orders its epochs.  A server that continues an older state
# of the history -- a standby that lagged, a recovery to a point in the
# past -- has seen fewer epochs than the server it replaces, so its serial
# can be below that server's last one; only the band, raised by its new
# timeline, puts its tokens above every token that server issued.  That is
# what this file checks, in the two ways a database gets there:
#
# 1. An asynchronous standby, caught up (it has replayed idem_token_epoch),
#    then stopped.  The old primary goes on: claims, a crash, claims,
#    another crash, claims -- two epochs the standby never sees -- and a
#    worker's claim with a lease, committed.  The old primary dies; the
#    standby is promoted (timeline 2).  Its first token is greater than
#    every token the old primary issued; its band is the old primary's
#    plus one, with timeline 2 recorded in idem_token_epoch; and its serial
#    is not above the old primary's last one (so without the band the
#    token would not be greater: this is the case the band exists for).
#    The leased key is 'new' on the new primary (claims are unlogged, not
#    replicated), and the old worker's idem_finish with its old token is
#    fenced off: IK412.
# 2. Point-in-time recovery: a base backup, claims, a restore point, then
#    claims, a crash (a new epoch) and claims after it; the WAL archived.
#    The backup is restored up to the restore point and promoted
#    (timeline 2): its first token is greater than every token the
#    original issued, before and after the restore point, its band
#    greater; a key finished before the restore point replays there, one
#    finished after it is absent.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

# ---- helpers ----

# the parts of a token: epoch << 25 | count, epoch = band << 22 | serial
sub band   { return $_[0] >> 47; }
sub serial { return ($_[0] >> 25) & 4194303; }
sub count  { return $_[0] & 33554431; }

# the parts of idem_token_epoch: timeline << 38 | band << 22 | serial
sub epoch_seq
{
	my ($node) = @_;
	my $v = $node->safe_psql('postgres', 'SELECT last_value FROM idem_token_epoch');
	return { value => $v, timeline => $v >> 38, band => ($v >> 22) & 65535, serial => $v & 4194303 };
}

# "status|token" of a claim of $key in operation 'tl'
sub claim
{
	my ($node, $key, $extra) = @_;
	$extra = defined $extra ? ", $extra" : '';
	return $node->safe_psql('postgres', qq{
		SELECT status || '|' || coalesce(token::text, '')
		  FROM idem_begin('tl', '$key', NULL$extra)});
}

# the token of a new claim of $key
sub claim_token
{
	my ($node, $key, $extra) = @_;
	my $c = claim($node, $key, $extra);
	my ($t) = $c =~ /^new\|(\d+)$/ or die "not a new claim of $key: $c";
	return $t;
}

# $n new keys $prefix-1..$n: their tokens
sub claims
{
	my ($node, $prefix, $n) = @_;
	return map { claim_token($node, "$prefix-$_") } 1 .. $n;
}

sub finish
{
	my ($node, $key, $token, $response) = @_;
	$node->safe_psql('postgres', qq{SELECT idem_finish('tl', '$key', $token, '$response')});
	return;
}

sub describe
{
	my ($t) = @_;
	return sprintf('%d (band %d, serial %d, count %d)', $t, band($t), serial($t), count($t));
}

# ========== 1. a lagging asynchronous standby promoted ==========

my $primary = PostgreSQL::Test::Cluster->new('tl_primary');
$primary->init(allows_streaming => 1);
$primary->append_conf('postgresql.conf', "autovacuum = off\n");
$primary->start;
$primary->safe_psql('postgres', 'CREATE EXTENSION idempotency');

my @old = claims($primary, 'p0', 3);    # every token the old primary issues
my $first = $old[0];
is(count($first), 1, 'old primary: the first claim starts an epoch: ' . describe($first));

$primary->backup('b');
my $standby = PostgreSQL::Test::Cluster->new('tl_standby');
$standby->init_from_backup($primary, 'b', has_streaming => 1);
$standby->start;
push @old, claims($primary, 'p1', 3);
# a finished key: its record is logged (mode 'completed': idem_result)
finish($primary, 'p1-1', $old[3], '{"p": 1}');
$primary->wait_for_catchup($standby);

my $seen = epoch_seq($standby);
is($seen->{value}, epoch_seq($primary)->{value},
	"standby: caught up, it has replayed idem_token_epoch ($seen->{value})");
is("$seen->{timeline}|$seen->{band}|$seen->{serial}",
	'1|' . band($first) . '|' . serial($first),
	'standby: the epoch it saw is the old primary\'s first, on timeline 1');
is(scalar(grep { band($_) == band($first) && serial($_) == serial($first) } @old),
	scalar(@old), 'so far every token of the old primary is of that epoch');

# the standby stops: from now on it lags
$standby->stop;

push @old, claims($primary, 'p2', 3);
$primary->stop('immediate');
$primary->start;
my @after_crash1 = claims($primary, 'p3', 3);
$primary->stop('immediate');
$primary->start;
my @after_crash2 = claims($primary, 'p4', 3);
push @old, @after_crash1, @after_crash2;
is(serial($after_crash1[0]), serial($first) + 1,
	'old primary: the first crash started the next epoch: ' . describe($after_crash1[0]));
is(serial($after_crash2[0]), serial($first) + 2,
	'old primary: the second crash the one after it: ' . describe($after_crash2[0]));

# a worker's claim with a lease, committed, pending when the primary dies
my $t_worker = claim_token($primary, 'leased', q{lease => '1 hour'});
push @old, $t_worker;

my $old_last = epoch_seq($primary);
is("$old_last->{timeline}|$old_last->{serial}", '1|' . (serial($first) + 2),
	'old primary: idem_token_epoch holds its last epoch, on timeline 1, which the standby never saw');
my $old_max = token_max(@old);
my $old_band = band($first);
is(scalar(grep { band($_) == $old_band } @old), scalar(@old),
	"every token of the old primary is in band $old_band");
is($old_max, $t_worker, 'the greatest token of the old primary: ' . describe($old_max));

# the old primary dies; the standby, lagging two epochs, is promoted
$primary->stop('immediate');
$standby->start;
is($standby->safe_psql('postgres', 'SELECT pg_is_in_recovery()'), 't', 'the standby is in recovery');
is(epoch_seq($standby)->{value}, $seen->{value},
	'and has not seen the old primary\'s later epochs');
$standby->promote;
ok($standby->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'),
	'the standby is promoted');
my $new = $standby;

my $t_new = claim_token($new, 'n-1');
note('new primary: first token ' . describe($t_new) . '; old primary\'s greatest ' . describe($old_max));
cmp_ok($t_new, '>', $old_max,
	'new primary: its first token is greater than every token the old primary issued');
is(band($t_new), $old_band + 1, 'new primary: its band is the old primary\'s plus one');
is(count($t_new), 1, 'new primary: and it starts a new epoch (count 1)');
my $new_epoch = epoch_seq($new);
is($new_epoch->{timeline}, 2, 'new primary: idem_token_epoch records timeline 2');
is("$new_epoch->{band}|$new_epoch->{serial}", band($t_new) . '|' . serial($t_new),
	'new primary: and the epoch of that token');
# what makes this a test of the band: the standby missed the old primary's
# last two epochs, so its serial is not above theirs -- ordered by serial
# alone, its tokens would not be greater
is(serial($t_new), $seen->{serial} + 1, 'new primary: its serial follows the epoch it had seen');
cmp_ok(serial($t_new), '<=', serial($old_max),
	'new primary: its serial is not above the old primary\'s last serial: only the band orders them');
cmp_ok((($old_band << 22 | serial($t_new)) << 25) | count($t_new), '<=', $old_max,
	'(the same token in the old primary\'s band would not be greater than the old primary\'s)');
cmp_ok(claim_token($new, 'n-2'), '>', $t_new, 'new primary: the next token is greater still');

# a finished key was replicated; the worker's pending claim was not
is(claim($new, 'p1-1'), 'replay|', 'new primary: a key finished on the old primary replays');
my $c_takeover = claim($new, 'leased', q{in_flight => 'raise'});
like($c_takeover, qr/^new\|\d+$/,
	'new primary: the key the old worker held with a lease is new (pending claims are not replicated)');
my ($t_takeover) = $c_takeover =~ /(\d+)$/;
cmp_ok($t_takeover, '>', $t_worker, 'new primary: its new token is greater than the old worker\'s');
my ($ret, $stdout, $stderr) = $new->psql('postgres',
	qq{\\set VERBOSITY verbose\nSELECT idem_finish('tl', 'leased', $t_worker, '{}')});
isnt($ret, 0, 'new primary: the old worker\'s idem_finish fails');
like($stderr, qr/ERROR:  IK412/, 'new primary: fenced off with IK412');
finish($new, 'leased', $t_takeover, '{"by": "new"}');
is(key_records($new, 'leased'), qq{$t_takeover|completed|{"by": "new"}},
	'new primary: the new owner finishes the key');
$new->stop;

# ========== 2. point-in-time recovery ==========

my $orig = PostgreSQL::Test::Cluster->new('tl_orig');
$orig->init(has_archiving => 1, allows_streaming => 1);
$orig->append_conf('postgresql.conf', "autovacuum = off\n");
$orig->start;
$orig->safe_psql('postgres', 'CREATE EXTENSION idempotency');

my @issued = claims($orig, 'r0', 3);
my $r_first = $issued[0];
is(count($r_first), 1, 'original: the first claim starts an epoch: ' . describe($r_first));
$orig->backup('b');
my $t_before = claim_token($orig, 'before-rp');
finish($orig, 'before-rp', $t_before, '{"rp": "before"}');
push @issued, $t_before, claims($orig, 'r1', 2);
$orig->safe_psql('postgres', q{SELECT pg_create_restore_point('rp')});
my $t_after = claim_token($orig, 'after-rp');
finish($orig, 'after-rp', $t_after, '{"rp": "after"}');
push @issued, $t_after, claims($orig, 'r2', 2);
$orig->stop('immediate');
$orig->start;
my @r_crash = claims($orig, 'r3', 3);
push @issued, @r_crash;
is(serial($r_crash[0]), serial($r_first) + 1,
	'original: after the restore point a crash started the next epoch: ' . describe($r_crash[0]));
my $t_after2 = claim_token($orig, 'after-rp-crash');
finish($orig, 'after-rp-crash', $t_after2, '{"rp": "after crash"}');
push @issued, $t_after2;
my $r_max = token_max(@issued);
my $r_band = band($r_first);
is(scalar(grep { band($_) == $r_band } @issued), scalar(@issued),
	"every token of the original is in band $r_band");
is($r_max, $t_after2, 'the greatest token of the original: ' . describe($r_max));

# all of the WAL into the archive
my $walfile = $orig->safe_psql('postgres', 'SELECT pg_walfile_name(pg_current_wal_lsn())');
$orig->safe_psql('postgres', 'SELECT pg_switch_wal()');
ok( $orig->poll_query_until('postgres',
		qq{SELECT '$walfile' <= last_archived_wal FROM pg_stat_archiver}),
	"original: its WAL is archived (up to $walfile)");
$orig->stop;

my $pitr = PostgreSQL::Test::Cluster->new('tl_pitr');
$pitr->init_from_backup($orig, 'b', has_restoring => 1, standby => 0);
$pitr->append_conf('postgresql.conf', q{
recovery_target_name = 'rp'
recovery_target_action = 'promote'
archive_mode = off
});
$pitr->start;
ok($pitr->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'),
	'restored: recovered to the restore point and promoted');

is(key_records($pitr, 'before-rp'), qq{$t_before|completed|{"rp": "before"}},
	'restored: the key finished before the restore point is there');
is(key_records($pitr, 'after-rp'), '', 'restored: the key finished after the restore point is not');
is(key_records($pitr, 'after-rp-crash'), '', 'restored: nor the one finished after the crash');
is(claim($pitr, 'before-rp'), 'replay|', 'restored: the key finished before the restore point replays');

my $t_pitr = claim_token($pitr, 'after-rp');
note('restored: first token ' . describe($t_pitr) . '; original\'s greatest ' . describe($r_max));
cmp_ok($t_pitr, '>', $r_max,
	'restored: its first token is greater than every token the original issued, after the restore point too');
cmp_ok(band($t_pitr), '>', $r_band, 'restored: its band is greater than the original\'s');
is(band($t_pitr), $r_band + 1, 'restored: by one, for timeline 2');
my $p_epoch = epoch_seq($pitr);
is($p_epoch->{timeline}, 2, 'restored: idem_token_epoch records timeline 2');
is(serial($t_pitr), serial($r_first) + 1, 'restored: its serial follows the epoch at the restore point');
cmp_ok(serial($t_pitr), '<=', serial($r_max),
	'restored: its serial is not above the original\'s last serial: only the band orders them');
cmp_ok(claim_token($pitr, 'after-rp-crash'), '>', $t_pitr, 'restored: the next token is greater still');
$pitr->stop;

done_testing();
