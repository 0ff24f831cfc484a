
# Copyright (c) 2024, idempotency authors
#
# The Citus coordinator's streaming standby, promoted when the coordinator
# dies (docs/scaling-out.md, "Operations"), with the records on the
# coordinator (mode 'all'), then the records distributed from the promoted
# one:
#
#  - before the crash: keys finished, a claim pending (its worker still
#    running the external call), a claim aborted;
#  - the coordinator stopped (immediate), its standby promoted and made the
#    coordinator in Citus's metadata (citus_set_coordinator_host, the step
#    Citus asks for after a failover);
#  - through the promoted coordinator: every finished key replays, the
#    pending claim is still held (IK409) and its owner's finish, with its
#    token, is accepted and replayed; the aborted key's next claim gets a
#    greater token; a new key is claimed and finished;
#  - idem_distribute() there: every key replays through every node, and the
#    aborted key's next claim again gets a greater token.

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

my ($coord, $w1, $w2) = citus_cluster('s');

# mode 'all', which keeps pending claims through a crash and a failover
# (docs/durability.md) and which distributed records take anyway
$coord->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	SELECT idem_set_durability('all');
});

# "status|token" of a claim of $key on $node
sub claim
{
	my ($node, $key) = @_;
	return $node->safe_psql('postgres', qq{
		SELECT status || '|' || token FROM idem_begin('charge', '$key', NULL, lease => '1 hour')});
}

sub finish
{
	my ($node, $key, $token) = @_;
	$node->safe_psql('postgres', qq{SELECT idem_finish('charge', '$key', $token, '{"done": "$key"}')});
}

# "status|response" of a retry of $key on $node
sub replay
{
	my ($node, $key) = @_;
	return $node->safe_psql('postgres', qq{
		SELECT status || '|' || coalesce(response::text, '')
		  FROM idem_begin('charge', '$key', NULL, in_flight => 'raise')});
}

# ---- before the crash ----

for my $i (1 .. 5)
{
	my ($status, $token) = split /\|/, claim($coord, "done-$i");
	is($status, 'new', "done-$i: claimed on the coordinator");
	finish($coord, "done-$i", $token);
}
my ($pstatus, $ptoken) = split /\|/, claim($coord, 'pending-1');
is($pstatus, 'new', 'pending-1: claimed, its external call still running');
my ($astatus, $atoken) = split /\|/, claim($coord, 'aborted-1');
$coord->safe_psql('postgres', "SELECT idem_abort('charge', 'aborted-1', $atoken)");

# ---- the standby, promoted ----

$coord->backup('base');
my $standby = PostgreSQL::Test::Cluster->new('scoordinator_standby');
$standby->init_from_backup($coord, 'base', has_streaming => 1);
# the key of the certificate Citus made at CREATE EXTENSION citus comes
# out of the base backup readable by the group, which the server refuses
my $key = $standby->data_dir . '/server.key';
chmod(0600, $key) or die "chmod $key: $!" if -e $key;
$standby->start;
$coord->wait_for_catchup($standby);

$coord->stop('immediate');
$standby->promote;
$standby->safe_psql('postgres',
	sprintf(q{SELECT citus_set_coordinator_host('%s', %d)}, $standby->host, $standby->port));
my $new = $standby;

for my $i (1 .. 5)
{
	is(replay($new, "done-$i"), qq{replay|{"done": "done-$i"}}, "done-$i: replays on the promoted coordinator");
}
my ($st, undef, $err) = try_sql($new, 'postgres',
	q{SELECT * FROM idem_begin('charge', 'pending-1', NULL, in_flight => 'raise')});
is($st, 'IK409', 'pending-1: still held on the promoted coordinator (its lease runs)');
finish($new, 'pending-1', $ptoken);
is(replay($new, 'pending-1'), 'replay|{"done": "pending-1"}',
	"pending-1: its owner's finish with the token of before the crash is accepted, and replays");
my ($status, $token) = split /\|/, claim($new, 'aborted-1');
is($status, 'new', 'aborted-1: claimed again on the promoted coordinator');
cmp_ok($token, '>', $atoken, 'aborted-1: with a greater token than before the crash');
$new->safe_psql('postgres', "SELECT idem_abort('charge', 'aborted-1', $token)");
$atoken = $token;
($status, $token) = split /\|/, claim($new, 'after-1');
is($status, 'new', 'after-1: a new key is claimed on the promoted coordinator');
finish($new, 'after-1', $token);

# ---- the records distributed from the promoted coordinator ----

is($new->safe_psql('postgres', 'SELECT idem_distribute()'), 't', 'idem_distribute() on the promoted coordinator');
for my $node ($new, $w1, $w2)
{
	for my $key ((map { "done-$_" } 1 .. 5), 'pending-1', 'after-1')
	{
		is(replay($node, $key), qq{replay|{"done": "$key"}}, "$key: replays through " . $node->name);
	}
}
($status, $token) = split /\|/, claim($w1, 'aborted-1');
is($status, 'new', 'aborted-1: claimed again, through a worker, the records distributed');
cmp_ok($token, '>', $atoken, 'aborted-1: with a greater token still');

$_->stop for ($new, $w1, $w2);
done_testing();
