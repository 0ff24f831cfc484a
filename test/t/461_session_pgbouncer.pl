
# Copyright (c) 2024, idempotency authors
#
# test/run: serial
#
# takeover => 'session' (1.4) behind pgbouncer in transaction pooling mode.
# The "session" of a claim is the server connection that made it, and
# pgbouncer keeps that connection in its pool when the client goes away,
# so there a 'session' claim behaves like a 'lease' claim:
#
#  1. A client claims a key through pgbouncer with takeover 'session' and
#     a 10 min lease, then disconnects from pgbouncer.  Its server
#     connection stays in the pool (SHOW SERVERS), still holding the session
#     lock (class 0x494D), so the claim is NOT taken over: a duplicate in
#     raise mode, directly or through pgbouncer, gets IK409; a duplicate
#     waiting through pgbouncer sleeps until the lease lapses (idem_renew
#     shortens it to 1 s once the duplicate sleeps), and then takes the key
#     over ('new', a greater token); the old token gets IK412.
#  2. Contrast: when pgbouncer closes the pooled server connection
#     (console RECONNECT), that session ends and a waiting duplicate takes
#     a 'session' claim made through it over at once, long before its
#     10 min lease.
#
# No verdict reads the wall clock against a guess of how fast the machine
# is: every lease outlasts the steps that need it live, and the times the
# test compares are the server's (lease ends, when a call returned).
#
# Needs the pgbouncer binary (Debian package "pgbouncer"); skipped without it.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :pgbouncer);

if (!pgbouncer_binary())
{
	plan skip_all => 'pgbouncer is not installed (Debian: apt-get install pgbouncer); '
	  . 'set PGBOUNCER=/path/to/pgbouncer to use another one';
}

my $SESSION_LOCK = 18765;           # 0x494D
my $SESSION_WAITER_LOCK = 18766;    # 0x494E

my $node = PostgreSQL::Test::Cluster->new('server');
$node->init;
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE ROLE app LOGIN;
});

my $pgb = start_pgbouncer($node, pool_size => 2);
my $bouncer = $pgb->{node};
ok(-S $pgb->{socket}, "pgbouncer listens on $pgb->{socket}") or diag($pgb->{output});

sub bsession
{
	return $bouncer->background_psql('postgres', on_error_stop => 0,
		extra_params => [ '-U', 'app' ]);
}

# pgbouncer's console: the rows of "SHOW $what", as hashes by column name
sub console
{
	my ($what) = @_;
	my $out = $bouncer->safe_psql('pgbouncer', "SHOW $what",
		extra_params => [ '-U', 'postgres', '--no-align', '--field-separator=|', '--pset=tuples_only=off' ]);
	my ($head, @lines) = split /\n/, $out;
	my @cols = split /\|/, $head;
	my @rows;
	for my $line (@lines)
	{
		next if $line =~ /^\(\d+ rows?\)$/;
		my %r;
		@r{@cols} = split /\|/, $line, -1;
		push @rows, \%r;
	}
	return @rows;
}

# Wait until pgbouncer has no client of user app left (the console's own
# connection is user postgres's)
sub app_clients_gone
{
	my $deadline = time + $PostgreSQL::Test::Utils::timeout_default;
	while (time < $deadline)
	{
		return 1 unless grep { $_->{user} eq 'app' } console('CLIENTS');
		sleep 0.05;
	}
	return 0;
}

sub session_locks_of
{
	my ($pid, $class) = @_;
	return $node->safe_psql('postgres', qq{
		SELECT count(*) FROM pg_locks
		 WHERE pid = $pid AND locktype = 'advisory' AND objsubid = $class AND granted});
}

# ========== 1. the client disconnects: the server connection lives on ==========

my $client = bsession();
my ($out, $state) = run_sql($client, q{
	SELECT pg_backend_pid() || '|' || status || '|' || token
	  FROM idem_begin('pb', 'k1', '\x01', lease => '10 min', takeover => 'session') b;});
my ($server_pid, $status, $token) = split /\|/, $out // '';
is("$state|$status", '00000|new', 'a claim through pgbouncer with takeover session: new');
my $first_lease_end = $node->safe_psql('postgres', q{
	SELECT extract(epoch FROM expires_at) FROM idem_record WHERE key = 'k1'});
is(session_locks_of($server_pid, $SESSION_LOCK), '1',
	"the server connection that made it ($server_pid) holds the session lock");

$client->quit;
ok(app_clients_gone(), 'the client disconnected from pgbouncer');
my @servers = console('SERVERS');
ok((grep { ($_->{remote_pid} // '') eq $server_pid } @servers),
	"pgbouncer keeps that server connection ($server_pid) in its pool")
  or diag(explain(\@servers));
is($node->safe_psql('postgres', qq{SELECT count(*) FROM pg_stat_activity WHERE pid = $server_pid}),
	'1', '... the backend is still there');
is(session_locks_of($server_pid, $SESSION_LOCK), '1', '... still holding the session lock');

# as app: keys are per role
my $direct = $node->background_psql('postgres', on_error_stop => 0,
	extra_params => [ '-U', 'app' ]);
($out, $state) = run_sql($direct, q{SELECT status FROM idem_begin('pb', 'k1', '\x01', 'raise') b;});
is($state, 'IK409', 'a direct duplicate in raise mode gets IK409: the claim is not taken over');

my $dup = bsession();
($out, $state) = run_sql($dup, q{SELECT status FROM idem_begin('pb', 'k1', '\x01', 'raise') b;});
is($state, 'IK409', 'a duplicate in raise mode through pgbouncer gets IK409');

# a duplicate waiting through pgbouncer: answered when the lease lapses
send_sql($dup, q{
	SELECT b.status || '|' || coalesce(b.token::text, '') || '|' ||
	       extract(epoch FROM statement_timestamp()) || '|' || extract(epoch FROM clock_timestamp())
	  FROM idem_begin('pb', 'k1', '\x01', 'wait') b;});
ok( $node->poll_query_until('postgres', qq{
		SELECT count(*) = 1 FROM pg_stat_activity
		 WHERE usename = 'app' AND wait_event_type = 'Extension'
		   AND wait_event = '@{[ idem_wait_event($node, 'IdempotencyClaim') ]}'}),
	'a duplicate waiting through pgbouncer sleeps on the claim');
ok(!sql_done($dup), '... and has not been answered');
# the lease now ends in 1 s (a renew wakes the sleepers, who sleep again
# until the new end)
($out, $state) = run_sql($direct,
	qq{SELECT extract(epoch FROM idem_renew('pb', 'k1', $token, '1 s'));});
is($state, '00000', 'the claim\'s token shortens its lease to 1 s');
my $lease_end = $out;
($out, $state) = wait_sql($dup);
my ($dstatus, $dtoken, $started, $returned) = split /\|/, $out // '';
is("$state|$dstatus", '00000|new', 'the waiting duplicate takes the key over: new');
cmp_ok($dtoken, '>', $token, '... with a greater token');
cmp_ok($started, '<', $lease_end, '... it started waiting during the lease');
cmp_ok($returned, '>=', $lease_end,
	sprintf('it was answered only when the lease lapsed (%.3f s after its start, %.3f s after the lease end)',
		$returned - $started, $returned - $lease_end));
cmp_ok($returned, '<', $first_lease_end, '... the shortened lease, not the first one');
($out, $state) = run_sql($dup, qq{SELECT idem_finish('pb', 'k1', $token, '{"by": "old token"}');});
is($state, 'IK412', 'the old token gets IK412');
($out, $state) = run_sql($dup, qq{SELECT idem_finish('pb', 'k1', $dtoken, '{"by": "new owner"}');});
is($state, '00000', 'the new owner finishes k1');
$dup->quit;

# ========== 2. pgbouncer closes the server connection: taken over at once ==========

$client = bsession();
($out, $state) = run_sql($client, q{
	SELECT pg_backend_pid() || '|' || status || '|' || token
	  FROM idem_begin('pb', 'k2', '\x01', lease => '10 min', takeover => 'session') b;});
($server_pid, $status, $token) = split /\|/, $out // '';
is("$state|$status", '00000|new', 'closed: a claim through pgbouncer with takeover session and a 10 min lease');
$lease_end = $node->safe_psql('postgres', q{
	SELECT extract(epoch FROM expires_at) FROM idem_record WHERE key = 'k2'});
$client->quit;
ok(app_clients_gone(), 'closed: the client disconnected from pgbouncer');

my $waiter = $direct;
my ($waiter_pid) = run_sql($waiter, 'SELECT pg_backend_pid();');
send_sql($waiter, q{
	SELECT b.status || '|' || coalesce(b.token::text, '') || '|' || extract(epoch FROM clock_timestamp())
	  FROM idem_begin('pb', 'k2', '\x01', 'wait') b;});
ok( $node->poll_query_until('postgres', qq{
		SELECT wait_event = '@{[ idem_wait_event($node, 'IdempotencyClaim') ]}'
		   AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory'
		                  AND l.objsubid = $SESSION_WAITER_LOCK AND l.granted)
		  FROM pg_stat_activity a WHERE pid = $waiter_pid}),
	'closed: a direct duplicate waits on the pooled session')
  or diag(sql_done($waiter) ? "it answered: $waiter->{stdout} $waiter->{stderr}" : 'it has not answered');
ok(!sql_done($waiter), 'closed: ... while the server connection is in the pool');

$bouncer->safe_psql('pgbouncer', 'RECONNECT', extra_params => [ '-U', 'postgres' ]);
($out, $state) = wait_sql($waiter);
my ($wstatus, $wtoken, $t1) = split /\|/, $out // '';
is("$state|$wstatus", '00000|new',
	'closed: after pgbouncer closed the server connection (RECONNECT), the duplicate takes the key over');
cmp_ok($wtoken, '>', $token, 'closed: ... with a greater token');
cmp_ok($t1, '<', $lease_end, 'closed: ... during the 10 min lease, not after it');
is($node->safe_psql('postgres', qq{SELECT count(*) FROM pg_stat_activity WHERE pid = $server_pid}),
	'0', "closed: the server connection $server_pid is gone");
$waiter->quit;

$client = bsession();
($out, $state) = run_sql($client, 'SELECT 1;');
is("$state|$out", '00000|1', 'pgbouncer still serves its clients');
$client->quit;

stop_pgbouncer($pgb);
unlike(slurp_file($node->logfile), qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');
$node->stop;
done_testing();
