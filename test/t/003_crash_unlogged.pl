# Crash (immediate shutdown, then start) with an UNLOGGED record table:
# durability mode 'none' (both idem_record and idem_result unlogged), the
# default before 1.3.
#
# 1. Crash recovery empties unlogged tables: completed and pending records
#    are gone (documented: at-least-once after a crash).  The extension is
#    fully usable afterwards: begin -> new, finish, replay, purge; and the
#    table is still unlogged.
# 2. Tokens issued after the crash are greater than every token issued
#    before it, so a worker that outlived the crash cannot finish a new
#    owner's claim (fencing) -- also when the claim committed having
#    written nothing but the unlogged table, so that nothing flushed its
#    commit, and when a claim before it rolled back.  (The token count is
#    an unlogged sequence that the crash resets; the first claim after it
#    starts a new, greater epoch.  220_token_epochs tests the epochs
#    themselves.)  wal_writer_delay = 10s keeps the WAL writer from
#    flushing on its own.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

# ---- the node ----

my $node = PostgreSQL::Test::Cluster->new('crash_unlogged');
$node->init;
$node->append_conf('postgresql.conf', "wal_writer_delay = '10s'\nautovacuum = off\n");
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
# This test is about the unlogged tables: what a crash forgets and that
# tokens stay fenced when nothing was logged.  A new installation starts in
# mode 'completed', where a completed record is in the logged idem_result
# and survives the crash; mode 'none' keeps every record unlogged.
$node->safe_psql('postgres', q{SELECT idem_set_durability('none')});

my $fp = q{idem_fingerprint('req')};

# "status|token" of a claim
sub begin_claim
{
	my ($op, $key, $extra) = @_;
	$extra = defined $extra ? ", $extra" : '';
	return $node->safe_psql('postgres', qq{
		SELECT status || '|' || coalesce(token::text, response::text)
		  FROM idem_begin('$op', '$key', $fp$extra) b});
}

sub token_of
{
	my ($claim) = @_;
	my ($token) = $claim =~ /^new\|(\d+)$/;
	return $token // -1;
}

# ========== 1. records are gone, the extension works ==========

my $t_done = token_of(begin_claim('op', 'k-done'));
$node->safe_psql('postgres', qq{SELECT idem_finish('op', 'k-done', $t_done, '{"n": 1}')});
my $t_pending = token_of(begin_claim('op', 'k-pending', q{lease => '1h'}));
# an in-transaction claim open at the crash
my $open = $node->background_psql('postgres', on_error_stop => 0);
my ($out) = run_sql($open, qq{BEGIN; SELECT token FROM idem_begin('op', 'k-open', $fp) b;});
my $t_open = $out;
like($t_open, qr/^\d+$/, 'k-open claimed in a transaction left open');
is( $node->safe_psql('postgres', q{
		SELECT string_agg(key || ':' || CASE WHEN completed_at IS NULL THEN 'pending' ELSE 'completed' END, ',' ORDER BY key)
		  FROM idem_record}),
	'k-done:completed,k-pending:pending',
	'before the crash: k-done completed, k-pending pending (k-open is uncommitted)');
my $max_before = $node->safe_psql('postgres', 'SELECT last_value FROM idem_token_seq');
cmp_ok($max_before, '>=', $t_open, "tokens issued before the crash go up to $max_before");

$node->stop('immediate');
$open->quit;
$node->start;

is($node->safe_psql('postgres', 'SELECT count(*) FROM idem_record'), '0',
	'after the crash the unlogged record table is empty (documented)');
is($node->safe_psql('postgres',
		q{SELECT relpersistence FROM pg_class WHERE relname = 'idem_record'}),
	'u', 'the record table is still unlogged');

my $t0 = time;
my $claim = begin_claim('op', 'k-pending', q{in_flight => 'raise'});
like($claim, qr/^new\|/, 'k-pending, pending at the crash, is free: new (raise mode, no IK409)');
cmp_ok(time - $t0, '<', 5, 'without waiting for its 1h lease');
my $t_pending2 = token_of($claim);
cmp_ok($t_pending2, '>', $max_before, 'its new token is greater than every token before the crash');
my ($ret, $stdout, $stderr) = $node->psql('postgres',
	qq{\\set VERBOSITY verbose\nSELECT idem_finish('op', 'k-pending', $t_pending, '{"late": true}')});
like($stderr, qr/ERROR:  IK412/, 'the pre-crash token of k-pending cannot finish it: IK412');
$node->safe_psql('postgres', qq{SELECT idem_finish('op', 'k-pending', $t_pending2, '{"n": 2}')});
is(begin_claim('op', 'k-pending'), 'replay|{"n": 2}', 'k-pending replays its post-crash result');

$claim = begin_claim('op', 'k-done');
like($claim, qr/^new\|/, 'k-done, completed before the crash, runs again: new (documented loss)');
my $t_done2 = token_of($claim);
cmp_ok($t_done2, '>', $max_before, 'its new token is greater than every token before the crash');
$node->safe_psql('postgres', qq{SELECT idem_finish('op', 'k-done', $t_done2, '{"n": 3}')});
is(begin_claim('op', 'k-done'), 'replay|{"n": 3}', 'k-done replays its post-crash result');

$claim = begin_claim('op', 'k-open');
like($claim, qr/^new\|/, 'k-open, uncommitted at the crash: new');
cmp_ok(token_of($claim), '>', $max_before, 'its new token is greater than every token before the crash');
is($node->safe_psql('postgres', q{SELECT idem_abort('op', 'k-open', } . token_of($claim) . ')'),
	't', 'and it can be aborted');
is($node->safe_psql('postgres', 'SELECT idem_purge()'), '0', 'idem_purge works (nothing expired)');
is( $node->safe_psql('postgres', q{
		SELECT string_agg(key || ':' || CASE WHEN completed_at IS NULL THEN 'pending' ELSE 'completed' END, ',' ORDER BY key)
		  FROM idem_record}),
	'k-done:completed,k-pending:completed', 'records after the crash are the post-crash ones');

# ========== 2. tokens never go back across a crash ==========

# A claim that rolls back, then a worker's claim whose transaction wrote
# only the unlogged table: its commit is not flushed.
$node->safe_psql('postgres', 'CHECKPOINT');
my $t_rolled_back = $node->safe_psql('postgres', qq{
	BEGIN;
	SELECT token FROM idem_begin('op', 'k-rolled-back', $fp) b;
	ROLLBACK;});
like($t_rolled_back, qr/^\d+$/, "a claim that rolled back got token $t_rolled_back");
my $t_ext = token_of(begin_claim('op', 'k-ext', q{lease => '1h'}));
cmp_ok($t_ext, '>', $t_rolled_back, "a worker committed its claim of k-ext with token $t_ext");
$max_before = $node->safe_psql('postgres', 'SELECT last_value FROM idem_token_seq');

# the worker calls its provider; meanwhile the server crashes
$node->stop('immediate');
$node->start;

# the clients retry in the order they had asked
$claim = begin_claim('op', 'k-rolled-back');
like($claim, qr/^new\|/, 'retry of k-rolled-back after the crash: new');
cmp_ok(token_of($claim), '>', $max_before,
	'its token is greater than every token issued before the crash');
$claim = begin_claim('op', 'k-ext', q{lease => '1h'});
like($claim, qr/^new\|/, 'retry of k-ext after the crash: new');
my $t_ext2 = token_of($claim);
cmp_ok($t_ext2, '>', $t_ext,
	'its token is greater than the pre-crash worker\'s token of k-ext');

# the pre-crash worker comes back from its provider call
($ret, $stdout, $stderr) = $node->psql('postgres',
	qq{\\set VERBOSITY verbose\nSELECT idem_finish('op', 'k-ext', $t_ext, '{"by": "pre-crash worker"}')});
like($stderr, qr/ERROR:  IK412/,
	'the pre-crash worker cannot finish the new owner\'s claim of k-ext: IK412');
($ret, $stdout, $stderr) = $node->psql('postgres',
	qq{\\set VERBOSITY verbose\nSELECT idem_finish('op', 'k-ext', $t_ext2, '{"by": "new owner"}')});
is($stderr, '', 'the new owner finishes k-ext');
is(begin_claim('op', 'k-ext'), 'replay|{"by": "new owner"}', 'k-ext replays the new owner\'s result');

$node->stop;
done_testing();
