
# Copyright (c) 2024, idempotency authors
#
# Security: privileges, role namespaces, and search_path attacks.
#
# 1. A role without privileges (mallory) cannot read, change, truncate,
#    lock, copy, alter or drop the record table or the token sequence,
#    cannot call the admin functions (idem_purge, idem_set_logged,
#    idem_stats_reset), cannot set idempotency.max_response_size, cannot
#    alter or drop the extension or its functions: 42501 every time.
# 2. mallory cannot see or replay alice's records: idem_inspect shows
#    nothing, idem_stats has no row of alice's operation, idem_begin with
#    alice's key and fingerprint is 'new' in mallory's own namespace (no
#    replay, no IK409, no wait), idem_finish / idem_renew with alice's token
#    are IK412, idem_abort is false -- and alice's records are unchanged.
#    Inside alice's SECURITY DEFINER function, the namespace is alice's.
# 3. search_path attack: the role evil puts its own schema first
#    (search_path = evil, pg_catalog, public) with functions, aggregates,
#    operators and domains shadowing the built-ins (= for text, oid, bytea,
#    int8, int4, tid, name, jsonb, bool, timestamptz; <, <=, >, >=, <> and
#    +/- interval for timestamptz; ||; now(), clock_timestamp(),
#    statement_timestamp(), transaction_timestamp(), count(*), count(x),
#    quote_ident(), quote_literal(), format(), nextval(), setval(),
#    set_config(), current_setting(), pg_advisory_xact_lock(), md5(),
#    sha256(), lower(), length(), to_jsonb(), ...) plus temporary tables
#    and views named like the extension's table and catalogs.  Each shadow
#    records current_user and session_user in evil's canary table, tries
#    ALTER ROLE evil SUPERUSER, and returns a wrong answer.  A probe shows
#    the shadows do capture evil's own unqualified SQL.  Then evil, with
#    EXECUTE granted on idem_purge, idem_set_logged and idem_stats_reset,
#    exercises every function -- and gets exactly the results a role with
#    a clean search_path gets for the same script in another database; the
#    canary stays empty (no code of evil's ran, let alone as the extension
#    owner) and evil is not a superuser.
#
# Every database runs in the default durability mode of a new installation,
# 'completed': a finish moves the record from idem_record to idem_result,
# so record checks read both tables, the setup expires a record in both,
# mallory is refused idem_result and the durability functions too, evil
# also meets a temporary idem_result, and the script switches the mode back
# to 'completed' after idem_set_logged(true) / (false).

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('security');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
});
$node->start;

# Run $sql as $user in $db; returns (sqlstate, stdout, stderr).
sub as_user
{
	my ($user, $db, $sql) = @_;
	my ($rc, $out, $err) = $node->psql($db, $sql,
		extra_params => [ '-U', $user, '-v', 'VERBOSITY=verbose' ],
		on_error_stop => 1);
	return ('00000', $out, $err) if $rc == 0;
	my ($state) = $err =~ /(?:ERROR|FATAL):\s+([0-9A-Z]{5}):/;
	return ($state // "rc=$rc", $out, $err);
}

$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE ROLE alice LOGIN;
	CREATE ROLE mallory LOGIN;
	CREATE ROLE evil LOGIN;
	CREATE ROLE good LOGIN;
	CREATE TABLE alice_effect (k text);
	GRANT ALL ON alice_effect TO alice;
});

# ---------------------------------------------------------------- 1

my @denied = (
	[ 'SELECT the record table',      'SELECT * FROM idem_record' ],
	[ 'SELECT one column',            'SELECT key FROM idem_record' ],
	[ 'INSERT',                       q{INSERT INTO idem_record VALUES (10, 'op', 'k', 1, NULL, '1 day', now(), NULL, now() + '1 day', NULL)} ],
	[ 'UPDATE',                       q{UPDATE idem_record SET response = '{}'} ],
	[ 'DELETE',                       'DELETE FROM idem_record' ],
	[ 'TRUNCATE',                     'TRUNCATE idem_record' ],
	[ 'COPY TO',                      'COPY idem_record TO STDOUT' ],
	[ 'COPY FROM',                    'COPY idem_record FROM STDIN' ],
	[ 'LOCK TABLE',                   'BEGIN; LOCK TABLE idem_record IN ACCESS EXCLUSIVE MODE; COMMIT;' ],
	[ 'ALTER TABLE',                  'ALTER TABLE idem_record SET LOGGED' ],
	[ 'ALTER TABLE ADD COLUMN',       'ALTER TABLE idem_record ADD COLUMN x int' ],
	[ 'DROP TABLE',                   'DROP TABLE idem_record' ],
	[ 'CREATE INDEX',                 'CREATE INDEX ON idem_record (key)' ],
	[ 'CREATE TRIGGER',               q{CREATE FUNCTION pg_temp.t() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$;
		CREATE TRIGGER t BEFORE INSERT ON idem_record FOR EACH ROW EXECUTE FUNCTION pg_temp.t()} ],
	[ 'CREATE RULE',                  'CREATE RULE r AS ON INSERT TO idem_record DO INSTEAD NOTHING' ],
	[ 'CREATE POLICY',                'CREATE POLICY p ON idem_record USING (true)' ],
	[ 'COMMENT ON TABLE',             q{COMMENT ON TABLE idem_record IS 'x'} ],
	[ 'SELECT the result table',      'SELECT * FROM idem_result' ],
	[ 'UPDATE the result table',      q{UPDATE idem_result SET response = '{}'} ],
	[ 'DELETE the result table',      'DELETE FROM idem_result' ],
	[ 'TRUNCATE the result table',    'TRUNCATE idem_result' ],
	[ 'ALTER TABLE the result table', 'ALTER TABLE idem_result SET UNLOGGED' ],
	[ 'nextval on the token sequence', q{SELECT nextval('idem_token_seq')} ],
	[ 'setval on the token sequence',  q{SELECT setval('idem_token_seq', 1)} ],
	[ 'SELECT the token sequence',     'SELECT last_value FROM idem_token_seq' ],
	[ 'ALTER SEQUENCE',                'ALTER SEQUENCE idem_token_seq RESTART' ],
	[ 'nextval on the token epochs',   q{SELECT nextval('idem_token_epoch')} ],
	[ 'setval on the token epochs',    q{SELECT setval('idem_token_epoch', 1)} ],
	[ 'ALTER SEQUENCE of the epochs',  'ALTER SEQUENCE idem_token_epoch RESTART' ],
	[ 'idem_purge()',                  'SELECT idem_purge()' ],
	[ 'idem_purge(1)',                 'SELECT idem_purge(1)' ],
	[ 'idem_set_logged(true)',         'SELECT idem_set_logged(true)' ],
	[ 'idem_set_logged(false)',        'SELECT idem_set_logged(false)' ],
	[ 'idem_set_durability(\'none\')', q{SELECT idem_set_durability('none')} ],
	[ 'idem_durability()',             'SELECT idem_durability()' ],
	[ 'idem_stats_reset()',            'SELECT idem_stats_reset()' ],
	[ 'idem_forget()',                 q{SELECT idem_forget('op', 'k', 'postgres', true)} ],
	[ 'SET idempotency.max_response_size', q{SET idempotency.max_response_size = '1GB'} ],
	[ 'ALTER EXTENSION UPDATE',        'ALTER EXTENSION idempotency UPDATE' ],
	[ 'DROP EXTENSION',                'DROP EXTENSION idempotency' ],
	[ 'ALTER FUNCTION idem_begin',     'ALTER FUNCTION idem_begin(text, text, bytea, text, interval, interval, text, interval) SECURITY DEFINER' ],
	[ 'DROP FUNCTION idem_finish',     'DROP FUNCTION idem_finish(text, text, bigint, jsonb)' ],
	[ 'CREATE OR REPLACE idem_abort',  q{CREATE OR REPLACE FUNCTION public.idem_abort(text, text, bigint) RETURNS bool LANGUAGE sql AS 'SELECT true'} ],
	[ 'ALTER VIEW idem_stats',         'ALTER VIEW idem_stats RENAME TO x' ],
	[ 'GRANT EXECUTE on idem_purge to self', 'GRANT EXECUTE ON FUNCTION idem_purge(int) TO mallory' ],
);
for my $case (@denied)
{
	my ($name, $sql) = @$case;
	my ($state, $out, $err) = as_user('mallory', 'postgres', $sql);
	# GRANT by a non-owner only warns "no privileges were granted"
	if ($name =~ /^GRANT/)
	{
		like($err, qr/no privileges were granted|permission denied/, "unprivileged: $name grants nothing");
		next;
	}
	is($state, '42501', "unprivileged: $name -> 42501") or diag($err);
}
is((as_user('mallory', 'postgres', 'SELECT idem_purge()'))[0], '42501',
	'unprivileged: idem_purge still refused after the attempted GRANT');

# ---------------------------------------------------------------- 2

my $fp = q{'\xa11ce0'::bytea};
my ($st, $t_pend, $err) = as_user('alice', 'postgres', qq{
	SELECT token FROM idem_begin('pay', 'k-done', $fp) \\gset
	INSERT INTO alice_effect VALUES ('k-done');
	SELECT idem_finish('pay', 'k-done', :token, '{"secret": "alice"}');
	SELECT token FROM idem_begin('pay', 'k-pend', $fp, lease => '1 hour');});
is($st, '00000', 'alice completes k-done and holds k-pend') or diag($err);
$t_pend =~ s/.*\n//s;
# both tables: in mode 'completed' alice's completed record is in idem_result
my $alice_rows = q{SELECT md5(string_agg(t::text, ',' ORDER BY key))
	FROM (SELECT * FROM idem_record UNION ALL SELECT * FROM idem_result) t
	WHERE role_id = 'alice'::regrole};
my $alice_before = $node->safe_psql('postgres', $alice_rows);

my @cross = (
	[ 'idem_inspect of alice\'s completed key shows nothing',
		q{SELECT count(*) FROM idem_inspect('pay', 'k-done')}, '0' ],
	[ 'idem_inspect of alice\'s pending key shows nothing',
		q{SELECT count(*) FROM idem_inspect('pay', 'k-pend')}, '0' ],
	[ 'idem_stats has no row of alice\'s operation',
		q{SELECT count(*) FROM idem_stats WHERE operation = 'pay'}, '0' ],
	[ 'idem_finish with alice\'s token: IK412',
		qq{SELECT idem_finish('pay', 'k-pend', $t_pend, '{"stolen": true}')}, 'IK412' ],
	[ 'idem_renew with alice\'s token: IK412',
		qq{SELECT idem_renew('pay', 'k-pend', $t_pend, '1 second')}, 'IK412' ],
	[ 'idem_abort with alice\'s token: false',
		qq{SELECT idem_abort('pay', 'k-pend', $t_pend)}, 'f' ],
	[ 'idem_begin of alice\'s completed key with her fingerprint: new, in mallory\'s namespace (no replay)',
		qq{SELECT status || '|' || (response IS NULL) FROM idem_begin('pay', 'k-done', $fp, 'raise')}, 'new|true' ],
	[ 'idem_begin of alice\'s pending key, raise: new (no IK409, no wait)',
		qq{SELECT status FROM idem_begin('pay', 'k-pend', $fp, 'raise')}, 'new' ],
	[ 'idem_begin of alice\'s key with another fingerprint: new (no IK422 leaking her fingerprint)',
		q{SELECT status FROM idem_begin('pay2', 'k-done', '\x00', 'raise')}, 'new' ],
	[ 'idem_stats now shows mallory\'s own records only',
		q{SELECT string_agg(operation || ':' || pending || ':' || completed, ',' ORDER BY operation) FROM idem_stats},
		'pay:2:0,pay2:1:0' ],
);
for my $case (@cross)
{
	my ($name, $sql, $want) = @$case;
	my ($state, $out, $e) = as_user('mallory', 'postgres', $sql);
	is($state eq '00000' ? $out : $state, $want, "mallory: $name") or diag($e);
}
is($node->safe_psql('postgres', $alice_rows), $alice_before, 'alice\'s records are unchanged');
is((as_user('alice', 'postgres',
		qq{SELECT status || '|' || response FROM idem_begin('pay', 'k-done', $fp)}))[1],
	'replay|{"secret": "alice"}', 'alice still replays her own response');
is((as_user('alice', 'postgres', q{SELECT state FROM idem_inspect('pay', 'k-pend')}))[1],
	'pending', 'alice\'s pending claim is still hers');

# SECURITY DEFINER: the namespace is the function owner's
$node->safe_psql('postgres', 'CREATE SCHEMA alice AUTHORIZATION alice; GRANT USAGE ON SCHEMA alice TO mallory');
($st, my $o, $err) = as_user('alice', 'postgres', q{
	CREATE FUNCTION alice.alice_claim(k text) RETURNS text LANGUAGE sql SECURITY DEFINER
	  SET search_path = public, pg_catalog
	  AS $$ SELECT status FROM idem_begin('sd', k, NULL) $$;
	GRANT EXECUTE ON FUNCTION alice.alice_claim(text) TO mallory;});
is($st, '00000', 'alice creates a SECURITY DEFINER function that claims a key') or diag($err);
is((as_user('mallory', 'postgres', q{SELECT alice.alice_claim('sd-1')}))[1], 'new',
	'mallory calls alice\'s SECURITY DEFINER function that claims a key');
is($node->safe_psql('postgres', q{SELECT role_id::regrole FROM idem_record WHERE operation = 'sd'}),
	'alice', 'the claim is in alice\'s namespace (the definer\'s), as the contract says');
is((as_user('mallory', 'postgres', q{SELECT count(*) FROM idem_inspect('sd', 'sd-1')}))[1], '0',
	'mallory does not see it');

# ---------------------------------------------------------------- 3

$node->safe_psql('postgres', q{
	CREATE DATABASE evildb;
	CREATE DATABASE gooddb;});
for my $db (qw(evildb gooddb))
{
	$node->safe_psql($db, q{
		CREATE EXTENSION idempotency;
		GRANT EXECUTE ON FUNCTION idem_purge(int), idem_set_logged(bool), idem_stats_reset(),
		  idem_set_durability(text), idem_durability()
		  TO evil, good;
		-- records of another role for idem_purge to find: one expired, one lapsed
		-- (the completed one is in idem_result in mode 'completed')
		SELECT idem_finish('bg', 'exp', (SELECT token FROM idem_begin('bg', 'exp', NULL)), '{}');
		UPDATE idem_record SET expires_at = now() - interval '1 hour' WHERE key = 'exp';
		UPDATE idem_result SET expires_at = now() - interval '1 hour' WHERE key = 'exp';
		SELECT count(*) FROM idem_begin('bg', 'lapse', NULL, lease => '1 microsecond');
		SELECT count(*) FROM idem_begin('bg', 'live', NULL);
	});
}
$node->safe_psql('evildb', 'CREATE SCHEMA evil AUTHORIZATION evil');

# evil builds the trap: everything here is evil's own, as evil
my $trap = q{
CREATE TABLE evil.canary (who text, session_who text, what text, at timestamptz DEFAULT pg_catalog.clock_timestamp());
GRANT INSERT ON evil.canary TO PUBLIC;
CREATE FUNCTION evil.trap(what pg_catalog.text) RETURNS pg_catalog.bool
LANGUAGE plpgsql SET search_path = pg_catalog AS $f$
BEGIN
	INSERT INTO evil.canary (who, session_who, what) VALUES (current_user, session_user, what);
	BEGIN
		EXECUTE 'ALTER ROLE evil SUPERUSER';
	EXCEPTION WHEN OTHERS THEN NULL;
	END;
	RETURN true;
END $f$;
};

# shadow functions: name, argument types, return type, wrong answer
my @shadow_fns = (
	[ 'now', '', 'timestamptz', q{'2000-01-01'} ],
	[ 'clock_timestamp', '', 'timestamptz', q{'infinity'} ],
	[ 'statement_timestamp', '', 'timestamptz', q{'infinity'} ],
	[ 'transaction_timestamp', '', 'timestamptz', q{'-infinity'} ],
	[ 'timeofday', '', 'text', q{'never'} ],
	[ 'quote_ident', 'text', 'text', q{'evil'} ],
	[ 'quote_literal', 'text', 'text', q{'evil'} ],
	[ 'quote_literal', 'anyelement', 'text', q{'evil'} ],
	[ 'quote_nullable', 'text', 'text', q{'evil'} ],
	[ 'format', 'text', 'text', q{'evil'} ],
	[ 'format', 'text, text', 'text', q{'evil'} ],
	[ 'format', 'text, text, text', 'text', q{'evil'} ],
	[ 'format', 'text, VARIADIC text[]', 'text', q{'evil'} ],
	[ 'concat', 'VARIADIC text[]', 'text', q{'evil'} ],
	[ 'nextval', 'regclass', 'int8', '1' ],
	[ 'nextval', 'text', 'int8', '1' ],
	[ 'currval', 'regclass', 'int8', '1' ],
	[ 'setval', 'regclass, int8', 'int8', '1' ],
	[ 'lastval', '', 'int8', '1' ],
	[ 'set_config', 'text, text, bool', 'text', q{'evil'} ],
	[ 'current_setting', 'text', 'text', q{'evil'} ],
	[ 'current_setting', 'text, bool', 'text', q{'evil'} ],
	[ 'pg_advisory_xact_lock', 'int8', 'void', 'NULL' ],
	[ 'pg_advisory_lock', 'int8', 'void', 'NULL' ],
	[ 'pg_try_advisory_xact_lock', 'int8', 'bool', 'true' ],
	[ 'md5', 'text', 'text', q{'evil'} ],
	[ 'md5', 'bytea', 'text', q{'evil'} ],
	[ 'sha256', 'bytea', 'bytea', q{'\x00'} ],
	[ 'digest', 'bytea, text', 'bytea', q{'\x00'} ],
	[ 'encode', 'bytea, text', 'text', q{'evil'} ],
	[ 'decode', 'text, text', 'bytea', q{'\x00'} ],
	[ 'lower', 'text', 'text', q{'evil'} ],
	[ 'upper', 'text', 'text', q{'evil'} ],
	[ 'length', 'text', 'int4', '0' ],
	[ 'length', 'bytea', 'int4', '0' ],
	[ 'octet_length', 'text', 'int4', '0' ],
	[ 'char_length', 'text', 'int4', '0' ],
	[ 'substr', 'text, int4, int4', 'text', q{'evil'} ],
	[ 'to_jsonb', 'anyelement', 'jsonb', q{'"evil"'} ],
	[ 'jsonb_typeof', 'jsonb', 'text', q{'evil'} ],
	[ 'array_length', 'anyarray, int4', 'int4', '0' ],
	[ 'pg_backend_pid', '', 'int4', '0' ],
	[ 'pg_extension_config_dump', 'regclass, text', 'void', 'NULL' ],
	[ 'idem_shadow_probe', '', 'bool', 'true' ],
);
# shadow operators: op, left, right, wrong answer
my @shadow_ops;
for my $t (qw(text oid bytea int8 int4 tid name jsonb bool timestamptz interval regclass))
{
	push @shadow_ops, [ '=', $t, $t, 'true' ], [ '<>', $t, $t, 'false' ];
}
for my $op (qw(< <= > >=))
{
	push @shadow_ops, [ $op, 'timestamptz', 'timestamptz', $op =~ /</ ? 'true' : 'false' ],
	  [ $op, 'int8', 'int8', 'true' ], [ $op, 'interval', 'interval', 'true' ];
}
push @shadow_ops, [ '+', 'timestamptz', 'interval', q{'2000-01-01'::pg_catalog.timestamptz} ],
  [ '-', 'timestamptz', 'interval', q{'2000-01-01'::pg_catalog.timestamptz} ],
  [ '-', 'timestamptz', 'timestamptz', q{'0'::pg_catalog.interval} ],
  [ '||', 'text', 'text', q{'evil'} ], [ '||', 'bytea', 'bytea', q{'\x00'::pg_catalog.bytea} ],
  [ '@>', 'jsonb', 'jsonb', 'true' ], [ '->>', 'jsonb', 'text', q{'evil'} ];

my $n = 0;
for my $f (@shadow_fns)
{
	my ($name, $args, $ret, $val) = @$f;
	my $qargs = join(', ', map {
		my $a = $_;
		$a =~ s/^(VARIADIC )?(\w+)(\[\])?$/($1 \/\/ '') . "pg_catalog.$2" . ($3 \/\/ '')/e;
		$a } grep { length } split(/,\s*/, $args));
	my $retq = "pg_catalog.$ret";
	$trap .= sprintf(
		"CREATE FUNCTION evil.%s(%s) RETURNS %s LANGUAGE plpgsql AS \$f\$ BEGIN PERFORM evil.trap(%s); RETURN %s; END \$f\$;\n",
		$name, $qargs, $retq, "'function $name($args)'", $ret eq 'void' ? '' : "$val");
}
for my $o (@shadow_ops)
{
	my ($op, $l, $r, $val) = @$o;
	my $fn = 'op' . (++$n);
	my $ret = $val =~ /^(true|false)$/ ? 'pg_catalog.bool'
	  : $val =~ /::pg_catalog\.(\w+)$/ ? "pg_catalog.$1" : 'pg_catalog.text';
	$trap .= sprintf(
		"CREATE FUNCTION evil.%s(pg_catalog.%s, pg_catalog.%s) RETURNS %s LANGUAGE plpgsql AS \$f\$ BEGIN PERFORM evil.trap(%s); RETURN %s; END \$f\$;\n"
		  . "CREATE OPERATOR evil.%s (LEFTARG = pg_catalog.%s, RIGHTARG = pg_catalog.%s, FUNCTION = evil.%s);\n",
		$fn, $l, $r, $ret, "'operator $op($l, $r)'", $val, $op, $l, $r, $fn);
}
# aggregates: count(*) and count(x) that are always 42
$trap .= q{
CREATE FUNCTION evil.count_step(s pg_catalog.int8) RETURNS pg_catalog.int8 LANGUAGE plpgsql
  AS $f$ BEGIN PERFORM evil.trap('aggregate count(*)'); RETURN 42; END $f$;
CREATE FUNCTION evil.count_step(s pg_catalog.int8, x anyelement) RETURNS pg_catalog.int8 LANGUAGE plpgsql
  AS $f$ BEGIN PERFORM evil.trap('aggregate count(x)'); RETURN 42; END $f$;
CREATE AGGREGATE evil.count(*) (SFUNC = evil.count_step, STYPE = pg_catalog.int8, INITCOND = '42');
CREATE AGGREGATE evil.count(anyelement) (SFUNC = evil.count_step, STYPE = pg_catalog.int8, INITCOND = '42');
CREATE AGGREGATE evil.max(pg_catalog.int8) (SFUNC = evil.count_step, STYPE = pg_catalog.int8, INITCOND = '42');
CREATE FUNCTION evil.domain_check() RETURNS pg_catalog.bool LANGUAGE plpgsql
  AS $f$ BEGIN RETURN evil.trap('domain check'); END $f$;
};
# types last: after them evil's own SQL must qualify type names
for my $t (qw(text int4 int8 bytea jsonb interval timestamptz oid bool name regclass))
{
	$trap .= "CREATE DOMAIN evil.$t AS pg_catalog.$t CHECK (evil.domain_check());\n";
}

my $evil_path = q{SET search_path = evil, pg_catalog, public;};
# temporary relations come first for relation names unless pg_temp is listed
my $temp_trap = q{
CREATE TEMP TABLE idem_record (role_id pg_catalog.oid, operation pg_catalog.text, key pg_catalog.text);
CREATE TEMP TABLE idem_result (role_id pg_catalog.oid, operation pg_catalog.text, key pg_catalog.text);
CREATE TEMP TABLE idem_token_seq (last_value pg_catalog.int8);
CREATE TEMP TABLE idem_token_epoch (last_value pg_catalog.int8);
CREATE TEMP VIEW pg_extension AS SELECT * FROM pg_catalog.pg_extension WHERE evil.trap('temp view pg_extension');
CREATE TEMP VIEW pg_namespace AS SELECT * FROM pg_catalog.pg_namespace WHERE evil.trap('temp view pg_namespace');
CREATE TEMP VIEW pg_class AS SELECT * FROM pg_catalog.pg_class WHERE evil.trap('temp view pg_class');
};

my ($tst, $tout, $terr) = as_user('evil', 'evildb', $trap);
is($tst, '00000', sprintf('evil planted %d shadow functions, %d operators, aggregates and domains in schema evil',
		scalar @shadow_fns, scalar @shadow_ops)) or diag($terr);

# the probe: evil's own unqualified SQL is captured
my ($pst, $pout, $perr) = as_user('evil', 'evildb', $evil_path . $temp_trap . q{
	SELECT 'a'::pg_catalog.text = 'b'::pg_catalog.text;
	SELECT now() = now();
	SELECT count(*) FROM pg_catalog.generate_series(1, 3);
	SELECT quote_ident('x');
	SELECT '(0,1)'::pg_catalog.tid = '(0,2)'::pg_catalog.tid;
	SELECT clock_timestamp() <= '2000-01-01'::pg_catalog.timestamptz;
	SELECT 1::int4;
	SELECT count(*) FROM pg_extension;
});
is($pst, '00000', 'evil\'s probe ran') or diag($perr);
is($pout, "t\nt\n42\nevil\nt\nt\n1\n42", 'the shadows answer evil\'s own unqualified SQL (wrongly)');
my $probe = $node->safe_psql('evildb', q{
	SELECT string_agg(DISTINCT who || ':' || what, ', ' ORDER BY who || ':' || what) FROM evil.canary});
like($probe, qr/evil:operator =\(text, text\).*evil:operator =\(tid, tid\)/s,
	'the canary records them, with current_user evil');
like($probe, qr/evil:function now\(\)/, 'now() is shadowed');
like($probe, qr/evil:aggregate count\(\*\)/, 'count(*) is shadowed');
like($probe, qr/evil:domain check/, 'the int4 domain is reached');
like($probe, qr/evil:temp view pg_extension/, 'the temp view pg_extension is reached');
$node->safe_psql('evildb', 'TRUNCATE evil.canary');

# The same script for evil (shadows, hostile search_path) and good (clean):
# every function, every outcome.  No operator, no unqualified function,
# no unqualified type of our own in it: psql prints fields with '|'.
my @steps = (
	q{SELECT 'new', status, token FROM idem_begin('sp', 'k1', '\x01'::pg_catalog.bytea)},
	q{SELECT 'raise', status FROM idem_begin('sp', 'k1', '\x01'::pg_catalog.bytea, 'raise')},
	q{SELECT 'reuse', status FROM idem_begin('sp', 'k1', '\x02'::pg_catalog.bytea, 'raise')},
	q{SELECT 'renew', pg_catalog.date_part('epoch', idem_renew('sp', 'k1', (SELECT token FROM idem_inspect('sp', 'k1')), '1 hour'::pg_catalog.interval))},
	q{SELECT 'inspect', state, token, fingerprint, response FROM idem_inspect('sp', 'k1')},
	q{SELECT 'finish', idem_finish('sp', 'k1', (SELECT token FROM idem_inspect('sp', 'k1')), '{"a": 1}'::pg_catalog.jsonb)},
	q{SELECT 'replay', status, token, response FROM idem_begin('sp', 'k1', '\x01'::pg_catalog.bytea)},
	q{SELECT 'refinish', idem_finish('sp', 'k1', (SELECT token FROM idem_inspect('sp', 'k1')), '{"a": 2}'::pg_catalog.jsonb)},
	q{SELECT 'reabort', idem_abort('sp', 'k1', (SELECT token FROM idem_inspect('sp', 'k1')))},
	q{SELECT 'lapse', status, token FROM idem_begin('sp', 'k2', NULL, lease => '1 microsecond'::pg_catalog.interval)},
	q{SELECT 'takeover', status, token FROM idem_begin('sp', 'k2', NULL)},
	q{SELECT 'stale', idem_abort('sp', 'k2', (SELECT token FROM idem_inspect('sp', 'k1')))},
	q{SELECT 'abort', idem_abort('sp', 'k2', (SELECT token FROM idem_inspect('sp', 'k2')))},
	q{SELECT 'lapse2', status FROM idem_begin('sp', 'k3', NULL, lease => '1 microsecond'::pg_catalog.interval)},
	q{SELECT 'pending', status FROM idem_begin('sp', 'k4', '\x04'::pg_catalog.bytea, ttl => '1 minute'::pg_catalog.interval, lease => '30 s'::pg_catalog.interval)},
	q{SELECT 'stats', operation, pending, lapsed, completed, expired FROM idem_stats},
	q{SELECT 'inspect2', state, token, fingerprint FROM idem_inspect('sp', 'k3')},
	q{SELECT 'fp', idem_fingerprint('a', 'bc'), idem_fingerprint('ab', 'c'), idem_fingerprint(NULL::pg_catalog.text), idem_fingerprint(''::pg_catalog.text)},
	q{SELECT 'fp2', idem_fingerprint(1, 'x'::pg_catalog.text, '\x00'::pg_catalog.bytea, '{"k": [1]}'::pg_catalog.jsonb, true)},
	q{SELECT 'purge', idem_purge()},
	q{SELECT 'purge1', idem_purge(1)},
	q{SELECT 'logged', idem_set_logged(true)},
	q{SELECT 'persistence1', relpersistence FROM pg_catalog.pg_class WHERE oid OPERATOR(pg_catalog.=) 'public.idem_record'::pg_catalog.regclass},
	q{SELECT 'after_logged', state, response FROM idem_inspect('sp', 'k1')},
	q{SELECT 'unlogged', idem_set_logged(false)},
	q{SELECT 'persistence2', relpersistence FROM pg_catalog.pg_class WHERE oid OPERATOR(pg_catalog.=) 'public.idem_record'::pg_catalog.regclass},
	q{SELECT 'mode1', idem_durability()},
	q{SELECT 'completed', idem_set_durability('completed')},
	q{SELECT 'mode2', idem_durability()},
	q{SELECT 'persistence3', c.relname, c.relpersistence FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) ANY (ARRAY['public.idem_record'::pg_catalog.regclass, 'public.idem_result'::pg_catalog.regclass]) ORDER BY c.relname},
	q{SELECT 'reset', idem_stats_reset()},
	q{SELECT 'counters', claims, replays, purged FROM idem_counters()},
	q{SELECT 'counters_view', claims FROM idem_stats_counters},
	q{SELECT 'final', state, response FROM idem_inspect('sp', 'k1')},
);
my $script = join("\n", map { "$steps[$_];\n\\echo 'S|$_|' :SQLSTATE" } 0 .. $#steps);

sub run_script
{
	my ($role, $db, $prefix) = @_;
	my ($rc, $out, $e) = $node->psql($db, $prefix . "\n" . $script,
		extra_params => [ '-U', $role, '-v', 'VERBOSITY=terse' ], on_error_stop => 0);
	# normalise: tokens and times differ between the two runs
	my (%tok, $next);
	$next = 0;
	my @lines;
	for my $line (split /\n/, $out)
	{
		$line =~ s/\b(\d{1,19})\b/exists $tok{$1} ? $tok{$1} : ($tok{$1} = 'T' . ++$next)/ge
		  if $line =~ /^(new|lapse|takeover|inspect2?)\|/;
		$line =~ s/^(renew)\|([\d.]+)$/sprintf('%s|%s', $1, abs($2 - time - 3600) < 60 ? 'now+1h' : "WRONG:$2")/e;
		push @lines, $line;
	}
	return (join("\n", @lines), $e);
}

# evil: hostile search_path and temp relations
my ($evil_out, $evil_err) = run_script('evil', 'evildb', $evil_path . $temp_trap);
my ($good_out, $good_err) = run_script('good', 'gooddb', '');
note("good's results:\n$good_out");
is($evil_out, $good_out,
	'every function gives evil (shadowed search_path) exactly what it gives a clean role')
  or diag("evil's errors:\n$evil_err\ngood's errors:\n$good_err");

# what that is, so that both cannot be wrong the same way
like($good_out, qr/^new\|new\|T1\nS\|0\| 00000\nS\|1\| IK409\nS\|2\| IK422\nrenew\|now\+1h\n/m,
	'clean run: new, IK409, IK422, renew to now + 1 hour');
like($good_out, qr/^replay\|replay\|\|\{"a": 1\}$/m, 'clean run: replay');
like($good_out, qr/^S\|7\| IK412$/m, 'clean run: finishing twice is IK412');
like($good_out, qr/^reabort\|f$/m, 'clean run: aborting a finished claim is false');
like($good_out, qr/^stats\|sp\|1\|1\|1\|0$/m, 'clean run: idem_stats counts 1 pending, 1 lapsed, 1 completed');
like($good_out, qr/^purge\|3$/m, 'clean run: idem_purge deletes the 3 expired records (2 of another role)');
like($good_out, qr/^persistence1\|p\n.*^persistence2\|u$/ms, 'clean run: idem_set_logged switches the table');
like($good_out, qr/^mode1\|none\n.*^mode2\|completed\n.*^persistence3\|idem_record\|u\npersistence3\|idem_result\|p$/ms,
	'clean run: idem_set_logged(false) is mode none; idem_set_durability(\'completed\') makes idem_result logged');
for my $db (qw(evildb gooddb))
{
	is($node->safe_psql($db, q{SELECT string_agg(key, ',' ORDER BY key)
		FROM (SELECT key FROM idem_record WHERE operation = 'bg'
		      UNION ALL SELECT key FROM idem_result WHERE operation = 'bg') r}),
		'live', "$db: the purge kept the other role's live record and deleted its expired ones");
}
like($good_out, qr/^final\|completed\|\{"a": 1\}$/m, 'clean run: the completed record survived the rewrites and moves');
my @fp = $good_out =~ /^fp\|(\S+)\|(\S+)\|(\S+)\|(\S+)$/m;
ok(@fp == 4 && $fp[0] ne $fp[1] && $fp[2] ne $fp[3], "clean run: fingerprints ('a','bc') <> ('ab','c'), NULL <> ''");

# nothing of evil's ran
is($node->safe_psql('evildb', q{SELECT count(*) FROM evil.canary WHERE who = 'postgres' OR session_who <> 'evil'}),
	'0', 'no shadow ran as the extension owner (postgres)');
is($node->safe_psql('evildb', q{
	SELECT coalesce(string_agg(who || ': ' || what, ', '), 'none') FROM evil.canary}),
	'none', 'no shadow ran at all: the canary is empty');
is($node->safe_psql('postgres', q{SELECT rolsuper FROM pg_roles WHERE rolname = 'evil'}),
	'f', 'evil is not a superuser');
is($node->safe_psql('evildb', q{SELECT count(*) FROM idem_result WHERE key = 'k1' AND response = '{"a": 1}'}),
	'1', 'evil\'s record is stored as it should be (in idem_result: mode completed)');

my $log = slurp_file($node->logfile);
unlike($log, qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');
$node->stop;
done_testing();
