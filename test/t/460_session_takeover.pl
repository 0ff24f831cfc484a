
# Copyright (c) 2024, idempotency authors
#
# test/run: serial
#
# takeover => 'session' (1.4): a committed pending claim also lapses as soon
# as the backend that made it exits, and a duplicate already waiting on it
# is woken at once -- its 60 s lease is not what wakes it.
#
#  1. Three ways the claimant's session ends, 20 trials each: the backend
#     is terminated (pg_terminate_backend), the client quits (psql \q), the
#     client process is killed (SIGKILL of psql: the backend reads EOF).
#     Each time the waiting duplicate returns 'new' with a greater token,
#     or, where the claimant had recorded a checkpoint (every other trial),
#     'recover' with a greater token and the checkpoint's state; the old
#     token's idem_finish then gets IK412.  The latency from the exit to
#     the waiter's answer (the waiter's clock_timestamp() minus the time
#     just before the exit was caused) must have p95 <= 50 ms.
#  2. A waiter sleeping on a live session's claim uses no CPU: utime+stime
#     of its backend (/proc/<pid>/stat) barely move over a second.
#  3. takeover 'lease' (explicit, and the default): the session's end does
#     not lapse the claim -- a duplicate in raise mode still gets IK409, a
#     waiting one is not woken into a takeover, and the old token can still
#     finish (the waiter then replays).
#  4. The setting idempotency.takeover = 'session' works like the argument;
#     an explicit takeover => 'lease' overrides it.
#  5. 100,000 'session' claims in one transaction commit with the default
#     max_locks_per_transaction: the session holds one pair of locks for them all.
#     They are all taken over once the session ends.
#  6. A claim in a PREPARED transaction whose session then disconnects is
#     waited for as any uncommitted claim (raise: IK409; wait: on the
#     transaction lock), never taken over while prepared; after COMMIT
#     PREPARED the claim is committed and its session is gone, so the
#     waiting duplicate takes it over at once.  While the session that
#     prepared it is still connected, COMMIT PREPARED leaves the claim
#     held (IK409) until that session exits.  After ROLLBACK PREPARED the
#     claim never existed: the waiter gets 'new'.

use strict;
use warnings;

use POSIX qw(ceil);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('session');
$node->init;
$node->append_conf('postgresql.conf', "max_prepared_transactions = 5\n");
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# lock classes (pg_locks.objsubid): a session holding 'session' claims,
# and the waiters on such a session
my $SESSION_LOCK = 18765;           # 0x494D
my $SESSION_WAITER_LOCK = 18766;    # 0x494E
my $SESSION_ANCHOR_LOCK = 18767;    # 0x494F: the session's second lock

# One session for looking and acting from outside, one for the waiter.
my $admin = $node->background_psql('postgres', on_error_stop => 0);
my $waiter = $node->background_psql('postgres', on_error_stop => 0);
my ($waiter_pid) = run_sql($waiter, 'SELECT pg_backend_pid();');
# the wait event of a duplicate asleep on a claim
my $claim_event = idem_wait_event($node, 'IdempotencyClaim');

# Run $sql in the admin session until it returns 't' (5 ms apart), or
# timeout_default: true if it did.
sub poll_admin
{
	my ($sql) = @_;
	my $deadline = time + $PostgreSQL::Test::Utils::timeout_default;
	while (time < $deadline)
	{
		my ($out) = run_sql($admin, $sql);
		return 1 if defined $out && $out eq 't';
		sleep 0.005;
	}
	return 0;
}

sub backend_gone
{
	my ($pid) = @_;
	return poll_admin("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $pid;");
}

# A new claimant session: (session, backend pid)
sub claimant
{
	my $s = $node->background_psql('postgres', on_error_stop => 0);
	my ($pid) = run_sql($s, 'SELECT pg_backend_pid();');
	return ($s, $pid);
}

# The claimant's committed claim of $key (op 'sess'; lease 60 s; $takeover
# unless undef: the setting's); returns the token, dies otherwise.
sub claim
{
	my ($s, $key, $takeover) = @_;
	my $arg = defined $takeover ? ", takeover => '$takeover'" : '';
	my ($out, $state, $err) = run_sql($s, qq{
		SELECT status || '|' || token
		  FROM idem_begin('sess', '$key', '\\x01', lease => '60 s'$arg) b;});
	my ($token) = ($out // '') =~ /^new\|(\d+)$/
	  or die "claim of $key: $state $err " . ($out // '');
	return $token;
}

# The waiter starts a duplicate of $key in wait mode; its answer is
# "status|token|response|epoch of clock_timestamp() at the answer".
sub start_waiter
{
	my ($key) = @_;
	send_sql($waiter, qq{
		SELECT b.status || '|' || coalesce(b.token::text, '') || '|' ||
		       coalesce(b.response::text, '') || '|' || extract(epoch FROM clock_timestamp())
		  FROM idem_begin('sess', '$key', '\\x01', 'wait') b;});
	return;
}

# Is the waiter asleep on a committed claim (wait event $claim_event), and
# registered as a waiter on the claimant's session (share lock, class
# 0x494E)?  $session_waiter: whether it should hold that lock.
sub waiter_sleeps
{
	my ($session_waiter) = @_;
	my $cmp = $session_waiter ? '= 1' : '= 0';
	return poll_admin(qq{
		SELECT a.wait_event_type = 'Extension' AND a.wait_event = '$claim_event'
		   AND (SELECT count(*) FROM pg_locks l
		         WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.objsubid = $SESSION_WAITER_LOCK
		           AND l.mode = 'AccessShareLock' AND l.granted) $cmp
		  FROM pg_stat_activity a WHERE a.pid = $waiter_pid;});
}

# The waiter's answer: (status, token, response, epoch, sqlstate)
sub waiter_answer
{
	my ($out, $state) = wait_sql($waiter);
	my @f = split /\|/, $out // '', 4;
	return (@f, $state);
}

# idem_finish of $key with $token, from the admin session: its SQLSTATE
sub finish_state
{
	my ($key, $token) = @_;
	my (undef, $state) = run_sql($admin,
		qq{SELECT idem_finish('sess', '$key', $token, '{"by": "old token"}');});
	return $state;
}

# How many idempotency locks of class $class backend $pid holds
sub locks_of
{
	my ($pid, $class) = @_;
	my ($n) = run_sql($admin, qq{
		SELECT count(*) FROM pg_locks
		 WHERE pid = $pid AND locktype = 'advisory' AND objsubid = $class AND granted;});
	return $n;
}

# ---- the ways a claimant's session ends; each returns the epoch just
# before the exit was caused ----

my %end_session = (
	terminate => sub {
		my ($s, $pid) = @_;
		# the time is the server's, taken just before the signal
		my ($out) = run_sql($admin,
			"SELECT extract(epoch FROM clock_timestamp()) || '|' || pg_terminate_backend($pid);");
		my ($t0, $ok) = split /\|/, $out;
		die "pg_terminate_backend($pid): $out" unless $ok eq 'true';
		$s->quit;
		return $t0;
	},
	quit => sub {
		my ($s, $pid) = @_;
		my $t0 = time;
		$s->quit;
		return $t0;
	},
	kill => sub {
		my ($s, $pid) = @_;
		my $client = $s->{run}{KIDS}[0]{PID};
		my $t0 = time;
		kill 'KILL', $client or die "could not kill psql $client: $!";
		eval { $s->{run}->finish; };
		return $t0;
	});

# ========== 1. the claimant's session ends: the waiter takes over ==========

my $TRIALS = 20;
for my $how ('terminate', 'quit', 'kill')
{
	my (@latency, @got, @want);
	for my $i (1 .. $TRIALS)
	{
		my $key = "$how-$i";
		my $with_checkpoint = $i % 2 == 0;
		my ($s, $pid) = claimant();
		my $token = claim($s, $key, 'session');
		if ($with_checkpoint)
		{
			my (undef, $state, $err) = run_sql($s,
				qq{SELECT idem_checkpoint('sess', '$key', $token, '{"step": $i}');});
			die "checkpoint of $key: $state $err" unless $state eq '00000';
		}
		start_waiter($key);
		my $sleeps = waiter_sleeps(1);
		if ($i <= 2)
		{
			is(locks_of($pid, $SESSION_LOCK), '1',
				"$how, trial $i: the claimant's session holds its session lock (class 0x494D)");
			ok($sleeps, "$how, trial $i: the duplicate sleeps on the claim, registered as a waiter on the session (class 0x494E)");
			ok(!sql_done($waiter), "$how, trial $i: ... and has not answered while the claimant lives");
		}

		my $t0 = $end_session{$how}->($s, $pid);
		my ($status, $new_token, $response, $t1, $state) = waiter_answer();
		push @latency, ($t1 // $t0) - $t0;

		my $finish = finish_state($key, $token);
		push @want, sprintf('%s: %s, greater token, %s, old token IK412',
			$key, $with_checkpoint ? 'recover' : 'new',
			$with_checkpoint ? qq{{"step": $i}} : 'no response');
		push @got, sprintf('%s: %s, %s token, %s, old token %s',
			$key, $state eq '00000' ? $status : "ERROR $state",
			(($new_token // '') =~ /^\d+$/ && $new_token > $token) ? 'greater' : "not greater ($new_token vs $token)",
			$response eq '' ? 'no response' : $response, $finish);
		die "$key: no waiter answer" unless $state eq '00000';
		backend_gone($pid) or die "backend $pid of $key did not go away";
	}
	is(join("\n", @got), join("\n", @want),
		"$how: in all $TRIALS trials the waiter took the key over with a greater token ('recover' with the state after a checkpoint), and the old token got IK412");

	my @sorted = sort { $a <=> $b } @latency;
	my $p95 = $sorted[ ceil(0.95 * @sorted) - 1 ];
	my $summary = sprintf('%s: latency from the exit to the waiter\'s answer over %d trials: '
		  . 'min %.1f ms, median %.1f ms, p95 %.1f ms, max %.1f ms',
		$how, scalar @sorted, 1000 * $sorted[0], 1000 * $sorted[ $#sorted / 2 ],
		1000 * $p95, 1000 * $sorted[-1]);
	diag($summary);
	cmp_ok(1000 * $p95, '<=', 50, "$how: p95 latency <= 50 ms (lease 60 s)")
	  or diag('latencies (ms): ' . join(' ', map { sprintf '%.1f', 1000 * $_ } @latency));
}

# ========== 2. a sleeping waiter uses no CPU ==========

# /proc/<pid>/stat: fields 14 and 15 (utime, stime) in clock ticks, after
# the ")" that ends the command name
sub cpu_ticks
{
	my ($pid) = @_;
	my $stat = slurp_file("/proc/$pid/stat");
	my @f = split ' ', substr($stat, rindex($stat, ')') + 2);
	return $f[11] + $f[12];
}

SKIP:
{
	skip 'no /proc/<pid>/stat on this system', 3 unless -r "/proc/$waiter_pid/stat";
	chomp(my $hz = `getconf CLK_TCK` || 100);
	my ($s, $pid) = claimant();
	my $token = claim($s, 'cpu', 'session');
	start_waiter('cpu');
	ok(waiter_sleeps(1), 'cpu: the duplicate sleeps on a live session\'s claim');
	my ($c0, $t0) = (cpu_ticks($waiter_pid), time);
	# the measurement itself: how much CPU the sleeper uses in a second
	sleep 1.0;
	my ($c1, $t1) = (cpu_ticks($waiter_pid), time);
	my $ms = 1000 * ($c1 - $c0) / $hz;
	diag(sprintf('cpu: the sleeping waiter used %.0f ms of CPU (utime+stime) in %.2f s', $ms, $t1 - $t0));
	cmp_ok($ms, '<=', 20, 'cpu: the sleeping waiter uses (almost) no CPU');
	ok(!sql_done($waiter), 'cpu: ... and is still waiting');
	$end_session{quit}->($s, $pid);
	my ($status) = waiter_answer();
	is($status, 'new', 'cpu: it takes over when the claimant quits');
}

# ========== 3. takeover 'lease': the session's end does not lapse it ==========

for my $variant ('explicit', 'default')
{
	my $key = "lease-$variant";
	my ($s, $pid) = claimant();
	my $token = claim($s, $key, $variant eq 'explicit' ? 'lease' : undef);
	is(locks_of($pid, $SESSION_LOCK), '0',
		"lease ($variant): a 'lease' claim takes no session lock");
	start_waiter($key);
	ok(waiter_sleeps(0), "lease ($variant): the duplicate sleeps, not registered on any session");
	$end_session{terminate}->($s, $pid);
	ok(backend_gone($pid), "lease ($variant): the claimant's backend is gone");
	my ($out, $state) = run_sql($admin, qq{
		SELECT status FROM idem_begin('sess', '$key', '\\x01', 'raise') b;});
	is($state, 'IK409', "lease ($variant): a duplicate in raise mode still gets IK409");
	ok(!sql_done($waiter), "lease ($variant): the waiting duplicate has not taken it over");
	is(finish_state($key, $token), '00000',
		"lease ($variant): the dead claimant's token can still finish it: nobody took it over");
	my ($status, $t, $response) = waiter_answer();
	is("$status|$response", 'replay|{"by": "old token"}',
		"lease ($variant): the waiter, woken by the finish, replays it");
}

# ========== 4. the setting idempotency.takeover ==========

{
	my ($s, $pid) = claimant();
	run_sql($s, q{SET idempotency.takeover = 'session';});
	my ($setting) = run_sql($s, 'SHOW idempotency.takeover;');
	is($setting, 'session', 'setting: idempotency.takeover = session');
	my $token = claim($s, 'setting', undef);
	is(locks_of($pid, $SESSION_LOCK), '1',
		'setting: a claim without the argument takes the session lock');
	my $token2 = claim($s, 'setting-lease', 'lease');
	start_waiter('setting');
	ok(waiter_sleeps(1), 'setting: the duplicate is registered as a waiter on the session');
	$end_session{terminate}->($s, $pid);
	my ($status, $new_token) = waiter_answer();
	is($status, 'new', 'setting: the claim is taken over when the session ends');
	cmp_ok($new_token, '>', $token, 'setting: ... with a greater token');
	is(finish_state('setting', $token), 'IK412', 'setting: the old token gets IK412');
	ok(backend_gone($pid), 'setting: the claimant\'s backend is gone');
	my ($out, $state) = run_sql($admin, q{
		SELECT status FROM idem_begin('sess', 'setting-lease', '\x01', 'raise') b;});
	is($state, 'IK409', 'setting: a claim made with takeover => \'lease\' in that session is not taken over');
	is(finish_state('setting-lease', $token2), '00000', 'setting: ... and its token still finishes it');
}

# ========== 5. 100,000 'session' claims in one transaction ==========

{
	is($node->safe_psql('postgres', 'SHOW max_locks_per_transaction'), '64',
		'bulk: max_locks_per_transaction is the default, 64');
	my ($s, $pid) = claimant();
	run_sql($s, 'BEGIN;');
	my ($out, $state, $err) = run_sql($s, q{
		SELECT count(*) FROM generate_series(1, 100000) g,
		       LATERAL idem_begin('bulk', 'b' || g, '\x01', lease => '60 s', takeover => 'session') b
		 WHERE b.status = 'new';});
	is("$state|$out", '00000|100000', 'bulk: one transaction claims 100,000 keys with takeover session')
	  or diag($err);
	my ($locks) = run_sql($admin, "SELECT count(*) FROM pg_locks WHERE pid = $pid;");
	cmp_ok($locks, '<=', 20, "bulk: its backend holds few locks ($locks) before the commit");
	my ($advisory) = run_sql($admin, qq{
		SELECT string_agg(objsubid::text || ' ' || mode, ', ' ORDER BY objsubid) FROM pg_locks
		 WHERE pid = $pid AND locktype = 'advisory';});
	is($advisory, "$SESSION_LOCK ExclusiveLock, $SESSION_ANCHOR_LOCK ExclusiveLock",
		'bulk: its only advisory locks are the session\'s two locks');
	($out, $state, $err) = run_sql($s, 'COMMIT;');
	is($state, '00000', 'bulk: the transaction commits');
	unlike($err, qr/out of shared memory/, 'bulk: no "out of shared memory"');
	($locks) = run_sql($admin, "SELECT count(*) FROM pg_locks WHERE pid = $pid;");
	cmp_ok($locks, '<=', 3, "bulk: after the commit it holds $locks lock(s)");
	is($node->safe_psql('postgres', q{
		SELECT count(*) FROM idem_record WHERE operation = 'bulk' AND completed_at IS NULL}),
		'100000', 'bulk: 100,000 pending claims');

	($out, $state) = run_sql($admin, q{
		SELECT status FROM idem_begin('bulk', 'b50000', '\x01', 'raise') b;});
	is($state, 'IK409', 'bulk: while the session lives, a duplicate gets IK409');
	$end_session{quit}->($s, $pid);
	ok(backend_gone($pid), 'bulk: the session quit');
	($out, $state) = run_sql($admin, q{
		SELECT count(*) FILTER (WHERE b.status = 'new') FROM generate_series(1, 100000, 999) g,
		       LATERAL idem_begin('bulk', 'b' || g, '\x01', 'raise') b;});
	is("$state|$out", '00000|101', 'bulk: after it quit, every duplicate (101 keys sampled) gets new at once');
	is(locks_of($pid, $SESSION_LOCK), '0', 'bulk: its session lock is gone');
}

# ========== 6. a claim in a PREPARED transaction ==========

# (a) the session disconnects, then COMMIT PREPARED
{
	my ($s, $pid) = claimant();
	run_sql($s, 'BEGIN;');
	my ($out, $state) = run_sql($s, q{
		SELECT status || '|' || token
		  FROM idem_begin('sess', 'prep', '\x01', lease => '60 s', takeover => 'session') b;});
	my ($token) = $out =~ /^new\|(\d+)$/;
	ok(defined $token, 'prepared: a claim in a transaction');
	($out, $state) = run_sql($s, q{PREPARE TRANSACTION 'idem_prep';});
	is($state, '00000', 'prepared: PREPARE TRANSACTION succeeds with a session claim in it');
	$end_session{quit}->($s, $pid);
	ok(backend_gone($pid), 'prepared: the session that prepared it disconnected');
	is(locks_of($pid, $SESSION_LOCK), '0', 'prepared: ... and its session lock is gone');

	($out, $state) = run_sql($admin, q{
		SELECT status FROM idem_begin('sess', 'prep', '\x01', 'raise') b;});
	is($state, 'IK409', 'prepared: a duplicate in raise mode gets IK409: the claim is in progress');
	start_waiter('prep');
	ok( poll_admin(qq{
			SELECT wait_event_type = 'Lock' AND wait_event = 'transactionid'
			  FROM pg_stat_activity WHERE pid = $waiter_pid;}),
		'prepared: a waiting duplicate waits on the prepared transaction\'s lock');
	($out, $state) = run_sql($admin, q{
		SELECT status FROM idem_begin('sess', 'prep', '\x01', 'raise') b;});
	is($state, 'IK409', 'prepared: still IK409 while it waits');
	ok(!sql_done($waiter), 'prepared: the waiting duplicate has not taken it over');

	($out, $state) = run_sql($admin,
		q{SELECT extract(epoch FROM clock_timestamp()); COMMIT PREPARED 'idem_prep';});
	is($state, '00000', 'prepared: COMMIT PREPARED');
	my $t0 = $out;
	my ($status, $new_token, $response, $t1, $wstate) = waiter_answer();
	# observed: the committed claim names a session that is gone, so the
	# waiter, woken by the end of the transaction, takes it over at once
	is("$wstate|$status", '00000|new',
		'prepared: after COMMIT PREPARED the waiter takes the claim over: its session is gone');
	cmp_ok($t1 - $t0, '<', 5,
		sprintf('prepared: ... at once (%.1f ms after COMMIT PREPARED; lease 60 s)', 1000 * ($t1 - $t0)));
	cmp_ok($new_token, '>', $token, 'prepared: ... with a greater token');
	is(finish_state('prep', $token), 'IK412', 'prepared: the prepared claim\'s token gets IK412');
}

# (b) COMMIT PREPARED while the session that prepared it is still there
{
	my ($s, $pid) = claimant();
	run_sql($s, 'BEGIN;');
	my ($out) = run_sql($s, q{
		SELECT token FROM idem_begin('sess', 'prep-live', '\x01', lease => '60 s', takeover => 'session') b;});
	my $token = $out;
	run_sql($s, q{PREPARE TRANSACTION 'idem_prep_live';});
	my $state;
	($out, $state) = run_sql($admin, q{COMMIT PREPARED 'idem_prep_live';});
	is($state, '00000', 'prepared, session alive: COMMIT PREPARED from another session');
	is(locks_of($pid, $SESSION_LOCK), '1', 'prepared, session alive: the session still holds its session lock');
	($out, $state) = run_sql($admin, q{
		SELECT status FROM idem_begin('sess', 'prep-live', '\x01', 'raise') b;});
	is($state, 'IK409', 'prepared, session alive: the committed claim is held by its live session (IK409)');
	start_waiter('prep-live');
	ok(waiter_sleeps(1), 'prepared, session alive: a duplicate waits on the session');
	$end_session{terminate}->($s, $pid);
	my ($status, $new_token) = waiter_answer();
	is($status, 'new', 'prepared, session alive: taken over when the session ends');
	cmp_ok($new_token, '>', $token, 'prepared, session alive: ... with a greater token');
}

# (c) ROLLBACK PREPARED: the claim never existed
{
	my ($s, $pid) = claimant();
	run_sql($s, 'BEGIN;');
	my ($out) = run_sql($s, q{
		SELECT token FROM idem_begin('sess', 'prep-rb', '\x01', lease => '60 s', takeover => 'session') b;});
	my $token = $out;
	run_sql($s, q{PREPARE TRANSACTION 'idem_prep_rb';});
	$end_session{quit}->($s, $pid);
	start_waiter('prep-rb');
	ok( poll_admin(qq{
			SELECT wait_event_type = 'Lock' AND wait_event = 'transactionid'
			  FROM pg_stat_activity WHERE pid = $waiter_pid;}),
		'prepared, rolled back: the duplicate waits on the prepared transaction');
	my $state;
	($out, $state) = run_sql($admin, q{ROLLBACK PREPARED 'idem_prep_rb';});
	is($state, '00000', 'prepared, rolled back: ROLLBACK PREPARED');
	my ($status, $new_token, $response) = waiter_answer();
	is("$status|$response", 'new|', 'prepared, rolled back: the waiter gets the key: new, no checkpoint');
	cmp_ok($new_token, '>', $token, 'prepared, rolled back: ... with a greater token');
}

is($node->safe_psql('postgres', 'SELECT count(*) FROM pg_prepared_xacts'), '0',
	'no prepared transaction is left');
$waiter->quit;
$admin->quit;
is($node->safe_psql('postgres', qq{
	SELECT count(*) FROM pg_locks
	 WHERE locktype = 'advisory' AND objsubid IN (18763, 18764, $SESSION_LOCK, $SESSION_WAITER_LOCK)}),
	'0', 'no idempotency lock is left');
unlike(slurp_file($node->logfile), qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');
$node->stop;
done_testing();
