
# Copyright (c) 2024, idempotency authors
#
# Immediate shutdown in the middle of a concurrent load, restart, and carry
# on with the same load: crash cycles in unlogged and in logged mode.
#
# The load (pgbench, 8 clients; keys drawn from a Zipf distribution, so that
# a few hot keys are retried all the time and duplicates race, while a long
# tail keeps bringing new keys):
#   intx      in-transaction shape: BEGIN; idem_begin; if new: INSERT the
#             effect row and idem_finish with a response naming the token;
#             COMMIT
#   intx_rb   the same, but the transaction rolls back (a failed attempt)
#   ext       external shape: the claim commits on its own (lease 5 s); a
#             moment later a second transaction writes the effect row and
#             finishes -- a committed claim finished later
#   ext_abort a committed claim released by idem_abort (errors not cached)
# Every effect row carries the epoch (crash cycle) it was written in.
#
# Unlogged mode (durability mode 'none', set right after CREATE EXTENSION:
# the default before 1.3; a new installation now starts in 'completed'):
# after every crash the record table is empty
# (crash recovery resets unlogged relations) and fully usable: the load
# carries on without a single error, new tokens are greater than every
# token already stored in an effect row, and within one epoch no key has
# more than one effect row (across a crash a key may run again: the
# documented at-least-once price).  At the end: completed record <=> an
# effect row with its token and response, for the epoch that did not crash.
#
# Logged mode (idem_set_logged(true), i.e. durability mode 'all'): nothing
# is forgotten.  After every
# crash and at the end: every effect row has its completed record (no
# completed record was lost) with the same token and response, every
# completed record has exactly one effect row, no key has two effect rows
# over the whole run (exactly once across crashes), and claims pending at
# the crash are still there, fenced by their tokens.
#
# Durations: a few seconds of load per cycle, one crash per mode.  With
# IDEM_SOAK_SECONDS=N (test/soak/run) the file runs about N seconds in all,
# with a crash every ~30 s.

use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);

my $soak = $ENV{IDEM_SOAK_SECONDS} || 0;
my ($cycles, $load_s, $final_s, $nkeys);
if ($soak)
{
	# half of the time per mode; a crash every ~30 s
	my $per_mode = $soak / 2;
	$cycles = int($per_mode / 30) > 2 ? int($per_mode / 30) : 2;
	$load_s = int($per_mode / ($cycles + 1)) || 1;
	$final_s = $load_s;
	$nkeys = 100000000;
}
else
{
	($cycles, $load_s, $final_s, $nkeys) = (1, 4, 3, 10000000);
}
my $clients = 8;
note("crash cycles per mode: $cycles; load before each crash: ${load_s}s; "
	  . "final run: ${final_s}s; key space per operation: $nkeys (Zipf 1.2)");

my $node = PostgreSQL::Test::Cluster->new('crash_load');
$node->init;
$node->append_conf('postgresql.conf', qq{
max_connections = 40
# crash recovery replays at most a few seconds of WAL
checkpoint_timeout = 30s
});
$node->start;

my $scripts = {
	'intx' => q{
\set k random_zipfian(1, :nkeys, 1.2)
BEGIN;
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS tok
  FROM idem_begin('intx', 'k' || :k, idem_fingerprint('intx', :k)) \gset
\if :is_new
INSERT INTO effect (op, key, token, epoch, response)
  VALUES ('intx', 'k' || :k, :tok, (SELECT e FROM epoch), jsonb_build_object('charge', 'ch_' || :tok));
SELECT idem_finish('intx', 'k' || :k, :tok, jsonb_build_object('charge', 'ch_' || :tok));
\endif
COMMIT;
},
	'intx_rb' => q{
\set k random_zipfian(1, :nkeys, 1.2)
BEGIN;
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS tok
  FROM idem_begin('intx', 'k' || :k, idem_fingerprint('intx', :k)) \gset
\if :is_new
INSERT INTO effect (op, key, token, epoch, response)
  VALUES ('intx', 'k' || :k, :tok, (SELECT e FROM epoch), jsonb_build_object('charge', 'ch_' || :tok));
SELECT idem_finish('intx', 'k' || :k, :tok, jsonb_build_object('charge', 'ch_' || :tok));
\endif
ROLLBACK;
},
	'ext' => q{
\set k random_zipfian(1, :nkeys, 1.2)
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS tok
  FROM idem_begin('ext', 'e' || :k, idem_fingerprint('ext', :k), lease => '5 s') \gset
\if :is_new
\sleep 10 ms
BEGIN;
INSERT INTO effect (op, key, token, epoch, response)
  VALUES ('ext', 'e' || :k, :tok, (SELECT e FROM epoch), jsonb_build_object('charge', 'ch_' || :tok));
SELECT idem_finish('ext', 'e' || :k, :tok, jsonb_build_object('charge', 'ch_' || :tok));
COMMIT;
\endif
},
	'ext_abort' => q{
\set k random_zipfian(1, :nkeys, 1.2)
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS tok
  FROM idem_begin('ext', 'e' || :k, idem_fingerprint('ext', :k), lease => '5 s') \gset
\if :is_new
\sleep 5 ms
SELECT idem_abort('ext', 'e' || :k, :tok) AS released \gset
\endif
},
};
my %weights = (intx => 6, intx_rb => 1, ext => 3, ext_abort => 1);
my @script_files;
for my $name (sort keys %$scripts)
{
	my $file = $node->basedir . "/$name.sql";
	append_to_file($file, $scripts->{$name});
	push @script_files, '-f', "$file\@$weights{$name}";
}

# start pgbench on $db for $seconds; returns a handle
sub start_load
{
	my ($db, $seconds) = @_;
	my %load = (out => '', err => '', started => time);
	$load{run} = IPC::Run::start(
		[
			'pgbench', '-n', '-c', $clients, '-j', 4, '-T', $seconds,
			'-D', "nkeys=$nkeys", @script_files,
			'-h', $node->host, '-p', $node->port, $db
		],
		'>', \$load{out}, '2>', \$load{err},
		IPC::Run::timeout($seconds + $PostgreSQL::Test::Utils::timeout_default));
	return \%load;
}

sub finish_load
{
	my ($load) = @_;
	$load->{run}->finish;
	$load->{rc} = $load->{run}->result(0);
	($load->{tps}) = $load->{out} =~ /tps = ([\d.]+)/;
	($load->{xacts}) = $load->{out} =~ /number of transactions actually processed: (\d+)/;
	return $load;
}

sub sql
{
	my ($db, $sql) = @_;
	return $node->safe_psql($db, $sql);
}

# Every record, in whichever table the durability mode keeps it (in modes
# 'none' and 'all' idem_result stays empty).
my $records = '(SELECT * FROM idem_record UNION ALL SELECT * FROM idem_result)';

# Checks that hold in both modes whenever no load runs.  Returns nothing.
sub check_common
{
	my ($db, $label) = @_;
	is(sql($db, qq{
		SELECT count(*) FROM $records r
		  LEFT JOIN (SELECT op, key, token, response, count(*) AS n
		               FROM effect GROUP BY op, key, token, response) e
		    ON e.op = r.operation AND e.key = r.key AND e.token = r.token
		   AND e.response = r.response
		 WHERE r.completed_at IS NOT NULL AND coalesce(e.n, 0) <> 1}),
		'0', "$label: every completed record has exactly one effect row with its token and response");
	is(sql($db, qq{
		SELECT count(*) FROM $records r
		 WHERE r.completed_at IS NOT NULL
		   AND r.response <> jsonb_build_object('charge', 'ch_' || r.token)}),
		'0', "$label: every stored response is the one its claim produced");
	is(sql($db, q{
		SELECT count(*) FROM (SELECT 1 FROM effect GROUP BY op, key, epoch HAVING count(*) > 1) d}),
		'0', "$label: no key has two effect rows within one epoch");
	is(sql($db, qq{
		SELECT count(*) FROM $records r
		 WHERE r.completed_at IS NULL
		   AND EXISTS (SELECT 1 FROM effect e
		                WHERE e.op = r.operation AND e.key = r.key AND e.token = r.token)}),
		'0', "$label: no pending record has an effect row of its own token");
	is(sql($db, q{
		SELECT count(*) FROM pg_locks
		 WHERE locktype = 'advisory' AND objsubid IN (18763, 18764)}),
		'0', "$label: no idempotency lock is held");
	return;
}

sub setup_db
{
	my ($db) = @_;
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	sql($db, q{
		CREATE EXTENSION idempotency;
		CREATE TABLE effect (
			op text NOT NULL, key text NOT NULL, token bigint NOT NULL,
			epoch int NOT NULL, response jsonb NOT NULL,
			at timestamptz NOT NULL DEFAULT clock_timestamp());
		CREATE INDEX ON effect (op, key);
		CREATE TABLE epoch (e int NOT NULL);
		INSERT INTO epoch VALUES (1);
	});
	return;
}

# One crash cycle: load for $load_s seconds, then an immediate shutdown
# while the clients are busy.  Returns the pgbench result.
sub crash_cycle
{
	my ($db, $cycle, $label) = @_;
	my $load = start_load($db, $load_s + 300);
	sleep($load_s);

	# what is in flight at the moment of the crash
	my $in_flight = sql($db, q{
		SELECT count(*) FILTER (WHERE state = 'idle in transaction' OR
		                               (state = 'active' AND query NOT LIKE '%pg_stat_activity%'))
		  FROM pg_stat_activity WHERE backend_type = 'client backend' AND datname = current_database()});
	my $pending = sql($db, q{SELECT count(*) FROM idem_record WHERE completed_at IS NULL});
	$node->stop('immediate');
	finish_load($load);
	note("$label: pgbench at the crash (exit $load->{rc}):\n$load->{err}");
	ok($load->{rc} != 0 && $load->{err} =~ /server closed the connection|terminating connection|connection to server .* lost|aborted/,
		"$label: the crash cut the running load off");
	unlike($load->{err}, qr/ERROR:(?!.*terminating connection)/,
		"$label: the load met no SQL error before the crash");
	diag("$label: at the crash $in_flight client transactions were busy, $pending claims pending");
	$node->start;
	return;
}

# ---------------------------------------------------------------- unlogged

setup_db('u');
# This part is about the unlogged record table (everything forgotten in a
# crash): durability mode 'none', both idem_record and idem_result unlogged.
# The default of a new installation, 'completed', would keep completed
# records in the logged idem_result.
sql('u', q{SELECT idem_set_durability('none')});
is(sql('u', 'SELECT idem_durability()'), 'none', 'unlogged: durability mode none');
my $max_effect_token = 0;
for my $cycle (1 .. $cycles)
{
	my $label = "unlogged, crash $cycle";
	crash_cycle('u', $cycle, $label);

	is(sql('u', q{SELECT relpersistence FROM pg_class WHERE relname = 'idem_record'}), 'u',
		"$label: the record table is still unlogged");
	is(sql('u', "SELECT count(*) FROM $records r"), '0',
		"$label: crash recovery emptied the record tables");
	my ($effects, $max_tok) = split /\|/, sql('u', qq{
		SELECT count(*), coalesce(max(token), 0) FROM effect WHERE epoch = $cycle});
	cmp_ok($effects, '>', 0, "$label: the load wrote effect rows before the crash ($effects)");
	$max_effect_token = $max_tok if $max_tok > $max_effect_token;
	check_common('u', $label);

	# usable at once: a claim, a replay, an abort
	my $t = sql('u', q{SELECT token FROM idem_begin('probe', 'p', '\x01')});
	cmp_ok($t, '>', $max_effect_token,
		"$label: a new token is greater than every token stored in an effect row");
	sql('u', qq{SELECT idem_finish('probe', 'p', $t, '{"ok": true}')});
	is(sql('u', q{SELECT status || '|' || response FROM idem_begin('probe', 'p', '\x01')}),
		'replay|{"ok": true}', "$label: finish and replay work after the restart");
	sql('u', q{DELETE FROM idem_record WHERE operation = 'probe'});
	sql('u', 'UPDATE epoch SET e = e + 1');
}

# the load carries on, with no crash, and must not meet a single error
{
	my $label = 'unlogged, after the last restart';
	my $load = finish_load(start_load('u', $final_s));
	is($load->{rc}, 0, "$label: the load runs without an error")
	  or diag($load->{err});
	note("$label: $load->{xacts} transactions, $load->{tps} tps");
	my $last = $cycles + 1;
	check_common('u', $label);
	is(sql('u', qq{
		SELECT count(*) FROM effect e
		 WHERE e.epoch = $last AND NOT EXISTS (
			SELECT 1 FROM $records r
			 WHERE r.operation = e.op AND r.key = e.key AND r.token = e.token
			   AND r.completed_at IS NOT NULL AND r.response = e.response)}),
		'0', "$label: every effect row of the epoch without a crash has its completed record");
	cmp_ok(sql('u', qq{SELECT count(*) FROM effect WHERE epoch = $last}), '>', 0,
		"$label: the load wrote effect rows");
	cmp_ok(sql('u', qq{SELECT count(*) FROM $records r WHERE completed_at IS NOT NULL}), '>', 0,
		"$label: and completed records");
}

# ---------------------------------------------------------------- logged

setup_db('l');
sql('l', 'SELECT idem_set_logged(true)');
is(sql('l', q{SELECT relpersistence FROM pg_class WHERE relname = 'idem_record'}), 'p',
	'logged: idem_set_logged(true) made the record table logged');

sub check_logged
{
	my ($label) = @_;
	check_common('l', $label);
	is(sql('l', qq{
		SELECT count(*) FROM effect e
		 WHERE NOT EXISTS (
			SELECT 1 FROM $records r
			 WHERE r.operation = e.op AND r.key = e.key AND r.token = e.token
			   AND r.completed_at IS NOT NULL AND r.response = e.response)}),
		'0', "$label: every effect row has its completed record, same token and response (none lost)");
	is(sql('l', q{
		SELECT count(*) FROM (SELECT 1 FROM effect GROUP BY op, key HAVING count(*) > 1) d}),
		'0', "$label: no key has two effect rows over the whole run (exactly once)");
	return;
}

for my $cycle (1 .. $cycles)
{
	my $label = "logged, crash $cycle";
	crash_cycle('l', $cycle, $label);

	is(sql('l', q{SELECT relpersistence FROM pg_class WHERE relname = 'idem_record'}), 'p',
		"$label: the record table is still logged");
	my ($effects, $max_tok) = split /\|/, sql('l', qq{
		SELECT count(*), coalesce(max(token), 0) FROM effect WHERE epoch = $cycle});
	cmp_ok($effects, '>', 0, "$label: the load wrote effect rows before the crash ($effects)");
	check_logged($label);

	# claims committed before the crash and still pending hold their key
	# until their lease ends, and their token still finishes them
	my $p = sql('l', q{
		SELECT operation || '|' || key || '|' || token FROM idem_record
		 WHERE operation = 'ext' AND completed_at IS NULL
		   AND expires_at > clock_timestamp() + interval '1 s'
		 ORDER BY token LIMIT 1});
	if ($p ne '')
	{
		my ($op, $key, $tok) = split /\|/, $p;
		my ($rc, $out, $err) = $node->psql('l', qq{
			SELECT status FROM idem_begin('$op', '$key', idem_fingerprint('$op', substr('$key', 2)::int),
			                              in_flight => 'raise')});
		like($err, qr/IK409|already in progress/,
			"$label: a claim pending at the crash is still in progress after it (raise: IK409)");
		my $max = sql('l', 'SELECT max(token) FROM idem_record');
		$node->safe_psql('l', qq{
			BEGIN;
			INSERT INTO effect (op, key, token, epoch, response)
			  VALUES ('$op', '$key', $tok, (SELECT e FROM epoch), jsonb_build_object('charge', 'ch_' || $tok));
			SELECT idem_finish('$op', '$key', $tok, jsonb_build_object('charge', 'ch_' || $tok));
			COMMIT;});
		is(sql('l', qq{SELECT state || '|' || token FROM idem_inspect('$op', '$key')}),
			"completed|$tok", "$label: its worker, back after the restart, finishes it with its token");
	}
	else
	{
		note("$label: no claim with a live lease was pending at the crash");
	}
	my $t = sql('l', q{SELECT token FROM idem_begin('probe', 'p', '\x01')});
	cmp_ok($t, '>', sql('l', 'SELECT max(token) FROM effect'),
		"$label: a new token is greater than every token stored before the crash");
	is(sql('l', qq{SELECT idem_abort('probe', 'p', $t)}), 't', "$label: and can be aborted");
	sql('l', 'UPDATE epoch SET e = e + 1');
}

{
	my $label = 'logged, after the last restart';
	my $load = finish_load(start_load('l', $final_s));
	is($load->{rc}, 0, "$label: the load runs without an error")
	  or diag($load->{err});
	note("$label: $load->{xacts} transactions, $load->{tps} tps");
	check_logged($label);
	cmp_ok(sql('l', sprintf(q{SELECT count(*) FROM effect WHERE epoch = %d}, $cycles + 1)), '>', 0,
		"$label: the load wrote effect rows");
}

my $log = slurp_file($node->logfile);
unlike($log, qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed (server log)');

$node->stop;
done_testing();
