# Copyright (c) 2024, idempotency authors
#
# Checkpoints and remembered keys (version 1.4) across a crash in each
# durability mode, and a checkpoint across a fail-over to a synchronous
# standby.
#
# 1. One cluster, one database per mode (ck_none, ck_completed, ck_all).
#    Per database, all committed before the crash (operation 'det', each
#    key's fingerprint that of the key):
#      cp-lease    claim with a 1 s lease, two checkpoints ({"step": 1},
#                  then {"step": 2}: the last one counts)
#      cp-session  claim with takeover => 'session' and a 1 h lease, made by
#                  a session that stays connected until the crash, with a
#                  checkpoint {"step": "s"}
#      plain-lease claim with a 1 h lease, no checkpoint
#      plain-sess  claim with takeover => 'session' (the same session), no
#                  checkpoint
#      cp-done     claim, checkpoint, finish (the finish clears the
#                  checkpoint)
#    Before the crash: in 'completed' the claims with a checkpoint are in
#    the logged idem_result, the others in idem_record; both session claims
#    hold their keys while their session lives (IK409).
#    After the crash (immediate stop, start):
#      completed, all: cp-lease, retried once its lease is over ('wait'),
#        gets 'recover' with {"step": 2} and a greater token (that retry
#        claims with takeover => 'session': its claim lapses as its psql
#        exits, and its 1 h lease keeps it from the purges); cp-session
#        gets 'recover' with {"step": "s"} at once (in_flight => 'raise':
#        its session died in the crash, nothing to wait for); the old
#        tokens are refused by idem_finish and idem_checkpoint (IK412);
#        cp-done replays its response, with no checkpoint left.
#      none: every key is gone: 'new', no state.
#      plain-*: as in 1.3 -- lost in 'none' and 'completed' ('new', no
#        takeover), kept in 'all': plain-lease still held (IK409),
#        plain-sess taken over at once ('new', takeovers = 1: no
#        checkpoint, so no 'recover').
#    A second crash, the recovered cp-lease claim left pending: in
#    'completed' and 'all' the next retry recovers again at once, the same
#    state, takeovers = 2 (the checkpoint is kept across takeovers, in the
#    logged table).
# 2. Remembered keys across purge and the second crash, per mode: rem
#    finished with ttl 1 min and remember 1 h, rem-off with ttl 1 min
#    only.  Time is moved by the superuser updating expires_at (the end of
#    the retention) and later forget_at (the end of remembering) in the
#    record tables -- the test cannot wait an hour.  After the ttl: rem is
#    'remembered' (IK410 with its fingerprint, IK422 with another), rem-off
#    is new.  idem_purge drops rem's response and keeps its row (still
#    IK410).  After the crash: kept in 'completed' and 'all' (IK410), gone
#    in 'none' ('new').  After remember: idem_purge deletes the row and the
#    key is new.
#    cp-purge, per mode: a claim with a checkpoint whose lease lapsed
#    (expires_at moved by the superuser), not yet taken over, when
#    idem_purge runs: the retry after the purge must still get 'recover'
#    with the checkpoint -- the state a retry resumes from cannot depend on
#    whether the purge worker ran in between.
# 3. A primary in mode 'completed' with a synchronous standby: a claim
#    with a checkpoint (a session claim, its session open) and one without,
#    committed on the primary; the primary stops (immediate), the standby
#    is promoted.  The checkpointed claim recovers there at once with its
#    state and a greater token; the old token gets IK412; the claim
#    without a checkpoint was lost ('new').

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :bench);

my @modes = qw(none completed all);
my %persistence = (none => 'u|u', completed => 'u|p', all => 'p|p');   # idem_record|idem_result
my $durable = sub { $_[0] ne 'none' };

my $node = PostgreSQL::Test::Cluster->new('checkpoint_durability');
$node->init;
$node->start;

# ---- helpers ----

sub db_of { return "ck_$_[0]"; }

sub sql
{
	my ($mode, $sql) = @_;
	return $node->safe_psql(db_of($mode), $sql);
}

# the sqlstate of $sql in $mode's database (00000: success)
sub state_of
{
	my ($n, $mode, $sql) = @_;
	my ($st, $out, $err) = try_sql($n, db_of($mode), $sql);
	return $st;
}

# "status|token|response" of a claim, as IdemTest's claim
sub ck_claim
{
	my ($mode, $key, $extra) = @_;
	return claim($node, db_of($mode), $key, $extra);
}

# "state|checkpoint|takeovers" of idem_inspect, '' without a record
sub inspect
{
	my ($n, $db, $key) = @_;
	return $n->safe_psql($db, qq{
		SELECT state || '|' || coalesce(checkpoint::text, '') || '|' || takeovers
		  FROM idem_inspect('det', '$key')});
}

# the table holding $key's record: idem_record, idem_result or ''
sub table_of
{
	my ($n, $db, $key) = @_;
	return $n->safe_psql($db, qq{
		SELECT string_agg(t, ',') FROM (
			SELECT 'idem_record' t FROM idem_record WHERE key = '$key'
			UNION ALL SELECT 'idem_result' FROM idem_result WHERE key = '$key') s});
}

# ========== 1. checkpoints across a crash ==========

my (%tok, %sess);    # $tok{$mode}{key}: the token before the crash
for my $mode (@modes)
{
	my $db = db_of($mode);
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	sql($mode, qq{CREATE EXTENSION idempotency; SELECT idem_set_durability('$mode');});
	is(sql($mode, 'SELECT idem_durability()'), $mode, "$mode: idem_durability() reports the mode");
	is(sql($mode, q{SELECT string_agg(relpersistence::text, '|' ORDER BY relname)
		FROM pg_class WHERE relname IN ('idem_record', 'idem_result')}),
		$persistence{$mode}, "$mode: idem_record|idem_result persistence is $persistence{$mode}");

	# cp-lease: two checkpoints, each committed
	my $t = $tok{$mode}{'cp-lease'} = token_of(ck_claim($mode, 'cp-lease', q{lease => '1 s'}));
	sql($mode, qq{SELECT idem_checkpoint('det', 'cp-lease', $t, '{"step": 1}')});
	sql($mode, qq{SELECT idem_checkpoint('det', 'cp-lease', $t, '{"step": 2}')});

	# plain-lease
	$tok{$mode}{'plain-lease'} = token_of(ck_claim($mode, 'plain-lease', q{lease => '1 h'}));

	# cp-done: a checkpoint, then the finish
	$t = $tok{$mode}{'cp-done'} = token_of(ck_claim($mode, 'cp-done'));
	sql($mode, qq{SELECT idem_checkpoint('det', 'cp-done', $t, '{"step": "d"}')});
	sql($mode, qq{SELECT idem_finish('det', 'cp-done', $t, '{"done": true}')});

	# the session claims, by a session that stays until the crash
	my $s = $sess{$mode} = $node->background_psql($db, on_error_stop => 0);
	for my $key (qw(cp-session plain-sess))
	{
		my ($out, $st, $err) = run_sql($s, qq{
			SELECT token FROM idem_begin('det', '$key', idem_fingerprint('$key'),
			                             lease => '1 h', takeover => 'session');});
		is($st, '00000', "$mode: $key claimed by a session that stays connected") or diag($err);
		$tok{$mode}{$key} = $out;
	}
	my ($out, $st, $err) = run_sql($s,
		qq{SELECT idem_checkpoint('det', 'cp-session', $tok{$mode}{'cp-session'}, '{"step": "s"}');});
	is($st, '00000', "$mode: cp-session's checkpoint is committed") or diag($err);

	# (its 1 s lease may be over by now: pending or lapsed, either way no takeover yet)
	like(inspect($node, $db, 'cp-lease'), qr/^(pending|lapsed)\|\{"step": 2\}\|0$/,
		"$mode: cp-lease holds its last checkpoint");
	is(inspect($node, $db, 'cp-done'), 'completed||0', "$mode: cp-done's finish cleared its checkpoint");
	for my $key (qw(cp-session plain-sess))
	{
		is(state_of($node, $mode, qq{SELECT * FROM idem_begin('det', '$key', idem_fingerprint('$key'),
			in_flight => 'raise')}), 'IK409', "$mode: $key is held while its session lives");
	}
	if ($mode eq 'completed')
	{
		is(join(' ', map { "$_:" . table_of($node, $db, $_) } qw(cp-lease cp-session cp-done plain-lease plain-sess)),
			'cp-lease:idem_result cp-session:idem_result cp-done:idem_result '
			  . 'plain-lease:idem_record plain-sess:idem_record',
			'completed: the claims with a checkpoint and the finished record are in the logged idem_result, '
			  . 'the other claims in idem_record');
	}
	else
	{
		is(sql($mode, 'SELECT count(*) FROM idem_result'), '0', "$mode: idem_result is empty, all is in idem_record");
	}
}

# every token of the epoch in use before the crash is below this
my %bound = map { $_ => sql($_, q{SELECT ((last_value >> 25) + 1) << 25 FROM idem_token_seq}) } @modes;

$node->stop('immediate');
eval { $sess{$_}->quit } for @modes;
$node->start;

for my $mode (@modes)
{
	my $db = db_of($mode);
	is(sql($mode, 'SELECT idem_durability()'), $mode, "$mode, after the crash: the mode is unchanged");

	# cp-lease: once its lease is over (the retry waits for it if need be).
	# The recovering claim is a session claim: it lapses when its psql
	# exits, and no purge deletes it before the second crash (its lease is
	# an hour).
	my $c = ck_claim($mode, 'cp-lease', q{in_flight => 'wait', lease => '1 h', takeover => 'session'});
	my ($status, $t, $resp) = split /\|/, $c, 3;
	if ($durable->($mode))
	{
		is("$status|$resp", 'recover|{"step": 2}',
			"$mode: cp-lease, retried after its lease, recovers with its last checkpoint");
		cmp_ok($t, '>', $tok{$mode}{'cp-lease'}, "$mode: cp-lease: the recovering token is greater");
		$tok{$mode}{'cp-lease-2'} = $t;
		# its backend exits a moment after psql does
		$node->poll_query_until($db, q{SELECT state = 'lapsed' FROM idem_inspect('det', 'cp-lease')});
		is(inspect($node, $db, 'cp-lease'), 'lapsed|{"step": 2}|1',
			"$mode: cp-lease: the new owner's claim keeps the checkpoint, one takeover, "
			  . 'and lapsed with the session that made it');
		is(table_of($node, $db, 'cp-lease'), $mode eq 'completed' ? 'idem_result' : 'idem_record',
			"$mode: cp-lease: the new owner's claim, with the checkpoint, is in the logged table");

		# cp-session: its session died in the crash: no wait at all
		$c = ck_claim($mode, 'cp-session', q{in_flight => 'raise'});
		($status, $t, $resp) = split /\|/, $c, 3;
		is("$status|$resp", 'recover|{"step": "s"}',
			"$mode: cp-session, its session gone in the crash, recovers at once (raise) with its checkpoint");
		cmp_ok($t, '>', $tok{$mode}{'cp-session'}, "$mode: cp-session: the recovering token is greater");
		is(state_of($node, $mode, qq{SELECT idem_finish('det', 'cp-session', $tok{$mode}{'cp-session'}, '{}')}),
			'IK412', "$mode: cp-session: the old owner's idem_finish is refused (IK412)");
		is(state_of($node, $mode, qq{SELECT idem_checkpoint('det', 'cp-lease', $tok{$mode}{'cp-lease'}, '{"step": 3}')}),
			'IK412', "$mode: cp-lease: the old owner's idem_checkpoint is refused (IK412)");
		sql($mode, qq{SELECT idem_finish('det', 'cp-session', $t, '{"resumed": "s"}')});
		is(ck_claim($mode, 'cp-session'), 'replay||{"resumed": "s"}', "$mode: cp-session: the new owner finishes it");
		is(inspect($node, $db, 'cp-session'), 'completed||1', "$mode: cp-session: the finish cleared the checkpoint");

		is(ck_claim($mode, 'cp-done'), 'replay||{"done": true}', "$mode: cp-done replays its response");
	}
	else
	{
		like($c, qr/^new\|\d+\|$/, 'none: cp-lease is gone: new, no state');
		like(ck_claim($mode, 'cp-session', q{in_flight => 'raise'}), qr/^new\|\d+\|$/,
			'none: cp-session is gone: new, no state');
		like(ck_claim($mode, 'cp-done', q{in_flight => 'raise'}), qr/^new\|\d+\|$/,
			'none: cp-done is gone: new');
		$tok{$mode}{'cp-lease-2'} = (split /\|/, $c)[1];
	}

	# the claims without a checkpoint, as in 1.3
	if ($mode eq 'all')
	{
		is(state_of($node, $mode, q{SELECT * FROM idem_begin('det', 'plain-lease', idem_fingerprint('plain-lease'),
			in_flight => 'raise')}), 'IK409', 'all: plain-lease is still held after the crash (IK409)');
		$c = ck_claim($mode, 'plain-sess', q{in_flight => 'raise'});
		like($c, qr/^new\|\d+\|$/, 'all: plain-sess, its session gone, is taken over at once: new (no checkpoint)');
		is(inspect($node, $db, 'plain-sess'), 'pending||1', 'all: plain-sess: one takeover, no checkpoint');
	}
	else
	{
		for my $key (qw(plain-lease plain-sess))
		{
			like(ck_claim($mode, $key, q{in_flight => 'raise'}), qr/^new\|\d+\|$/,
				"$mode: $key (a claim without a checkpoint) was lost: new");
			is(inspect($node, $db, $key), 'pending||0', "$mode: $key: a fresh claim, no takeover");
		}
	}
	# the claims made since the crash: above every token before it
	is(sql($mode, qq{SELECT count(*) FILTER (WHERE token < $bound{$mode}) || '|' || count(*)
		FROM $IDEM_RECORDS r WHERE created_at > pg_postmaster_start_time()}),
		'0|' . ($durable->($mode) ? ($mode eq 'all' ? 3 : 4) : 5),
		"$mode: every claim since the crash has a token above every token before it");
}

# ========== 2. remembered keys: set-up, the ttl over ==========

for my $mode (@modes)
{
	my $t = token_of(ck_claim($mode, 'rem', q{ttl => '1 min', remember => '1 h'}));
	sql($mode, qq{SELECT idem_finish('det', 'rem', $t, '{"rem": 1}')});
	$t = token_of(ck_claim($mode, 'rem-off', q{ttl => '1 min'}));
	sql($mode, qq{SELECT idem_finish('det', 'rem-off', $t, '{"rem": 0}')});
	is(ck_claim($mode, 'rem'), 'replay||{"rem": 1}', "$mode: rem replays within its ttl");

	# Moving time: the superuser ends the retention of both records now,
	# as if their ttl (1 minute) had passed; rem stays remembered (1 h).
	sql($mode, q{
		UPDATE idem_record SET expires_at = now() - interval '1 s' WHERE key IN ('rem', 'rem-off');
		UPDATE idem_result SET expires_at = now() - interval '1 s' WHERE key IN ('rem', 'rem-off');});
	is(state_of($node, $mode, q{SELECT * FROM idem_begin('det', 'rem', idem_fingerprint('rem'))}),
		'IK410', "$mode: rem after its ttl, within remember: IK410");
	is(state_of($node, $mode, q{SELECT * FROM idem_begin('det', 'rem', idem_fingerprint('other'))}),
		'IK422', "$mode: rem with another fingerprint: IK422");
	is(sql($mode, q{SELECT state || '|' || (remembered_until > now() + interval '50 min')
		FROM idem_inspect('det', 'rem')}), 'remembered|true', "$mode: idem_inspect: rem is remembered");
	like(ck_claim($mode, 'rem-off'), qr/^new\|\d+\|$/, "$mode: rem-off (no remember) after its ttl: new");

	# cp-purge: a claim with a checkpoint whose lease lapsed (time moved
	# by the superuser as above) and that nobody has taken over yet
	$t = token_of(ck_claim($mode, 'cp-purge', q{lease => '1 h'}));
	sql($mode, qq{SELECT idem_checkpoint('det', 'cp-purge', $t, '{"step": "p"}');
		UPDATE idem_record SET expires_at = now() - interval '1 s' WHERE key = 'cp-purge';
		UPDATE idem_result SET expires_at = now() - interval '1 s' WHERE key = 'cp-purge';});
	is(inspect($node, db_of($mode), 'cp-purge'), 'lapsed|{"step": "p"}|0',
		"$mode: cp-purge is lapsed, with its checkpoint");

	sql($mode, 'SELECT idem_purge()');
	is(sql($mode, qq{SELECT count(*) || '|' || bool_and(response IS NULL) || '|' || bool_and(completed_at IS NOT NULL)
		FROM $IDEM_RECORDS r WHERE key = 'rem'}), '1|true|true',
		"$mode: idem_purge dropped rem's response and kept its row");
	is(state_of($node, $mode, q{SELECT * FROM idem_begin('det', 'rem', idem_fingerprint('rem'))}),
		'IK410', "$mode: rem after the purge: still IK410");

	# The checkpoint is the state a retry resumes from: a purge between
	# the lapse and the retry must not turn 'recover' into 'new' (the
	# purge worker runs every minute; a client may retry much later).
	my ($status, $t2, $resp) = split /\|/, ck_claim($mode, 'cp-purge'), 3;
	is("$status|$resp", 'recover|{"step": "p"}',
		"$mode: cp-purge, lapsed with a checkpoint, still recovers after idem_purge");
	cmp_ok($t2, '>', $t, "$mode: cp-purge: with a greater token");
}

# ========== the second crash ==========

$node->stop('immediate');
$node->start;

for my $mode (@modes)
{
	my $db = db_of($mode);
	if ($durable->($mode))
	{
		my $c = ck_claim($mode, 'cp-lease', q{in_flight => 'raise'});
		my ($status, $t, $resp) = split /\|/, $c, 3;
		is("$status|$resp", 'recover|{"step": 2}',
			"$mode, second crash: cp-lease recovers again (raise: at once) with the same checkpoint");
		cmp_ok($t, '>', $tok{$mode}{'cp-lease-2'}, "$mode, second crash: with a token greater than the first recovery's");
		is(inspect($node, $db, 'cp-lease'), 'pending|{"step": 2}|2', "$mode, second crash: two takeovers");
		sql($mode, qq{SELECT idem_finish('det', 'cp-lease', $t, '{"step": "end"}')});
		is(inspect($node, $db, 'cp-lease'), 'completed||2', "$mode: the finish cleared the checkpoint");

		is(state_of($node, $mode, q{SELECT * FROM idem_begin('det', 'rem', idem_fingerprint('rem'))}),
			'IK410', "$mode, second crash: the remembered key rem survived: IK410");
	}
	else
	{
		like(ck_claim($mode, 'cp-lease', q{in_flight => 'raise'}), qr/^new\|\d+\|$/,
			'none, second crash: cp-lease is gone again: new');
		like(ck_claim($mode, 'rem', q{in_flight => 'raise'}), qr/^new\|\d+\|$/,
			'none, second crash: the remembered key rem is gone: new');
	}
}

# ========== remembering over ==========

for my $mode (grep { $durable->($_) } @modes)
{
	# Moving time again: the superuser ends rem's remembering now, as if
	# its hour had passed.
	sql($mode, q{
		UPDATE idem_record SET forget_at = now() - interval '1 s' WHERE key = 'rem';
		UPDATE idem_result SET forget_at = now() - interval '1 s' WHERE key = 'rem';});
	is(sql($mode, q{SELECT state FROM idem_inspect('det', 'rem')}), 'expired',
		"$mode: rem after remember: expired");
	cmp_ok(sql($mode, 'SELECT idem_purge()'), '>=', 1, "$mode: idem_purge deletes rows");
	is(sql($mode, qq{SELECT count(*) FROM $IDEM_RECORDS r WHERE key = 'rem'}), '0',
		"$mode: rem's row is purged after remember");
	like(ck_claim($mode, 'rem', q{in_flight => 'raise'}), qr/^new\|\d+\|$/, "$mode: rem is a new key again");
}

unlike(slurp_file($node->logfile), qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');
$node->stop;

# ========== 3. a checkpoint across a fail-over to a synchronous standby ==========

my $primary = PostgreSQL::Test::Cluster->new('ck_primary');
$primary->init(allows_streaming => 1);
$primary->start;
$primary->safe_psql('postgres', 'CREATE EXTENSION idempotency');
is($primary->safe_psql('postgres', 'SELECT idem_durability()'), 'completed', 'primary: mode completed');
$primary->backup('b1');
my $standby = PostgreSQL::Test::Cluster->new('ck_standby');
$standby->init_from_backup($primary, 'b1', has_streaming => 1);
$standby->start;
$primary->append_conf('postgresql.conf', "synchronous_standby_names = '*'\n");
$primary->reload;
ok( $primary->poll_query_until('postgres',
		q{SELECT count(*) = 1 FROM pg_stat_replication WHERE sync_state = 'sync'}),
	'the standby is synchronous');

my $worker = $primary->background_psql('postgres', on_error_stop => 0);
my ($t_fo, $st, $err) = run_sql($worker, q{
	SELECT token FROM idem_begin('det', 'fo-cp', idem_fingerprint('fo-cp'), lease => '1 h', takeover => 'session');});
is($st, '00000', 'primary: fo-cp claimed (takeover session, its session open)') or diag($err);
(undef, $st, $err) = run_sql($worker, qq{SELECT idem_checkpoint('det', 'fo-cp', $t_fo, '{"charged": "ch_1"}');});
is($st, '00000', 'primary: fo-cp\'s checkpoint committed') or diag($err);
my $t_plain = token_of(claim($primary, 'postgres', 'fo-plain', q{lease => '1 h'}));
# no wait for the standby here: the synchronous commit is what is tested
$primary->stop('immediate');
eval { $worker->quit };
$standby->promote;
ok($standby->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'), 'the standby is promoted');

my $c = claim($standby, 'postgres', 'fo-cp', q{in_flight => 'raise'});
my ($fo_status, $fo_t, $fo_resp) = split /\|/, $c, 3;
is("$fo_status|$fo_resp", 'recover|{"charged": "ch_1"}',
	'new primary: fo-cp recovers at once with the checkpoint committed on the old primary');
cmp_ok($fo_t, '>', $t_fo, 'new primary: with a greater token');
{
	my ($s, $o, $e) = try_sql($standby, 'postgres', qq{SELECT idem_finish('det', 'fo-cp', $t_fo, '{}')});
	is($s, 'IK412', 'new primary: the old owner\'s idem_finish is refused (IK412)') or diag($e);
}
$standby->safe_psql('postgres', qq{SELECT idem_finish('det', 'fo-cp', $fo_t, '{"done": "ch_1"}')});
is(claim($standby, 'postgres', 'fo-cp'), 'replay||{"done": "ch_1"}',
	'new primary: the recovering owner finishes fo-cp');
like(claim($standby, 'postgres', 'fo-plain', q{in_flight => 'raise'}), qr/^new\|\d+\|$/,
	'new primary: fo-plain (no checkpoint, unlogged claim) was lost: new');

for my $n ($primary, $standby)
{
	unlike(slurp_file($n->logfile), qr/terminated by signal|PANIC|TRAP:/, $n->name . ': no backend crashed');
}
$standby->stop;
done_testing();
