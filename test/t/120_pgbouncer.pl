
# Copyright (c) 2024, idempotency authors
#
# Behind a connection pooler: Debian's pgbouncer in transaction pooling
# mode, two server connections in the pool.  A client's consecutive
# transactions may run on different server connections, so nothing of a
# claim may live in one server session (a session-level lock, say).
#
#  1. A committed claim (external-call shape) begun on one server connection
#     is finished -- or aborted -- on another (proved with pg_backend_pid()
#     of both transactions); another pgbouncer client then replays it.
#     While the claim is pending no idempotency lock is held anywhere.
#  2. A duplicate sent through pgbouncer that waits on a committed claim is
#     woken promptly -- well before the lease -- by idem_finish (replay) or
#     idem_abort (new) sent by another pgbouncer client, which necessarily
#     runs on the other server connection.
#  3. A waiting duplicate cancelled by statement_timeout leaves nothing
#     behind on its pooled server connection.
#  4. A short pgbench load through pgbouncer (8 clients on 2 server
#     connections) of claim-commit / effect+finish transactions: no error,
#     every completed record has its effect row, no key has two.
#
# Needs the pgbouncer binary (Debian package "pgbouncer"); skipped without it.

use strict;
use warnings;

use IPC::Run;
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

# ---- the server ----

my $node = PostgreSQL::Test::Cluster->new('server');
$node->init;
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE ROLE app LOGIN;
	CREATE TABLE effect (key text NOT NULL, token bigint NOT NULL);
	GRANT SELECT, INSERT ON effect TO app;
});

# ---- pgbouncer ----

# two server connections in the pool
my $pgb = start_pgbouncer($node, pool_size => 2);
my $bouncer = $pgb->{node};
ok(-S $pgb->{socket}, "pgbouncer listens on $pgb->{socket}") or diag($pgb->{output});

sub bsession
{
	return $bouncer->background_psql('postgres', on_error_stop => 0,
		extra_params => [ '-U', 'app' ]);
}

my $s1 = bsession();
my $s2 = bsession();
my $s3 = bsession();
my $s4 = bsession();
my ($out, $state) = run_sql($s1, 'SELECT current_user, pg_backend_pid();');
like($out, qr/^app\|\d+$/, 'a client connects through pgbouncer as app');

# Fill the pool: two clients each inside a transaction need two server
# connections.  Returns their server pids in client order.
sub hold_both
{
	my ($x, $y) = @_;
	my ($px) = run_sql($x, 'BEGIN; SELECT pg_backend_pid();');
	my ($py) = run_sql($y, 'BEGIN; SELECT pg_backend_pid();');
	return ($px, $py);
}

{
	my ($pa, $pb) = hold_both($s3, $s4);
	isnt($pa, $pb, "the pool has two server connections ($pa, $pb)");
	run_sql($s3, 'COMMIT;');
	run_sql($s4, 'COMMIT;');
}

sub idem_locks
{
	return $node->safe_psql('postgres', q{
		SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid IN (18763, 18764)});
}

# Run $sql (which must return pg_backend_pid() first) through $client on
# the server connection other than $avoid_pid: $h1 and $h2 grab both
# server connections, the one holding $avoid_pid keeps it.
sub on_other_connection
{
	my ($client, $sql, $avoid_pid) = @_;
	my ($pa, $pb) = hold_both($s3, $s4);
	my ($keep, $free) = $pa eq $avoid_pid ? ($s3, $s4) : ($s4, $s3);
	die "neither held connection is $avoid_pid ($pa, $pb)"
	  unless $pa eq $avoid_pid || $pb eq $avoid_pid;
	run_sql($free, 'COMMIT;');
	my @r = run_sql($client, $sql);
	run_sql($keep, 'COMMIT;');
	return @r;
}

# ---- 1. begin on one server connection, finish / abort on another ----

for my $action ('finish', 'abort')
{
	my $key = "k-$action";
	($out, $state) = run_sql($s1, qq{
		SELECT pg_backend_pid() || '|' || status || '|' || token
		  FROM idem_begin('pay', '$key', '\\x01', lease => '10 min');});
	my ($pid_begin, $status, $token) = split /\|/, $out;
	is($status, 'new', "$action: idem_begin through pgbouncer: new");
	is(idem_locks(), '0', "$action: the pending claim holds no lock on its server connection");

	my $call = $action eq 'finish'
	  ? qq{idem_finish('pay', '$key', $token, '{"charge": "ch_$action"}')::text}
	  : qq{idem_abort('pay', '$key', $token)::text};
	($out, $state) = on_other_connection($s1, "SELECT pg_backend_pid() || '|' || $call;", $pid_begin);
	my ($pid_end, $result) = split /\|/, $out, 2;
	is($state, '00000', "$action: idem_$action through pgbouncer succeeds");
	isnt($pid_end, $pid_begin,
		"$action: ... on another server connection than idem_begin ($pid_begin, then $pid_end)");
	is($result, $action eq 'finish' ? '' : 'true', "$action: ... and returns what it should");

	($out, $state) = run_sql($s2, qq{
		SELECT status || '|' || coalesce(response::text, '')
		  FROM idem_begin('pay', '$key', '\\x01', 'raise');});
	is($out, $action eq 'finish' ? qq{replay|{"charge": "ch_$action"}} : 'new|',
		$action eq 'finish'
		? 'finish: another pgbouncer client replays the response'
		: 'abort: another pgbouncer client gets the key anew');
}

# ---- 2. a waiting duplicate is woken through another client ----

sub waiting_app_backends
{
	return $node->safe_psql('postgres', q{
		SELECT string_agg(pid::text, ',') FROM pg_stat_activity
		 WHERE usename = 'app' AND wait_event_type = 'Extension'});
}

for my $action ('finish', 'abort')
{
	my $key = "w-$action";
	($out, $state) = run_sql($s1, qq{
		SELECT token FROM idem_begin('pay', '$key', '\\x02', lease => '10 min');});
	my $token = $out;
	like($token, qr/^\d+$/, "wake on $action: a committed claim through pgbouncer");

	send_sql($s2, qq{
		SELECT pg_backend_pid() || '|' || status || '|' || coalesce(response::text, '')
		  FROM idem_begin('pay', '$key', '\\x02', 'wait');});
	ok($node->poll_query_until('postgres', q{
		SELECT count(*) = 1 FROM pg_stat_activity
		 WHERE usename = 'app' AND wait_event_type = 'Extension'}),
		"wake on $action: a duplicate through pgbouncer sleeps on the claim");
	my $waiter = waiting_app_backends();
	ok(!sql_done($s2), "wake on $action: ... and is still waiting");

	my $call = $action eq 'finish'
	  ? qq{idem_finish('pay', '$key', $token, '{"charge": "ch_w"}')::text}
	  : qq{idem_abort('pay', '$key', $token)::text};
	my $t0 = time;
	($out, $state) = run_sql($s1, "SELECT pg_backend_pid() || '|' || $call;");
	my ($pid_end) = split /\|/, $out;
	is($state, '00000', "wake on $action: idem_$action through another pgbouncer client");
	isnt($pid_end, $waiter, "wake on $action: ... runs on the other server connection ($pid_end; waiter $waiter)");

	my ($dup_out, $dup_state) = wait_sql($s2);
	my $elapsed = time - $t0;
	my ($pid_dup, $rest) = split /\|/, $dup_out // '', 2;
	is($rest, $action eq 'finish' ? qq{replay|{"charge": "ch_w"}} : 'new|',
		"wake on $action: the duplicate " . ($action eq 'finish' ? 'replays' : 'gets the key'));
	cmp_ok($elapsed, '<', 300,
		sprintf('wake on %s: ... woken, not at the lease end (%.2f s; lease 10 min)', $action, $elapsed));
	if ($action eq 'abort')
	{
		# the duplicate now holds a committed claim: finish it
		my ($tok2) = $node->safe_psql('postgres', qq{
			SELECT token FROM idem_record WHERE key = '$key'});
		($out, $state) = run_sql($s3, qq{SELECT idem_finish('pay', '$key', $tok2, '{"second": true}');});
		is($state, '00000', 'wake on abort: the woken duplicate\'s claim is finished from a third client');
	}
}

# ---- 3. a cancelled wait leaves nothing on its pooled connection ----

{
	($out, $state) = run_sql($s1, q{
		SELECT token FROM idem_begin('pay', 'cancel', '\x03', lease => '10 min');});
	my $token = $out;
	my $t0 = time;
	($out, $state) = run_sql($s2, q{
		BEGIN;
		SET LOCAL statement_timeout = '300ms';
		SELECT status FROM idem_begin('pay', 'cancel', '\x03', 'wait');});
	is($state, '57014', 'a waiting duplicate gives up at statement_timeout (57014)');
	run_sql($s2, 'ROLLBACK;');
	cmp_ok(time - $t0, '<', 300, '... not at the lease end (10 min)');
	is(idem_locks(), '0', 'no idempotency lock is left on any server connection');
	is($node->safe_psql('postgres', q{
		SELECT token || '|' || (completed_at IS NULL) FROM idem_record WHERE key = 'cancel'}),
		"$token|true", 'the claim is untouched: still pending, same token');
	($out, $state) = run_sql($s2, qq{SELECT idem_finish('pay', 'cancel', $token, '{"ok": 1}');});
	is($state, '00000', 'and its owner can still finish it');
}

# ---- 4. a load through pgbouncer ----

# Keys are drawn from a large space: a duplicate that waits holds its
# server connection while it sleeps, so with a pool of 2 two waiters could
# starve the finish they wait for until the lease ends (a limitation of
# 'wait' behind any pooler; sections 1-3 test the waiting itself).

my $script = $bouncer->basedir . '/ext.sql';
append_to_file($script, q{
\set k random(1, 1000000)
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS tok
  FROM idem_begin('load', 'L' || :k, idem_fingerprint(:k), lease => '30 s') \gset
\if :is_new
BEGIN;
INSERT INTO effect VALUES ('L' || :k, :tok);
SELECT idem_finish('load', 'L' || :k, :tok, jsonb_build_object('token', :tok));
COMMIT;
\endif
});
my ($p_out, $p_err) = ('', '');
my $rc = IPC::Run::run(
	[ 'pgbench', '-n', '-c', '8', '-j', '2', '-T', '3', '-f', $script,
		'-h', $bouncer->host, '-p', $bouncer->port, '-U', 'app', 'postgres' ],
	'>', \$p_out, '2>', \$p_err);
ok($rc, 'pgbench through pgbouncer: 8 clients on 2 server connections, no error')
  or diag($p_err);
my ($tps) = $p_out =~ /tps = ([\d.]+)/;
note("load through pgbouncer: " . ($tps // '?') . ' tps');
# in the default durability mode 'completed' a finish moves the record to
# idem_result: read both tables
is($node->safe_psql('postgres', qq{
	SELECT count(*) FROM $IDEM_RECORDS r
	 WHERE r.operation = 'load' AND r.completed_at IS NOT NULL
	   AND NOT EXISTS (SELECT 1 FROM effect e WHERE e.key = r.key AND e.token = r.token
	                   AND r.response = jsonb_build_object('token', e.token))}),
	'0', 'load: every completed record has its effect row');
is($node->safe_psql('postgres', q{
	SELECT count(*) FROM (SELECT key FROM effect GROUP BY key HAVING count(*) > 1) d}),
	'0', 'load: no key has two effect rows');
cmp_ok($node->safe_psql('postgres', qq{
	SELECT count(*) FROM $IDEM_RECORDS r WHERE operation = 'load' AND completed_at IS NOT NULL}),
	'>', 0, 'load: keys were completed');
is(idem_locks(), '0', 'load: no idempotency lock is left');

$_->quit for ($s1, $s2, $s3, $s4);
stop_pgbouncer($pgb);
my $log = slurp_file($node->logfile);
unlike($log, qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');
$node->stop;
done_testing();
