
# Copyright (c) 2024, idempotency authors
#
# Monitoring as a DBA sets it up (monitoring/README.md): Debian's
# prometheus-postgres-exporter, with monitoring/queries.yaml as its
# --extend.query-path, connects as a role that is a member of pg_monitor
# and nothing else, to a server with idempotency preloaded.  After known
# traffic -- claims, replays, key reuse, a refusal of a key in progress, an
# abort, a takeover and a fenced finish, a recovery (a takeover of a claim
# with a checkpoint), a retry of a remembered key (IK410), a wait, a purge
# -- /metrics, scraped with curl, shows:
#
#  - idempotency_store_records{role, operation, state}: exactly the
#    records of every role, a dropped role's under role="", and nothing
#    else; a remembered key as state="remembered", not "expired" (purge
#    keeps it); idempotency_store_oldest_age_seconds for a claim an hour
#    old;
#  - every idempotency_*_total counter with its exact value (the wait time
#    within bounds), in seconds where it is a time;
#  - no key and no response anywhere.
#
# test/run installs the exporter and curl (test/lib.sh, missing_packages).

use strict;
use warnings;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $exporter = '/usr/bin/prometheus-postgres-exporter';
BAIL_OUT("$exporter is missing: install prometheus-postgres-exporter (test/run does)")
  unless -x $exporter;
BAIL_OUT('curl is missing (test/run installs it)')
  unless system('sh', '-c', 'command -v curl >/dev/null') == 0;
my $queries = ($ENV{TESTDIR} // '.') . '/monitoring/queries.yaml';
BAIL_OUT("$queries is missing") unless -f $queries;

my $node = PostgreSQL::Test::Cluster->new('monitoring');
$node->init;
$node->append_conf('postgresql.conf', "shared_preload_libraries = 'idempotency'");
$node->start;

# Two applications (one with a name that needs quoting in SQL), a role that
# will be dropped with a record left behind, and the exporter's role:
# LOGIN, member of pg_monitor, nothing else.
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE ROLE app_a;
	CREATE ROLE "App B";
	CREATE ROLE app_gone;
	CREATE ROLE exporter LOGIN IN ROLE pg_monitor;
});
is($node->safe_psql('postgres', q{
	SELECT r.rolsuper OR r.rolcreaterole OR r.rolcreatedb OR r.rolreplication OR r.rolbypassrls,
	       ARRAY(SELECT m.roleid::regrole::text FROM pg_auth_members m WHERE m.member = r.oid)
	  FROM pg_roles r WHERE r.rolname = 'exporter'}),
	'f|{pg_monitor}', 'the exporter role has no attribute and is a member of pg_monitor only');

# ---- known traffic ------------------------------------------------------
#
# Keys are ord-*, ref-*, b-*, w-*, g-*; every response holds "ch_secret":
# neither may reach /metrics.  In the default mode 'completed' a completed
# record is in idem_result, a claim in idem_record: ages and expiries are
# set by hand in both.
sub expire
{
	my ($op, $key, $set) = @_;
	$node->safe_psql('postgres', join '',
		map { "UPDATE $_ SET $set WHERE operation = '$op' AND key = '$key';" }
		  qw(idem_record idem_result));
	return;
}

# a purge, first, while nothing else has expired: ref-0 is purged
$node->safe_psql('postgres', q{
	SET ROLE app_a;
	SELECT idem_finish('payment.refund', 'ref-0', token, '{"charge": "ch_secret_0"}')
	  FROM idem_begin('payment.refund', 'ref-0', '\x00');
});
expire('payment.refund', 'ref-0', "expires_at = now() - interval '1 second'");
is($node->safe_psql('postgres', 'SELECT idem_purge()'), '1', 'purge: one expired record');

# a key forgotten on purpose: counted, and gone from the records
$node->safe_psql('postgres', q{
	SET ROLE app_a;
	SELECT idem_finish('payment.refund', 'ref-f', token, '{"charge": "ch_secret_f"}')
	  FROM idem_begin('payment.refund', 'ref-f', '\x0f');
});
is($node->safe_psql('postgres', q{SELECT idem_forget('payment.refund', 'ref-f', 'app_a')}),
	'completed', 'idem_forget: a completed record forgotten');

my $sa = $node->background_psql('postgres', on_error_stop => 0);
my $sb = $node->background_psql('postgres', on_error_stop => 0);
run_sql($sa, 'SET ROLE app_a;');
run_sql($sb, 'SET ROLE "App B";');

my @traffic = (
	# app_a, payment.charge: ord-1 and ord-2 completed, ord-1 replayed twice
	[ $sa, q{SELECT idem_finish('payment.charge', 'ord-1', token, '{"charge": "ch_secret_1"}')
	          FROM idem_begin('payment.charge', 'ord-1', '\x01')}, '00000' ],
	[ $sa, q{SELECT idem_finish('payment.charge', 'ord-2', token, '{"charge": "ch_secret_2"}')
	          FROM idem_begin('payment.charge', 'ord-2', '\x02')}, '00000' ],
	[ $sa, q{SELECT status FROM idem_begin('payment.charge', 'ord-1', '\x01')}, '00000', 'replay' ],
	[ $sa, q{SELECT status FROM idem_begin('payment.charge', 'ord-1', '\x01')}, '00000', 'replay' ],
	# ord-1 reused with another fingerprint
	[ $sa, q{SELECT status FROM idem_begin('payment.charge', 'ord-1', '\xff')}, 'IK422' ],
	# ord-3 pending; a duplicate with in_flight 'raise' is refused
	[ $sa, q{SELECT status FROM idem_begin('payment.charge', 'ord-3', '\x03', lease => '1 hour')}, '00000', 'new' ],
	[ $sa, q{SELECT status FROM idem_begin('payment.charge', 'ord-3', '\x03', in_flight => 'raise')}, 'IK409' ],
	# ord-4 claimed and aborted: no record
	[ $sa, q{SELECT idem_abort('payment.charge', 'ord-4', token)
	          FROM idem_begin('payment.charge', 'ord-4', '\x04')}, '00000', 't' ],
	# ord-5: a claim whose lease lapses, taken over; the first token's
	# finish is fenced off; the new claim stays pending
	[ $sa, q{SELECT token FROM idem_begin('payment.charge', 'ord-5', '\x05', lease => '1 ms') \gset first_
	        SELECT pg_sleep(0.05)}, '00000' ],
	[ $sa, q{SELECT status FROM idem_begin('payment.charge', 'ord-5', '\x05', lease => '1 hour')}, '00000', 'new' ],
	[ $sa, q{SELECT idem_finish('payment.charge', 'ord-5', :first_token, '{"charge": "ch_secret_5"}')}, 'IK412' ],
	# ord-6: a claim left to lapse
	[ $sa, q{SELECT status FROM idem_begin('payment.charge', 'ord-6', '\x06', lease => '1 ms')}, '00000', 'new' ],
	# ord-7: a claim with a checkpoint, made lapsed below and recovered
	[ $sa, q{SELECT idem_checkpoint('payment.charge', 'ord-7', token, '{"step": 1}')
	          FROM idem_begin('payment.charge', 'ord-7', '\x07', lease => '1 hour')}, '00000' ],
	# app_a, payment.refund: ref-1 completed, made expired below; ref-2
	# completed with remember, made remembered below
	[ $sa, q{SELECT idem_finish('payment.refund', 'ref-1', token, '{"charge": "ch_secret_r1"}')
	          FROM idem_begin('payment.refund', 'ref-1', '\x11')}, '00000' ],
	[ $sa, q{SELECT idem_finish('payment.refund', 'ref-2', token, '{"charge": "ch_secret_r2"}')
	          FROM idem_begin('payment.refund', 'ref-2', '\x12', remember => '30 days')}, '00000' ],
	# App B, payment.charge: b-1 completed, b-2 pending, claimed an hour ago (below)
	[ $sb, q{SELECT idem_finish('payment.charge', 'b-1', token, '{"charge": "ch_secret_b1"}')
	          FROM idem_begin('payment.charge', 'b-1', '\xb1')}, '00000' ],
	[ $sb, q{SELECT status FROM idem_begin('payment.charge', 'b-2', '\xb2', lease => '1 hour')}, '00000', 'new' ],
	# app_gone: g-1 completed; the role is dropped below
	[ $sa, q{RESET ROLE; SET ROLE app_gone;
	        SELECT idem_finish('payment.charge', 'g-1', token, '{"charge": "ch_secret_g1"}')
	          FROM idem_begin('payment.charge', 'g-1', '\xc1');
	        RESET ROLE; SET ROLE app_a}, '00000' ],
);
for my $t (@traffic)
{
	my ($s, $sql, $want_state, $want_out) = @$t;
	my ($out, $state, $err) = run_sql($s, "$sql;");
	(my $what = $sql) =~ s/\s+/ /g;
	is($state, $want_state, "traffic: $what -> $want_state") or diag($err);
	is($out, $want_out, "traffic: $what returns $want_out") if defined $want_out;
}
expire('payment.refund', 'ref-1', "expires_at = now() - interval '1 second'");
expire('payment.refund', 'ref-2', "expires_at = now() - interval '1 second'");
expire('payment.charge', 'b-2', "created_at = now() - interval '1 hour'");
$node->safe_psql('postgres', 'DROP ROLE app_gone');

# ref-2 is remembered: a retry is refused with IK410.  ord-7's lease is
# over: the next attempt recovers it from its checkpoint, and stays pending.
expire('payment.charge', 'ord-7', "expires_at = now() - interval '1 second'");
for my $t (
	[ q{SELECT status FROM idem_begin('payment.refund', 'ref-2', '\x12')}, 'IK410', '' ],
	[ q{SELECT status FROM idem_begin('payment.charge', 'ord-7', '\x07', lease => '1 hour')}, '00000', 'recover' ])
{
	my ($sql, $want_state, $want_out) = @$t;
	my ($out, $state, $err) = run_sql($sa, "$sql;");
	is("$state|$out", "$want_state|$want_out", "$sql -> $want_state $want_out") or diag($err);
}

# A wait: App B's w-1 is claimed and finished in an open transaction; a
# duplicate waits for it, and replays once it commits.
my ($out, $state) = run_sql($sb, q{BEGIN;
	SELECT idem_finish('payment.capture', 'w-1', token, '{"charge": "ch_secret_w1"}')
	  FROM idem_begin('payment.capture', 'w-1', '\xe1');});
is($state, '00000', 'w-1 claimed and finished, not committed');
my $dup = $node->background_psql('postgres', on_error_stop => 0);
run_sql($dup, 'SET ROLE "App B";');
send_sql($dup, q{SELECT status FROM idem_begin('payment.capture', 'w-1', '\xe1');});
$node->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity
	 WHERE wait_event_type IN ('Lock', 'Extension') AND query LIKE '%''w-1''%'})
  or die 'the duplicate of w-1 does not wait';
run_sql($sb, 'COMMIT;');
($out, $state) = wait_sql($dup);
is("$state|$out", '00000|replay', 'the duplicate of w-1 waited, then replayed');
$_->quit for ($sa, $sb, $dup);

# ---- the exporter, as the pg_monitor-only role ---------------------------

my $port = PostgreSQL::Test::Cluster::get_free_port();
my $url = "http://127.0.0.1:$port/metrics";
my $exporter_log = $node->basedir . '/exporter.log';
my $h;
# the exporter goes with the test, however the test ends (reaping it must
# not set the test's exit status)
END
{
	local $?;
	$h->kill_kill if defined $h && $h->pumpable;
}
{
	local $ENV{DATA_SOURCE_NAME} = 'host=' . $node->host . ' port=' . $node->port
	  . ' user=exporter dbname=postgres sslmode=disable';
	$h = IPC::Run::start(
		[ $exporter, "--web.listen-address=127.0.0.1:$port",
			"--extend.query-path=$queries", '--disable-settings-metrics' ],
		'<', \undef, '>', $exporter_log, '2>&1');
}
my ($metrics, $curl_err) = ('', '');
my $deadline = time + $PostgreSQL::Test::Utils::timeout_default;
while (time < $deadline)
{
	($metrics, $curl_err) = run_command([ 'curl', '-sS', '--max-time', '10', $url ]);
	last if $metrics =~ /^idempotency_claims_total/m;
	last unless $h->pumpable;
	select(undef, undef, undef, 0.2);
}
ok($metrics =~ /^idempotency_claims_total/m, "the exporter serves our metrics at $url")
  or diag("curl: $curl_err\nexporter log:\n" . slurp_file($exporter_log) . "\nmetrics:\n$metrics");
note('exporter: ' . (join '', run_command([ $exporter, '--version' ])) =~ s/\n.*//sr);
note("scraped:\n" . join("\n", grep { /^idempotency_/ } split /\n/, $metrics));

# name{labels} -> value, without the label the exporter adds itself
# ("server", in older versions), for every idempotency_ sample
my %sample;
for my $line (split /\n/, $metrics)
{
	next unless $line =~ /^(idempotency_\w+)(?:\{(.*)\})? (\S+)$/;
	my ($name, $labels, $value) = ($1, $2 // '', $3);
	my %l = $labels =~ /(\w+)="((?:[^"\\]|\\.)*)"/g;
	delete $l{server};
	$sample{ $name . '{' . join(',', map { "$_=$l{$_}" } sort keys %l) . '}' } = $value;
}

# records, exactly
my %want_records = (
	'app_a|payment.charge|completed' => 2,    # ord-1, ord-2
	'app_a|payment.charge|pending'   => 3,    # ord-3, ord-5 (taken over), ord-7 (recovered)
	'app_a|payment.charge|lapsed'    => 1,    # ord-6
	'app_a|payment.refund|expired'   => 1,    # ref-1 (ref-0 purged)
	'app_a|payment.refund|remembered' => 1,   # ref-2
	'App B|payment.charge|completed' => 1,    # b-1
	'App B|payment.charge|pending'   => 1,    # b-2
	'App B|payment.capture|completed' => 1,   # w-1
	'|payment.charge|completed'      => 1,    # g-1 of the dropped role
);
my %got_records;
for my $k (keys %sample)
{
	next unless $k =~ /^idempotency_store_records\{operation=(.*),role=(.*),state=(\w+)\}$/;
	$got_records{"$2|$1|$3"} = $sample{$k};
}
is_deeply(\%got_records, \%want_records,
	'idempotency_store_records: every role\'s records by role, operation and state, exactly');

my $age = $sample{'idempotency_store_oldest_age_seconds{operation=payment.charge,role=App B,state=pending}'};
ok(defined $age && $age >= 3600 && $age < 3600 + $PostgreSQL::Test::Utils::timeout_default,
	'idempotency_store_oldest_age_seconds: App B\'s pending claim is an hour old (' . ($age // 'none') . ')');

# counters, exactly (the wait time: more than nothing, less than the test)
my %want_counters = (
	claims_total               => 17,    # ref-0, ref-f, ord-1..7 (ord-5 and ord-7 twice), ref-1, ref-2, b-1, b-2, g-1, w-1
	replays_total              => 3,     # ord-1 twice, w-1's duplicate
	waits_total                => 1,
	in_progress_refusals_total => 1,
	key_reuse_refusals_total   => 1,
	takeovers_total            => 2,     # ord-5, ord-7
	fencing_refusals_total     => 1,
	aborts_total               => 1,
	purged_total               => 1,
	recoveries_total           => 1,     # ord-7
	expired_refusals_total     => 1,     # ref-2
	forgotten_total            => 1,     # ref-f
);
for my $c (sort keys %want_counters)
{
	is($sample{"idempotency_$c\{}"}, $want_counters{$c}, "idempotency_$c");
}
my $wait = $sample{'idempotency_wait_seconds_total{}'};
ok(defined $wait && $wait > 0 && $wait < $PostgreSQL::Test::Utils::timeout_default,
	'idempotency_wait_seconds_total: the wait, in seconds (' . ($wait // 'none') . ')');
like($metrics, qr/^# TYPE idempotency_claims_total counter$/m, 'counters are of type counter');
like($metrics, qr/^# TYPE idempotency_store_records gauge$/m, 'records are a gauge');

# nothing else of ours, and no key or response anywhere
my @unexpected = sort grep {
	!/^idempotency_store_(?:records|oldest_age_seconds)\{/
	  && !(/^idempotency_(\w+)\{\}$/
		&& (exists $want_counters{$1} || $1 eq 'wait_seconds_total'))
} keys %sample;
is_deeply(\@unexpected, [], 'no other idempotency_ metric');
unlike($metrics, qr/ord-|ref-|\bb-[12]\b|w-1|g-1|ch_secret|"step"/, 'no key, response or checkpoint in /metrics');

# the exporter's role can read no record itself
my ($rc, $stdout, $stderr) = $node->psql('postgres',
	'SELECT count(*) FROM idem_record UNION ALL SELECT count(*) FROM idem_result',
	extra_params => [ '-U', 'exporter' ]);
like($stderr, qr/permission denied for table idem_re/, 'the exporter role cannot read the record tables');

$node->stop;
done_testing();
