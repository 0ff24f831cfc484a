
# Copyright (c) 2024, idempotency authors
#
# Reads on a hot standby, and settings given before the library is loaded
# (issue 19, item 8).  No shared_preload_libraries: the library is loaded
# by each session's first call.
#
# 1. A primary with a streaming hot standby.
#    Mode 'completed' (a new installation's): the completed records are in
#    the logged idem_result, replicated; the claims are in the unlogged
#    idem_record, which a standby has no data of (1.3: idem_inspect and
#    idem_stats failed there, "cannot access temporary or unlogged
#    relations during recovery").  On the standby:
#    - idem_inspect of a completed key returns its row (state completed,
#      token, response, checkpoint NULL) and a NOTICE that pending claims
#      cannot be seen (its DETAIL: completed records are shown);
#    - idem_inspect of a pending key (no checkpoint: in idem_record) and
#      of an unknown key return no row, with the NOTICE, without an error;
#    - a pending claim with a checkpoint is in idem_result: it is shown,
#      pending, with its checkpoint;
#    - idem_stats counts the completed records per operation (and the
#      checkpointed claim as pending), with the NOTICE;
#    - writes are still refused: idem_begin fails.
#    Mode 'all' (both tables logged): the standby shows pending claims,
#    with no NOTICE.
#    Mode 'none' (both unlogged): idem_inspect of a completed key and
#    idem_stats return nothing, with the NOTICE (DETAIL: no record is
#    shown), no error.
# 2. Settings given before the library is loaded.  The documented rule is
#    that the library belongs in session_preload_libraries (or
#    shared_preload_libraries); a value that could not be checked when it
#    was given fails every call clearly, with 22023 naming it, while it is
#    in effect -- until the setting is assigned again (SET or RESET), or
#    what gave it is undone:
#    - a committed SET idempotency.lease = 'bogus' before the first call;
#    - a SET LOCAL idempotency.in_flight = 'rasie' in the transaction that
#      loads the library: 22023 there; after its rollback SHOW prints the
#      default and the next calls claim (one request's typo does not
#      poison a pooled connection);
#    - the same in a savepoint: ROLLBACK TO SAVEPOINT undoes it;
#    - a SET 'bogus' in a transaction that loads the library and commits
#      (its error rolled back to a savepoint): the value stays the
#      session's, and the calls after the commit still fail, until RESET;
#    - a function's SET clause 'rasie': its call fails, a call after it
#      claims;
#    - a valid value set before the load is used (lease 7 s);
#    - with session_preload_libraries: SET of a bogus value fails at once
#      (22023, nothing changes); an ALTER ROLE ... SET bogus made before the
#      library was preloaded fails every call of that role's sessions with
#      22023, until the session sets a valid value.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :bench);

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
$primary->start;
$primary->safe_psql('postgres', 'CREATE EXTENSION idempotency');
$primary->backup('b');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'b', has_streaming => 1);
$standby->start;

# ========== 1. reads on the standby ==========

# $sql on the standby: "stdout|notice" -- the NOTICE's message and DETAIL,
# or "no notice"; dies on an error
sub on_standby
{
	my ($sql) = @_;
	my ($st, $out, $err) = try_sql($standby, 'postgres', $sql);
	die "on the standby: $sql: $st $err" if $st ne '00000';
	my $notice = 'no notice';
	if ($err =~ /NOTICE:\s+(?:00000: )?(.*)\n(?:.*\n)*?DETAIL:\s+(.*)/)
	{
		my ($msg, $detail) = ($1, $2);
		$notice = "$msg / " . ($detail =~ /Completed records, which are logged, are shown/ ? 'completed shown'
		                     : $detail =~ /no record is shown/ ? 'none shown' : $detail);
	}
	return "$out|$notice";
}
my $hidden = 'pending idempotency claims cannot be seen during recovery';

is($primary->safe_psql('postgres', 'SELECT idem_durability()'), 'completed', 'primary: mode completed');
my $t_done = token_of(claim($primary, 'postgres', 'done-1'));
$primary->safe_psql('postgres', qq{SELECT idem_finish('det', 'done-1', $t_done, '{"r": 1}')});
for my $k (2 .. 5)
{
	my $t = token_of(claim($primary, 'postgres', "done-$k"));
	$primary->safe_psql('postgres', qq{SELECT idem_finish('det', 'done-$k', $t, '{"r": $k}')});
}
my $t_pending = token_of(claim($primary, 'postgres', 'pending', q{lease => '1 h'}));
my $t_cp = token_of(claim($primary, 'postgres', 'pending-cp', q{lease => '1 h'}));
$primary->safe_psql('postgres', qq{SELECT idem_checkpoint('det', 'pending-cp', $t_cp, '{"step": 1}')});
$primary->wait_for_catchup($standby, 'replay');

is(on_standby(q{
	SELECT state || ',' || token || ',' || response || ',' || (checkpoint IS NULL) || ',' || uncommitted
	  FROM idem_inspect('det', 'done-1')}),
	"completed,$t_done,{\"r\": 1},true,false|$hidden / completed shown",
	'standby, completed: idem_inspect of a completed key returns its row, with the NOTICE');
is(on_standby(q{SELECT count(*) FROM idem_inspect('det', 'pending')}),
	"0|$hidden / completed shown",
	'standby, completed: a pending claim (in idem_record) is not seen, no error, the NOTICE says so');
is(on_standby(q{SELECT count(*) FROM idem_inspect('det', 'never')}),
	"0|$hidden / completed shown", 'standby, completed: an unknown key: no row, no error');
is(on_standby(q{
	SELECT state || ',' || token || ',' || checkpoint FROM idem_inspect('det', 'pending-cp')}),
	"pending,$t_cp,{\"step\": 1}|$hidden / completed shown",
	'standby, completed: a pending claim with a checkpoint (in idem_result) is seen, with it');
is(on_standby(q{
	SELECT operation || ',' || pending || ',' || lapsed || ',' || completed || ',' || expired FROM idem_stats}),
	"det,1,0,5,0|$hidden / completed shown",
	'standby, completed: idem_stats counts the 5 completed records (and the checkpointed claim), with the NOTICE');
{
	my ($st, $out, $err) = try_sql($standby, 'postgres', q{SELECT idem_begin('det', 'new-on-standby', NULL)});
	is($st, '25006', 'standby: a claim is refused (read-only transaction)') or diag($err);
}

# mode 'all': everything is logged, the standby sees the claims
$primary->safe_psql('postgres', q{SELECT idem_set_durability('all')});
$primary->wait_for_catchup($standby, 'replay');
is(on_standby(q{SELECT string_agg(state || ',' || token, ';') FROM idem_inspect('det', 'pending')}),
	"pending,$t_pending|no notice",
	'standby, all: idem_inspect shows the pending claim, no NOTICE');
is(on_standby(q{
	SELECT operation || ',' || pending || ',' || completed FROM idem_stats}),
	'det,2,5|no notice', 'standby, all: idem_stats counts every record, no NOTICE');

# mode 'none': nothing is logged, the standby has no record at all
$primary->safe_psql('postgres', q{SELECT idem_set_durability('none')});
$primary->wait_for_catchup($standby, 'replay');
is($standby->safe_psql('postgres', q{
	SELECT string_agg(relpersistence::text, '|' ORDER BY relname)
	  FROM pg_class WHERE relname IN ('idem_record', 'idem_result')}),
	'u|u', 'standby, none: both tables are unlogged');
is(on_standby(q{SELECT count(*) FROM idem_inspect('det', 'done-1')}),
	"0|$hidden / none shown",
	'standby, none: idem_inspect of a completed key returns nothing, with the NOTICE, no error');
is(on_standby(q{SELECT count(*) FROM idem_stats}),
	"0|$hidden / none shown", 'standby, none: idem_stats returns nothing, with the NOTICE, no error');
is($primary->safe_psql('postgres', q{SELECT state || ',' || response FROM idem_inspect('det', 'done-1')}),
	'completed,{"r": 1}', 'primary, none: the record is there');

$standby->stop;

# ========== 2. settings given before the library is loaded ==========

# each case in a new session, so that its first call loads the library
sub new_session
{
	my $s = $primary->background_psql('postgres', on_error_stop => 0);
	my ($out) = run_sql($s, q{SELECT count(*) FROM pg_stat_activity WHERE false;});
	return $s;
}
sub state_of { my (undef, $st) = run_sql(@_); return $st; }

my $claim_sql = q{SELECT status FROM idem_begin('set', 'k' || nextval('kseq'), NULL);};
$primary->safe_psql('postgres', 'CREATE SEQUENCE kseq');

{
	my $s = new_session();
	is(state_of($s, 'BEGIN;'), '00000', 'SET LOCAL case: BEGIN');
	is(state_of($s, q{SET LOCAL idempotency.in_flight = 'rasie';}), '00000',
		'SET LOCAL idempotency.in_flight = rasie before the library is loaded is accepted (a placeholder)');
	is(state_of($s, $claim_sql), '22023', 'the call that loads the library: 22023 (invalid in_flight)');
	is(state_of($s, 'ROLLBACK;'), '00000', 'ROLLBACK');
	my ($out, $st) = run_sql($s, q{SHOW idempotency.in_flight;});
	is("$st|$out", '00000|wait', 'after the rollback SHOW prints the default');
	($out, $st) = run_sql($s, $claim_sql);
	is("$st|$out", '00000|new', 'after the rollback the session claims: the rolled-back value poisons nothing');
	($out, $st) = run_sql($s, $claim_sql);
	is("$st|$out", '00000|new', 'and the next call too');
	$s->quit;
}
{
	my $s = new_session();
	is(state_of($s, 'BEGIN; SAVEPOINT a;'), '00000', 'savepoint case: BEGIN, SAVEPOINT');
	is(state_of($s, q{SET LOCAL idempotency.lease = 'bogus';}), '00000', 'SET LOCAL idempotency.lease = bogus');
	is(state_of($s, $claim_sql), '22023', 'the call that loads the library: 22023');
	is(state_of($s, 'ROLLBACK TO SAVEPOINT a;'), '00000', 'ROLLBACK TO SAVEPOINT');
	my ($out, $st) = run_sql($s, $claim_sql);
	is("$st|$out", '00000|new', 'after the rollback to the savepoint the transaction claims');
	is(state_of($s, 'COMMIT;'), '00000', 'COMMIT');
	$s->quit;
}
{
	my $s = new_session();
	is(state_of($s, q{BEGIN; SET idempotency.lease = 'bogus'; SAVEPOINT a;}), '00000',
		'committed-in-transaction case: BEGIN, SET, SAVEPOINT');
	is(state_of($s, $claim_sql), '22023', 'the call that loads the library: 22023');
	is(state_of($s, 'ROLLBACK TO SAVEPOINT a; COMMIT;'), '00000', 'ROLLBACK TO SAVEPOINT, COMMIT: the SET stays');
	is(state_of($s, $claim_sql), '22023', 'after the commit: still 22023 (the bogus value is the session\'s)');
	is(state_of($s, 'RESET idempotency.lease;'), '00000', 'RESET idempotency.lease');
	my ($out, $st) = run_sql($s, $claim_sql);
	is("$st|$out", '00000|new', 'after the RESET the session claims');
	$s->quit;
}
$primary->safe_psql('postgres', q{
	CREATE FUNCTION claim_rasie() RETURNS text LANGUAGE sql
	  SET idempotency.in_flight = 'rasie'
	  AS $$ SELECT status FROM idem_begin('set', 'k' || nextval('kseq'), NULL) $$;});
{
	my $s = new_session();
	is(state_of($s, q{SELECT claim_rasie();}), '22023',
		'a function whose SET clause is invalid, loading the library: 22023');
	my ($out, $st) = run_sql($s, $claim_sql);
	is("$st|$out", '00000|new', 'a call after that function claims');
	$s->quit;
}
{
	my $s = new_session();
	is(state_of($s, q{SET idempotency.lease = 'bogus';}), '00000', 'a committed SET idempotency.lease = bogus');
	is(state_of($s, $claim_sql), '22023', 'the call that loads the library: 22023');
	is(state_of($s, $claim_sql), '22023', 'the next call: still 22023 (the setting is still bogus)');
	is(state_of($s, 'RESET idempotency.lease;'), '00000', 'RESET idempotency.lease');
	my ($out, $st) = run_sql($s, $claim_sql);
	is("$st|$out", '00000|new', 'after the RESET the session claims');
	$s->quit;
}
{
	my $s = new_session();
	is(state_of($s, q{SET idempotency.lease = '7 s';}), '00000', 'a valid SET idempotency.lease before the load');
	my ($out, $st) = run_sql($s, q{
		SELECT status FROM idem_begin('set', 'seven', NULL);
		SELECT extract(epoch FROM lease_until - created_at) FROM idem_inspect('set', 'seven');});
	is("$st|$out", "00000|new\n7.000000", 'it is used by the call that loads the library: a 7 s lease');
	$s->quit;
}

# ---- with session_preload_libraries ----
$primary->safe_psql('postgres', q{
	CREATE ROLE idem_preload LOGIN;
	GRANT USAGE ON SEQUENCE kseq TO idem_preload;
	ALTER ROLE idem_preload SET idempotency.in_flight = 'rasie';});
$primary->append_conf('postgresql.conf', "session_preload_libraries = 'idempotency'");
$primary->reload;
{
	my $s = new_session();
	my ($out, $st) = run_sql($s, q{SET idempotency.lease = 'bogus';});
	is($st, '22023', 'preloaded: SET of a bogus lease fails when it is made');
	($out, $st) = run_sql($s, q{SHOW idempotency.lease;});
	is("$st|$out", '00000|30s', 'and the lease is unchanged');
	($out, $st) = run_sql($s, $claim_sql);
	is("$st|$out", '00000|new', 'and the session claims');
	$s->quit;
}
{
	my $s = $primary->background_psql('postgres', on_error_stop => 0,
		extra_params => [ '-U', 'idem_preload' ]);
	my ($out, $st) = run_sql($s, $claim_sql);
	is($st, '22023', 'preloaded: a bogus ALTER ROLE value given before the preload fails the call with 22023');
	is(state_of($s, q{SET idempotency.in_flight = 'raise';}), '00000', 'a valid SET');
	($out, $st) = run_sql($s, $claim_sql);
	is("$st|$out", '00000|new', 'then the role claims');
	$s->quit;
}

$primary->stop;
done_testing();
