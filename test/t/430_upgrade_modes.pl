
# Copyright (c) 2024, idempotency authors
#
# ALTER EXTENSION UPDATE from 1.2 to 1.3 with records in flight, from both
# states of 1.2's record table, and the durability mode it arrives in.
#
# (a) database upg_unlogged: 1.2 with its default unlogged record table.
#     Completed records (external and in-transaction shape), one claim
#     committed and pending, and one claim uncommitted in an open
#     transaction while the update runs (the update waits for it, and the
#     claim finishes and commits meanwhile).  After the update: version
#     1.3, mode 'none' (both tables unlogged), every completed key replays,
#     the pending claim is finished with its token, tokens keep increasing.
#     Then idem_set_durability('completed') moves every completed record to
#     idem_result (logged), and a crash (immediate stop) afterwards keeps
#     them all: they replay.
# (b) database upg_logged: 1.2 made logged with idem_set_logged(true)
#     before the update.  After the update: mode 'all' (both tables
#     logged), completed keys replay; after the crash they still replay and
#     the pending claim is still held (IK409) and finishable with its token.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT try_sql token_of);

my $node = PostgreSQL::Test::Cluster->new('upgrade_modes');
$node->init;
$node->start;

# ---- helpers ----

# "status|token|response" of a claim of $key, or "ERROR sqlstate"
sub claim
{
	my ($db, $key, $extra) = @_;
	$extra = defined $extra ? ", $extra" : '';
	my ($st, $out, $err) = try_sql($node, $db, qq{
		SELECT status || '|' || coalesce(token::text, '') || '|' || coalesce(response::text, '')
		  FROM idem_begin('up', '$key', idem_fingerprint('$key')$extra) b});
	return $st eq '00000' ? $out : "ERROR $st";
}

sub persistence
{
	my ($db) = @_;
	return $node->safe_psql($db, q{SELECT string_agg(relname || '=' || relpersistence::text, ' ' ORDER BY relname)
		FROM pg_class WHERE relname IN ('idem_record', 'idem_result')});
}

# "key=response" of every key in @keys that replays, in order, joined by ' '
sub replays
{
	my ($db, @keys) = @_;
	return join ' ', map {
		my $c = claim($db, $_, q{in_flight => 'raise'});
		$c =~ /^replay\|\|(.*)$/ ? "$_=$1" : "$_:$c"
	} @keys;
}

# ---- 1.2, records in flight ----

my %want;       # $want{$db} = "key=response ..." of the completed keys
my %pending;    # $pending{$db} = token of the pending claim
my %maxtok;
for my $db (qw(upg_unlogged upg_logged))
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, q{
		CREATE EXTENSION idempotency VERSION '1.2';
		CREATE TABLE effect (id bigserial PRIMARY KEY, key text NOT NULL, token bigint NOT NULL);});
	is($node->safe_psql($db, q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
		'1.2', "$db: version 1.2 installed");
	is($node->safe_psql($db, q{SELECT to_regclass('idem_result') IS NULL}), 't', "$db: 1.2 has no idem_result");
	$node->safe_psql($db, 'SELECT idem_set_logged(true)') if $db eq 'upg_logged';
	is(persistence($db), 'idem_record=' . ($db eq 'upg_logged' ? 'p' : 'u'),
		"$db: the record table is " . ($db eq 'upg_logged' ? 'logged' : 'unlogged'));

	my @w;
	for my $i (1 .. 3)
	{
		my $t = token_of(claim($db, "done-$i"));
		$node->safe_psql($db, qq{SELECT idem_finish('up', 'done-$i', $t, '{"n": $i}')});
		push @w, qq{done-$i={"n": $i}};
	}
	my $fx_id = $node->safe_psql($db, q{
		BEGIN;
		SELECT token FROM idem_begin('up', 'fx', idem_fingerprint('fx')) b \gset
		INSERT INTO effect (key, token) VALUES ('fx', :token) RETURNING id AS fx_id \gset
		SELECT idem_finish('up', 'fx', :token, jsonb_build_object('effect_id', :fx_id)) \gset
		COMMIT;
		SELECT id FROM effect WHERE key = 'fx';});
	push @w, qq{fx={"effect_id": $fx_id}};
	$want{$db} = join ' ', @w;
	$pending{$db} = token_of(claim($db, 'pending', q{lease => '1 h'}));
	is(replays($db, qw(done-1 done-2 done-3 fx)), $want{$db}, "$db, 1.2: the completed keys replay");
	$maxtok{$db} = $node->safe_psql($db, 'SELECT max(token) FROM idem_record');
}

# (a) a claim uncommitted while the update runs
my $open = $node->background_psql('upg_unlogged', on_error_stop => 0);
my ($out, $state) = run_sql($open, q{
	BEGIN;
	SELECT token FROM idem_begin('up', 'open', idem_fingerprint('open')) b \gset
	INSERT INTO effect (key, token) VALUES ('open', :token);
	SELECT idem_finish('up', 'open', :token, '{"open": true}');});
is($state, '00000', 'upg_unlogged: a claim finished in a transaction still open');

# ---- the update ----

my $upd = $node->background_psql('upg_unlogged', on_error_stop => 0);
my ($upd_pid) = run_sql($upd, 'SELECT pg_backend_pid();');
send_sql($upd, 'ALTER EXTENSION idempotency UPDATE;');
ok( $node->poll_query_until('upg_unlogged', qq{
		SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $upd_pid}),
	'upg_unlogged: the update waits for the open transaction');
ok(!sql_done($upd), '... and has not finished');
($out, $state) = run_sql($open, 'COMMIT;');
is($state, '00000', 'upg_unlogged: the open transaction commits while the update waits');
($out, $state, my $err) = wait_sql($upd);
is($state, '00000', 'upg_unlogged: ALTER EXTENSION UPDATE completes') or diag($err);
$open->quit;
$upd->quit;
$want{upg_unlogged} .= ' open={"open": true}';

my ($st, $o, $e) = try_sql($node, 'upg_logged', 'ALTER EXTENSION idempotency UPDATE');
is($st, '00000', 'upg_logged: ALTER EXTENSION UPDATE completes') or diag($e);

# ---- after the update ----

my %keys = (upg_unlogged => [qw(done-1 done-2 done-3 fx open)], upg_logged => [qw(done-1 done-2 done-3 fx)]);
for my $db (qw(upg_unlogged upg_logged))
{
	my $mode = $db eq 'upg_logged' ? 'all' : 'none';
	my $p = $db eq 'upg_logged' ? 'p' : 'u';
	is($node->safe_psql($db, q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
		'1.6', "$db: version 1.6 (the default) after the update");
	is($node->safe_psql($db, 'SELECT idem_durability()'), $mode, "$db: the mode after the update is '$mode'");
	is(persistence($db), "idem_record=$p idem_result=$p", "$db: both tables " . ($p eq 'p' ? 'logged' : 'unlogged'));
	is(replays($db, @{ $keys{$db} }), $want{$db}, "$db, 1.3: every completed key replays its response");
	($st, $o, $e) = try_sql($node, $db, q{SELECT status FROM idem_begin('up', 'pending', idem_fingerprint('pending'), in_flight => 'raise')});
	is($st, 'IK409', "$db, 1.3: the claim pending across the update still holds its key") or diag($e);
	my $t = token_of(claim($db, 'fresh'));
	cmp_ok($t, '>', $maxtok{$db}, "$db, 1.3: a new token is greater than every token of 1.2");
	$node->safe_psql($db, qq{SELECT idem_finish('up', 'fresh', $t, '{"fresh": 1}')});
	$want{$db} .= ' fresh={"fresh": 1}';
	push @{ $keys{$db} }, 'fresh';
}

# (a) the pending claim is finished with its token
($st, $o, $e) = try_sql($node, 'upg_unlogged',
	qq{SELECT idem_finish('up', 'pending', $pending{upg_unlogged}, '{"late": true}')});
is($st, '00000', 'upg_unlogged: the claim pending across the update is finished with its 1.2 token') or diag($e);
$want{upg_unlogged} .= ' pending={"late": true}';
push @{ $keys{upg_unlogged} }, 'pending';
is(replays('upg_unlogged', 'pending'), 'pending={"late": true}', 'upg_unlogged: ... and replays');

# (a) to 'completed': the completed records move to idem_result
$node->safe_psql('upg_unlogged', q{SELECT idem_set_durability('completed')});
is($node->safe_psql('upg_unlogged', 'SELECT idem_durability()'), 'completed',
	'upg_unlogged: idem_set_durability(\'completed\')');
is(persistence('upg_unlogged'), 'idem_record=u idem_result=p', 'upg_unlogged: idem_record unlogged, idem_result logged');
is($node->safe_psql('upg_unlogged', q{
	SELECT (SELECT string_agg(key, ',' ORDER BY key) FROM idem_result WHERE completed_at IS NOT NULL)
	       || ' / ' || (SELECT count(*) FROM idem_record WHERE completed_at IS NOT NULL)}),
	'done-1,done-2,done-3,fresh,fx,open,pending / 0',
	'upg_unlogged: every completed record moved to idem_result, none left in idem_record');
is(replays('upg_unlogged', @{ $keys{upg_unlogged} }), $want{upg_unlogged},
	'upg_unlogged, completed: every completed key replays');
# (b) a claim pending at the crash
my $t_pend_b = $pending{upg_logged};

# ---- crash ----

$node->stop('immediate');
$node->start;

is($node->safe_psql('upg_unlogged', 'SELECT idem_durability()'), 'completed',
	'upg_unlogged, after the crash: mode completed');
is(replays('upg_unlogged', @{ $keys{upg_unlogged} }), $want{upg_unlogged},
	'upg_unlogged, after the crash: every completed record survived and replays its response');

is($node->safe_psql('upg_logged', 'SELECT idem_durability()'), 'all', 'upg_logged, after the crash: mode all');
is(replays('upg_logged', @{ $keys{upg_logged} }), $want{upg_logged},
	'upg_logged, after the crash: every completed record survived and replays its response');
($st, $o, $e) = try_sql($node, 'upg_logged', q{SELECT status FROM idem_begin('up', 'pending', idem_fingerprint('pending'), in_flight => 'raise')});
is($st, 'IK409', 'upg_logged, after the crash: the pending claim still holds its key') or diag($e);
($st, $o, $e) = try_sql($node, 'upg_logged', qq{SELECT idem_finish('up', 'pending', $t_pend_b, '{"late": "b"}')});
is($st, '00000', 'upg_logged, after the crash: ... and is finished with its 1.2 token') or diag($e);
is(replays('upg_logged', 'pending'), 'pending={"late": "b"}', 'upg_logged: ... and replays');

$node->stop;
done_testing();
