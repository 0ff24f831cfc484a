
# Copyright (c) 2024, idempotency authors
#
# Logical replication: a publisher with the extension, and subscribers
# without it (the application's tables keep replicating) and with it (a
# blue-green upgrade: completed records go across, so retries sent to the
# new cluster replay).
#
# idem_result (completed records, mode 'completed') and idem_mode are
# logged, so FOR ALL TABLES, or FOR TABLES IN SCHEMA of the extension's
# schema, would send their changes to every subscriber; one without the
# extension then stops applying, the application's tables with it (1.3:
# "relation idem_result does not exist").  The publication guard (an event
# trigger) refuses such a publication unless idempotency.publish_records is
# on.
#
# A. The guard, on a publisher (wal_level = logical, extension in schema
#    public, mode 'completed'):
#    - CREATE PUBLICATION ... FOR ALL TABLES, ... FOR TABLES IN SCHEMA
#      public and ALTER PUBLICATION ... ADD / SET TABLES IN SCHEMA public
#      are refused: 55000, the error names the publication and one of the
#      extension's tables, its HINT names idempotency.publish_records;
#    - a publication that names idem_result is allowed (the DBA chose it);
#    - FOR TABLE app (the application's own table) is allowed, and a
#      subscriber without the extension keeps replicating app while keys
#      are claimed, finished and replayed on the publisher: every row
#      arrives, the apply and sync error counts stay 0
#      (pg_stat_subscription_stats), the apply worker runs, the subscriber
#      logged no ERROR;
#    - in a database that already has a FOR ALL TABLES publication, CREATE
#      EXTENSION is refused (55000), and allowed with SET
#      idempotency.publish_records = on; ALTER EXTENSION UPDATE from 1.3
#      under such a publication is refused too.
# B. Blue-green: a subscriber WITH the extension (created there first,
#    mode 'completed'), a publication FOR ALL TABLES made with
#    idempotency.publish_records = on.  Keys are finished by an application
#    role, whose OID differs on the two clusters (records are namespaced by
#    role: a regrole goes across by name).  Completed records finished on
#    the publisher before the subscription (initial copy) and after it
#    (streaming) arrive.  Then the "switch": the subscription is disabled
#    and the clients go to the subscriber:
#    - every completed key replays the publisher's response, never 'new';
#    - a pending claim (committed, unfinished, no checkpoint) is NOT there:
#      in mode 'completed' claims live in the unlogged idem_record, which
#      is never published, so its retry on the subscriber gets 'new' and
#      runs the request again -- what the README says about pending claims
#      in a blue-green switch (finish or abandon them before switching);
#    - a pending claim with a checkpoint (kept in the logged idem_result in
#      mode 'completed') IS there: made with takeover => 'session', its
#      retry gets 'recover' at once (the session that made it is not on the
#      subscriber), with the checkpoint as response; made with a short
#      lease, its retry waits for the lease and then gets 'recover';
#    - their recovered tokens are greater than the publisher's tokens for
#      those keys, although the subscriber's own tokens are below them
#      (checked first, so that the rule is what is tested), and the
#      publisher's old token is fenced off on the subscriber (IK412).

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :bench);

# ---- the clusters ----

# The subscriber of part B, its extension installed and its first claim
# made before the publisher's: a new installation's first token epoch
# comes from the clock at its first claim, so green's own tokens are below
# the publisher's (B checks that the tokens it takes for replicated keys
# are above the publisher's nonetheless).
my $green = PostgreSQL::Test::Cluster->new('green');
$green->init;
$green->start;
$green->safe_psql('postgres', q{
	CREATE ROLE someone_else;
	CREATE ROLE app_user LOGIN;
	CREATE EXTENSION idempotency;
	CREATE TABLE app (key text PRIMARY KEY, token bigint NOT NULL, v text NOT NULL);
	GRANT SELECT, INSERT ON app TO app_user;
	SELECT count(*) FROM idem_begin('fresh', 'fresh-0', NULL);});

my $pub = PostgreSQL::Test::Cluster->new('publisher');
$pub->init(allows_streaming => 'logical');
$pub->start;
$pub->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE app (key text PRIMARY KEY, token bigint NOT NULL, v text NOT NULL);
});
is($pub->safe_psql('postgres', 'SELECT idem_durability()'), 'completed', 'publisher: mode completed');

# ========== A. the guard, and a subscriber without the extension ==========

# A refused command: its SQLSTATE, the publication and table its error
# names, and whether its HINT names idempotency.publish_records.
sub refused
{
	my ($node, $db, $sql) = @_;
	my ($st, $out, $err) = try_sql($node, $db, $sql);
	my ($pubname, $table) =
	  $err =~ /publication "([^"]+)" would publish the idempotency table "(idem_\w+)"/;
	my $hint = $err =~ /HINT:.*idempotency\.publish_records/ ? 'hint' : 'no hint';
	diag($err) if $st ne '55000';
	return join '|', $st, $pubname // '?', ($table // '') =~ /^idem_(mode|result)$/ ? 'table' : '?', $hint;
}

is(refused($pub, 'postgres', 'CREATE PUBLICATION p_all FOR ALL TABLES'),
	'55000|p_all|table|hint',
	'CREATE PUBLICATION FOR ALL TABLES is refused: it names an idempotency table, the HINT names publish_records');
is(refused($pub, 'postgres', 'CREATE PUBLICATION p_schema FOR TABLES IN SCHEMA public'),
	'55000|p_schema|table|hint',
	'CREATE PUBLICATION FOR TABLES IN SCHEMA public (the extension\'s schema) is refused');
is($pub->safe_psql('postgres', q{SELECT count(*) FROM pg_publication WHERE pubname IN ('p_all', 'p_schema')}),
	'0', 'the refused publications do not exist');

$pub->safe_psql('postgres', 'CREATE PUBLICATION p_alter FOR TABLE app');
is(refused($pub, 'postgres', 'ALTER PUBLICATION p_alter ADD TABLES IN SCHEMA public'),
	'55000|p_alter|table|hint', 'ALTER PUBLICATION ... ADD TABLES IN SCHEMA public is refused');
is($pub->safe_psql('postgres', q{SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_publication_tables WHERE pubname = 'p_alter'}),
	'app', 'the refused ALTER PUBLICATION left the publication as it was');
is(refused($pub, 'postgres', 'ALTER PUBLICATION p_alter SET TABLES IN SCHEMA public'),
	'55000|p_alter|table|hint', 'ALTER PUBLICATION ... SET TABLES IN SCHEMA public is refused');
$pub->safe_psql('postgres', 'DROP PUBLICATION p_alter');
{
	my ($st, $out, $err) = try_sql($pub, 'postgres', q{
		CREATE PUBLICATION p_named FOR TABLE app, idem_result;
		SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_publication_tables WHERE pubname = 'p_named';
		DROP PUBLICATION p_named;});
	is("$st|$out", '00000|app,idem_result',
		'a publication that names idem_result (FOR TABLE app, idem_result) is allowed without publish_records')
	  or diag($err);
}

$pub->safe_psql('postgres', 'CREATE PUBLICATION p_app FOR TABLE app');
is($pub->safe_psql('postgres', q{SELECT string_agg(schemaname || '.' || tablename, ',') FROM pg_publication_tables WHERE pubname = 'p_app'}),
	'public.app', 'the publication FOR TABLE app (the application\'s table) is allowed, and publishes app alone');

# a subscriber without the extension
my $plain = PostgreSQL::Test::Cluster->new('plain_subscriber');
$plain->init;
$plain->start;
$plain->safe_psql('postgres', 'CREATE TABLE app (key text PRIMARY KEY, token bigint NOT NULL, v text NOT NULL)');
my $pub_connstr = $pub->connstr . ' dbname=postgres';
$plain->safe_psql('postgres', "CREATE SUBSCRIPTION s_plain CONNECTION '$pub_connstr' PUBLICATION p_app");
$plain->wait_for_subscription_sync($pub, 's_plain');

# claims and finishes on the publisher: 'a-1'..'a-200', each in the
# transaction that writes its app row; every other one retried (a replay)
my $n_a = 200;
$pub->safe_psql('postgres', join "\n", map { qq{
	BEGIN;
	SELECT token FROM idem_begin('a', 'a-$_', idem_fingerprint($_)) \\gset
	INSERT INTO app VALUES ('a-$_', :token, 'effect $_');
	SELECT idem_finish('a', 'a-$_', :token, jsonb_build_object('v', 'effect $_'));
	COMMIT;} } 1 .. $n_a);
is($pub->safe_psql('postgres', qq{
	SELECT count(*) FROM generate_series(1, $n_a, 2) i, idem_begin('a', 'a-' || i, idem_fingerprint(i)) b
	 WHERE b.status = 'replay' AND b.response = jsonb_build_object('v', 'effect ' || i)}),
	$n_a / 2, 'publisher: the finished keys replay');
# a pending claim and a checkpoint (a write to the logged idem_result) too
my $t_cp = $pub->safe_psql('postgres', q{SELECT token FROM idem_begin('a', 'a-cp', NULL, lease => '1 h')});
$pub->safe_psql('postgres', qq{SELECT idem_checkpoint('a', 'a-cp', $t_cp, '{"step": 1}')});
$pub->safe_psql('postgres', q{INSERT INTO app VALUES ('after', 0, 'last')});
$pub->wait_for_catchup('s_plain');

is($plain->safe_psql('postgres', q{SELECT count(*) FROM app}), $n_a + 1,
	'subscriber without the extension: every app row arrived');
is($plain->safe_psql('postgres', q{SELECT count(*) FROM app WHERE v = 'effect ' || substr(key, 3)}),
	$n_a, 'subscriber without the extension: the rows are the publisher\'s');
is($plain->safe_psql('postgres', q{
	SELECT apply_error_count || '|' || sync_error_count FROM pg_stat_subscription_stats WHERE subname = 's_plain'}),
	'0|0', 'subscriber without the extension: no apply or sync error');
is($plain->safe_psql('postgres', q{
	SELECT count(*) FROM pg_stat_subscription WHERE subname = 's_plain' AND relid IS NULL AND pid IS NOT NULL}),
	'1', 'subscriber without the extension: the apply worker runs');
unlike(slurp_file($plain->logfile), qr/ERROR/, 'subscriber without the extension: no ERROR in its log');

# CREATE EXTENSION in a database that has a FOR ALL TABLES publication
$pub->safe_psql('postgres', 'CREATE DATABASE has_pub');
$pub->safe_psql('has_pub', 'CREATE TABLE t (i int PRIMARY KEY); CREATE PUBLICATION p_everything FOR ALL TABLES');
is(refused($pub, 'has_pub', 'CREATE EXTENSION idempotency'),
	'55000|p_everything|table|hint',
	'CREATE EXTENSION is refused while a FOR ALL TABLES publication exists');
is($pub->safe_psql('has_pub', q{SELECT count(*) FROM pg_extension WHERE extname = 'idempotency'}),
	'0', 'the refused extension is not installed');
{
	my ($st, $out, $err) = try_sql($pub, 'has_pub', q{
		SET idempotency.publish_records = on;
		CREATE EXTENSION idempotency;
		SELECT extversion FROM pg_extension WHERE extname = 'idempotency';});
	is("$st|$out", '00000|1.6', 'with idempotency.publish_records = on, CREATE EXTENSION is allowed')
	  or diag($err);
}

# ALTER EXTENSION UPDATE from 1.3 (no guard yet) under such a publication
$pub->safe_psql('postgres', 'CREATE DATABASE old_ext');
$pub->safe_psql('old_ext', q{
	CREATE EXTENSION idempotency VERSION '1.3';
	CREATE PUBLICATION p_old FOR ALL TABLES;});
is(refused($pub, 'old_ext', 'ALTER EXTENSION idempotency UPDATE'),
	'55000|p_old|table|hint', 'ALTER EXTENSION UPDATE (1.3 to the default) is refused under a FOR ALL TABLES publication');
is($pub->safe_psql('old_ext', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
	'1.3', 'the refused update left 1.3 installed');

# ========== B. blue-green: a subscriber with the extension ==========

# the application's role (on green it was created after another role, so
# that its OID differs there)
$pub->safe_psql('postgres', q{
	CREATE ROLE app_user LOGIN;
	GRANT SELECT, INSERT ON app TO app_user;});

is($green->safe_psql('postgres', 'SELECT idem_durability()'), 'completed', 'green: mode completed');
isnt($green->safe_psql('postgres', q{SELECT 'app_user'::regrole::oid}),
	$pub->safe_psql('postgres', q{SELECT 'app_user'::regrole::oid}),
	'the application role has another OID on green');

# in-transaction keys of app_user: BEGIN; idem_begin; app row; idem_finish; COMMIT
sub finish_keys
{
	my ($from, $to) = @_;
	$pub->safe_psql('postgres', join "\n", 'SET ROLE app_user;', map { qq{
		BEGIN;
		SELECT token FROM idem_begin('bg', 'bg-$_', idem_fingerprint($_)) \\gset
		INSERT INTO app VALUES ('bg-$_', :token, 'bg $_');
		SELECT idem_finish('bg', 'bg-$_', :token, jsonb_build_object('v', 'bg $_', 'token', :token));
		COMMIT;} } $from .. $to);
	return;
}

my $n_bg = 300;
finish_keys(1, $n_bg / 2);    # before the subscription: the initial copy

{
	my ($st, $out, $err) = try_sql($pub, 'postgres', q{
		SET idempotency.publish_records = on;
		CREATE PUBLICATION p_bg FOR ALL TABLES;});
	is($st, '00000', 'with idempotency.publish_records = on, a FOR ALL TABLES publication is allowed')
	  or diag($err);
}
is($pub->safe_psql('postgres', q{
	SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_publication_tables WHERE pubname = 'p_bg'}),
	'app,idem_mode,idem_result', 'p_bg publishes app and the logged idem_mode and idem_result (not idem_record)');
$green->safe_psql('postgres', "CREATE SUBSCRIPTION s_green CONNECTION '$pub_connstr' PUBLICATION p_bg");
$green->wait_for_subscription_sync($pub, 's_green');

finish_keys($n_bg / 2 + 1, $n_bg);    # after it: streamed

# pending claims of app_user on the publisher, committed and unfinished
my %t;    # the publisher's tokens
my $pub_s = $pub->background_psql('postgres', on_error_stop => 0);
{
	my ($out, $st) = run_sql($pub_s, q{
		SET ROLE app_user;
		SELECT token FROM idem_begin('bg', 'bg-pending', idem_fingerprint('pending'), lease => '1 h');});
	$t{pending} = $out;
	($out, $st) = run_sql($pub_s, q{
		SELECT token FROM idem_begin('bg', 'bg-cp-session', idem_fingerprint('cp-session'),
		                             lease => '1 h', takeover => 'session');});
	$t{session} = $out;
	($out, $st) = run_sql($pub_s, q{
		SELECT token FROM idem_begin('bg', 'bg-cp-lease', idem_fingerprint('cp-lease'), lease => '3 s');});
	$t{lease} = $out;
	($out, $st) = run_sql($pub_s, qq{
		SELECT idem_checkpoint('bg', 'bg-cp-session', $t{session}, '{"step": 2}');
		SELECT idem_checkpoint('bg', 'bg-cp-lease', $t{lease}, '{"step": 3}');});
	is($st, '00000', 'publisher: two pending claims recorded a checkpoint');
}
like(join(' ', values %t), qr/^\d+ \d+ \d+$/, 'publisher: three pending claims');
is($pub->safe_psql('postgres', q{
	SELECT string_agg(key || '=' || tbl, ',' ORDER BY key) FROM (
		SELECT key, 'record' AS tbl FROM idem_record WHERE key LIKE 'bg-%'
		UNION ALL SELECT key, 'result' FROM idem_result WHERE key LIKE 'bg-%' AND completed_at IS NULL) s}),
	'bg-cp-lease=result,bg-cp-session=result,bg-pending=record',
	'publisher: the claims with a checkpoint are in the logged idem_result, the other in idem_record');
$pub->wait_for_catchup('s_green');

is($green->safe_psql('postgres', q{
	SELECT count(*) FROM idem_result WHERE operation = 'bg' AND completed_at IS NOT NULL}),
	$n_bg, "green: the $n_bg completed records arrived (initial copy and streaming)");
is($green->safe_psql('postgres', q{SELECT count(*) FROM app WHERE key LIKE 'bg-%'}),
	$n_bg, 'green: and their app rows');
is($green->safe_psql('postgres', q{
	SELECT apply_error_count || '|' || sync_error_count FROM pg_stat_subscription_stats WHERE subname = 's_green'}),
	'0|0', 'green: no apply or sync error');

# ---- the switch: the subscription stops, the clients go to green ----

$green->safe_psql('postgres', 'ALTER SUBSCRIPTION s_green DISABLE');
ok($green->poll_query_until('postgres', q{
		SELECT count(*) = 0 FROM pg_stat_subscription WHERE subname = 's_green' AND pid IS NOT NULL}),
	'green: the subscription is stopped (the switch)');

# every completed key replays the publisher's response, as app_user
is($green->safe_psql('postgres', qq{
	SET ROLE app_user;
	SELECT count(*) FILTER (WHERE b.status = 'replay' AND a.token = (b.response->>'token')::bigint
	                          AND b.response->>'v' = a.v)
	       || '|' || count(*) FILTER (WHERE b.status = 'new') || '|' || count(*)
	  FROM app a, LATERAL idem_begin('bg', a.key, idem_fingerprint(substr(a.key, 4)::int)) b
	 WHERE a.key LIKE 'bg-%'}),
	"$n_bg|0|$n_bg", "green: every completed key ($n_bg) replays the publisher's response, none is new");
{
	my ($st, $out, $err) = try_sql($green, 'postgres', q{
		SET ROLE app_user;
		SELECT status FROM idem_begin('bg', 'bg-1', idem_fingerprint(2));});
	is($st, 'IK422', 'green: a replicated key retried with another fingerprint: IK422') or diag($err);
}

# the subscriber's own tokens are below the publisher's for these keys
my $green_token = $green->safe_psql('postgres', q{
	SELECT token FROM idem_begin('fresh', 'fresh-1', NULL)});
cmp_ok($green_token, '<', $t{session},
	"green: its own tokens ($green_token) are below the publisher's ($t{session}), so the next check matters");

# a pending claim without a checkpoint is not on green: mode 'completed'
# keeps claims in the unlogged idem_record, which no publication sends.
# Its retry gets 'new' and runs the request again: the README says to let
# pending claims finish (or abort them) before switching.
is($green->safe_psql('postgres', q{
	SET ROLE app_user;
	SELECT status FROM idem_begin('bg', 'bg-pending', idem_fingerprint('pending'), in_flight => 'raise')}),
	'new', 'green: a pending claim without a checkpoint was not replicated: its retry gets new');

# a pending claim with a checkpoint is, in idem_result; its session is not
# on green, so a 'session' claim lapses there at once
my ($rec_s, $rec_l);
{
	my ($st, $out, $err) = try_sql($green, 'postgres', q{
		SET ROLE app_user;
		SELECT status || '|' || token || '|' || response
		  FROM idem_begin('bg', 'bg-cp-session', idem_fingerprint('cp-session'), in_flight => 'raise')});
	($rec_s) = $out =~ /^recover\|(\d+)\|/;
	like("$st|$out", qr/^00000\|recover\|\d+\|\{"step": 2\}$/,
		'green: a replicated checkpointed session claim is recovered at once, with its checkpoint')
	  or diag($err);
}
cmp_ok($rec_s // 0, '>', $t{session}, 'green: the recovered token is greater than the publisher\'s token for the key');

# a checkpointed claim with a lease: recovered once the lease ends (the
# retry waits for it)
{
	my ($st, $out, $err) = try_sql($green, 'postgres', q{
		SET ROLE app_user;
		SELECT clock_timestamp() >= r.lease_until AS after_lease, b.status || '|' || b.token || '|' || b.response
		  FROM (SELECT lease_until FROM idem_inspect('bg', 'bg-cp-lease')) r,
		       LATERAL idem_begin('bg', 'bg-cp-lease', idem_fingerprint('cp-lease')) b});
	($rec_l) = $out =~ /\|recover\|(\d+)\|/;
	like("$st|$out", qr/^00000\|t\|recover\|\d+\|\{"step": 3\}$/,
		'green: a replicated checkpointed lease claim is recovered after its lease, with its checkpoint')
	  or diag($err);
}
cmp_ok($rec_l // 0, '>', $t{lease}, 'green: that recovered token is greater than the publisher\'s too');

# the publisher's worker, sent to green, is fenced off
{
	my ($st, $out, $err) = try_sql($green, 'postgres', qq{
		SET ROLE app_user;
		SELECT idem_finish('bg', 'bg-cp-session', $t{session}, '{"late": true}')});
	is($st, 'IK412', 'green: a finish with the publisher\'s old token is refused (IK412)') or diag($err);
}
is($green->safe_psql('postgres', qq{
	SET ROLE app_user;
	SELECT idem_finish('bg', 'bg-cp-session', $rec_s, '{"done": true}') \\gset
	SELECT status || '|' || response FROM idem_begin('bg', 'bg-cp-session', idem_fingerprint('cp-session'))}),
	'replay|{"done": true}', 'green: the new owner finishes the recovered key, and it replays');

$pub_s->quit;
is(join('', grep { /ERROR:/ && !/already used for a different request|does not hold idempotency key/ }
		split /^/, slurp_file($green->logfile)),
	'', 'green: no ERROR in its log but the two refusals above');
$green->stop;
$plain->stop;
$pub->stop;
done_testing();
