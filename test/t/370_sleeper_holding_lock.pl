# A duplicate sleeping on a committed claim while its transaction holds a
# lock on the record table from an earlier claim.  The lock cannot be given
# back, so a VACUUM FULL queued behind it would hold up the owner's
# idem_finish behind the VACUUM FULL, in a cycle the deadlock detector
# cannot see (the duplicate sleeps on its latch).  The sleep must end with
# 40P01 once the VACUUM FULL queues, within about deadlock_timeout; then
# the VACUUM FULL and the owner's finish complete, and a retry replays.
#
# Also: a duplicate whose transaction holds no such lock gives it back while
# it sleeps, so the VACUUM FULL runs at once and the duplicate replays.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('sleeper_lock');
$node->init;
$node->append_conf('postgresql.conf', "deadlock_timeout = '200ms'");
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

my $owner = $node->background_psql('postgres', on_error_stop => 0);
my $dup = $node->background_psql('postgres', on_error_stop => 0);
my $dba = $node->background_psql('postgres', on_error_stop => 0);

# ---- 1. the duplicate's transaction holds the lock from an earlier claim ----

my ($token) = run_sql($owner,
	q{SELECT token FROM idem_begin('op', 'k1', NULL, lease => '60 s');});
like($token, qr/^\d+$/, 'owner: committed claim of k1');

my ($out, $state) = run_sql($dup,
	q{BEGIN; SELECT status FROM idem_begin('op', 'other', NULL);});
is($state, '00000', 'duplicate: an earlier claim in its transaction');
send_sql($dup, q{SELECT status FROM idem_begin('op', 'k1', NULL);});
$node->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity
	 WHERE wait_event_type = 'Extension' AND query LIKE '%''k1''%'})
  or die 'the duplicate did not go to sleep';

my $t0 = time;
send_sql($dba, q{VACUUM FULL idem_record;});
my ($dout, $dstate, $derr) = wait_sql($dup);
my $elapsed = time - $t0;
is($dstate, '40P01', 'the sleeping duplicate ends with 40P01 once VACUUM FULL queues');
like($derr, qr/holds a lock on the record table that another command is waiting for/,
	'and says why');
cmp_ok($elapsed, '<', 10, "within seconds, not the 60 s lease ($elapsed s)");
run_sql($dup, 'ROLLBACK;');

my (undef, $vstate) = wait_sql($dba);
is($vstate, '00000', 'VACUUM FULL completes');
(undef, $state) = run_sql($owner,
	qq{SELECT idem_finish('op', 'k1', $token, '"ch_1"');});
is($state, '00000', "owner's idem_finish completes");
($out) = run_sql($dup, q{SELECT status || ' ' || response FROM idem_begin('op', 'k1', NULL);});
is($out, 'replay "ch_1"', 'the retried duplicate replays');

# ---- 2. no earlier lock: the sleeper gives its lock back ----

($token) = run_sql($owner,
	q{SELECT token FROM idem_begin('op', 'k2', NULL, lease => '60 s');});
send_sql($dup, q{SELECT status || ' ' || response FROM idem_begin('op', 'k2', NULL);});
$node->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity
	 WHERE wait_event_type = 'Extension' AND query LIKE '%''k2''%'})
  or die 'the duplicate did not go to sleep';
(undef, $vstate) = run_sql($dba, q{VACUUM FULL idem_record;});
is($vstate, '00000', 'VACUUM FULL runs while the duplicate sleeps');
(undef, $state) = run_sql($owner,
	qq{SELECT idem_finish('op', 'k2', $token, '"ch_2"');});
is($state, '00000', "owner's idem_finish completes");
($out, $state) = wait_sql($dup);
is($out, 'replay "ch_2"', 'the duplicate wakes and replays');

$_->quit for ($owner, $dup, $dba);
$node->stop;
done_testing();
