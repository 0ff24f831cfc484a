
# Copyright (c) 2024, idempotency authors
#
# Hostile and malformed input, generated: thousands of argument
# combinations for every function -- idem_begin, idem_finish, idem_abort,
# idem_renew, idem_inspect, idem_fingerprint, idem_purge, idem_set_logged,
# idem_stats_reset -- each against a record state set up just before it.
#
# The generator keeps a model of the record table (per role, operation and
# key) and predicts every call from the contract (README.md):
# either what it returns, or the SQLSTATEs it may fail with.  One psql
# session (superuser) runs the whole generated script; calls run as the
# roles alice, bob (ordinary) and admin (EXECUTE granted on the admin
# functions) via SET ROLE, and print their result and :SQLSTATE.  Then:
#
#  - every call behaved as predicted (value, or an accepted SQLSTATE);
#  - for every call predicted to fail (or to change nothing: replays,
#    idem_abort -> false, idem_inspect, idem_fingerprint, idem_set_logged),
#    a checksum of the whole record table taken as superuser right before
#    and right after the call is the same;
#  - at the end of every batch the whole table equals the model (tokens,
#    pending/completed, fingerprints, responses), and idem_stats of each
#    role shows that role's records only;
#  - new tokens strictly increase;
#  - no backend crashed (server log) and the server is up.
#
# It runs in the default durability mode of a new installation, 'completed'
# (claims in idem_record, completed records moved to idem_result), until the
# idem_set_logged section switches to 'all' / 'none': "the record table"
# above is both tables (the view idemtest_records), and the setup that
# expires or deletes records does it in both.
#
# SQLSTATEs accepted, and why:
#   22004  NULL where a value is required (spec)
#   22023  empty or > 255-character operation/key, unknown policy (the
#          policy is case-insensitive: 'WAIT' and 'Raise' are valid; '',
#          'rasie', ' wait' are not), fingerprint over 1024 bytes (up to
#          1024 is fine; a 100 MB one is refused at once), bad lease/ttl
#          (lease <= 0 or > ttl, ttl < 1 minute, either longer than 100
#          years) (spec, README)
#   54000  response over idempotency.max_response_size (64 kB), stored or
#          as text: '[1e100000]' is a few bytes stored but 100,001 digits
#          as text, a control character six characters (\u0001) (spec)
#   IK409  raise policy on a live pending claim; same-transaction re-begin
#   IK412  token that does not hold the key (finish, renew)
#   IK422  live record with another fingerprint (NULL equals only NULL)
#   55P03  'wait' on a live committed claim, cut short by lock_timeout
#          (spec: waiting honours lock_timeout); the session sets 20 ms
#   42501  admin function (idem_purge, idem_set_logged, idem_stats_reset)
#          called by a role without EXECUTE
#   Raised by the server itself before any of our code runs (argument
#   input), listed so that the generator can feed such input:
#   54001  stack depth exceeded parsing deeply nested JSON (100,000 levels)
#   22P02  invalid JSON text
#   22015  interval field out of range ('2147483648 days')
#   22021  invalid UTF-8 byte sequence (the server validates encoding on
#          input, so only valid UTF-8 ever reaches the extension)
# NULL is 22004 for every function and argument that needs a value,
# idem_inspect(NULL, ...) and idem_set_logged(NULL) included (1.3: no
# longer STRICT, so no longer "no row" / "no change"; idem_set_logged(NULL)
# by a role without EXECUTE is 42501, no longer folded away).
# Two answers are accepted where the contract leaves room:
#   idem_renew of a claim whose lease lapsed (not taken over): success or
#   IK412 (the generator then only uses leases that keep it lapsed).
# Record states are set up with fingerprints the contract accepts; a call
# with a refused fingerprint then meets a real record and must change
# nothing.  After the generated script, direct checks: IK422's DETAIL
# (fingerprints in hex, whole up to 64 bytes, then cut with their size),
# a 100 MB fingerprint refused quickly and with a short message.

use strict;
use warnings;
use utf8;

use Digest::MD5 qw(md5_hex);
use Encode qw(encode);
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

my $soak = $ENV{IDEM_SOAK_SECONDS} || 0;
# the soak (test/soak/run) multiplies the calls: about one more round per minute
my $scale = $soak ? ($soak >= 120 ? int($soak / 60) : 1) : 1;
srand($ENV{IDEM_SEED} // 20240511);
note('seed ' . ($ENV{IDEM_SEED} // 20240511) . ", scale $scale");

my $node = PostgreSQL::Test::Cluster->new('hostile');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
# no purge worker: it must not change the table behind the checksums
idempotency.databases = ''
# nor autovacuum, whose truncation locks the table out for a moment: the
# calls run with a lock_timeout of 20 ms, and 55P03 is an answer only a
# wait on a live claim may give
autovacuum = off
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE ROLE alice;
	CREATE ROLE bob;
	CREATE ROLE admin;
	GRANT EXECUTE ON FUNCTION idem_purge(int), idem_set_logged(bool), idem_stats_reset() TO admin;

	-- the whole record table, as one value
	-- (large values enter through their md5, which keeps this cheap);
	-- both tables: in the default durability mode of a new installation,
	-- 'completed', a finish moves the record to idem_result
	CREATE VIEW idemtest_records AS
		SELECT * FROM idem_record UNION ALL SELECT * FROM idem_result;
	REVOKE ALL ON idemtest_records FROM PUBLIC;
	CREATE FUNCTION idemtest_checksum() RETURNS text LANGUAGE sql AS $$
		SELECT md5(coalesce(string_agg(concat_ws('|', role_id, md5(operation), md5(key), token,
		           md5(fingerprint), ttl, created_at, completed_at, expires_at,
		           md5(response::text), fingerprint IS NULL, response IS NULL),
		           ',' ORDER BY role_id, operation, key, token), ''))
		       || ':' || count(*)
		  FROM idemtest_records $$
		-- a checksum waits for the table however long it takes
		SET lock_timeout = 0;
	REVOKE ALL ON FUNCTION idemtest_checksum() FROM PUBLIC;

	-- the contract's fingerprint encoding, written independently
	CREATE FUNCTION ref_fp(VARIADIC a text[]) RETURNS bytea LANGUAGE sql IMMUTABLE AS $$
		SELECT sha256(coalesce(string_agg(
			CASE WHEN x IS NULL THEN '\x00'::bytea
			     ELSE '\x01'::bytea || int4send(octet_length(x)) || convert_to(x, 'UTF8') END,
			''::bytea ORDER BY i), ''::bytea))
		  FROM unnest(a) WITH ORDINALITY u(x, i) $$;
});

# ---------------------------------------------------------------- values

# An SQL literal for any Perl (Unicode) string, in plain ASCII.
sub lit
{
	my ($s) = @_;
	return 'NULL' unless defined $s;
	my $out = '';
	for my $c (split //, $s)
	{
		my $o = ord $c;
		if ($c eq '\\') { $out .= '\\\\'; }
		elsif ($c eq "'") { $out .= "\\'"; }
		elsif ($o < 0x20 || $o == 0x7f) { $out .= sprintf('\\x%02x', $o); }
		elsif ($o < 0x80) { $out .= $c; }
		elsif ($o <= 0xffff) { $out .= sprintf('\\u%04x', $o); }
		else { $out .= sprintf('\\U%08x', $o); }
	}
	return "E'$out'";
}

# Exactly $n characters, unique per call: a counter padded with $pad.
my $uniq = 0;
sub padded
{
	my ($n, $pad, $prefix) = @_;
	$prefix //= '';
	my $id = $prefix . 'u' . (++$uniq) . '.';
	my $need = $n - length($id);
	die "cannot pad to $n" if $need < 0;
	return $id . ($pad x ($need / length($pad))) . substr($pad, 0, $need % length($pad));
}

# Names (operation or key): [ class, sub returning (sql, perl value or
# undef, error codes) ].  A perl value identifies the record in the model.
my @name_classes = (
	[ 'plain',      sub { my $v = 'k' . (++$uniq); (lit($v), $v, []) } ],
	[ 'null',       sub { ('NULL', undef, ['22004']) } ],
	[ 'empty',      sub { ("''", undef, ['22023']) } ],
	[ 'len255',     sub { my $v = padded(255, 'x'); (lit($v), $v, []) } ],
	[ 'len256',     sub { my $v = padded(256, 'x'); (lit($v), undef, ['22023']) } ],
	[ 'mb255',      sub { my $v = padded(255, "\x{e9}"); (lit($v), $v, []) } ],
	[ 'emoji255',   sub { my $v = padded(255, "\x{1F600}"); (lit($v), $v, []) } ],
	[ 'mb256',      sub { my $v = padded(256, "\x{4e2d}"); (lit($v), undef, ['22023']) } ],
	[ 'combining255', sub { my $v = padded(255, "e\x{301}"); (lit($v), $v, []) } ],
	[ 'combining256', sub { my $v = padded(256, "e\x{301}"); (lit($v), undef, ['22023']) } ],
	[ 'huge',       sub { ("repeat('k', 100000)", undef, ['22023']) } ],
	[ 'spaces',     sub { my $v = '  ' . (++$uniq) . ' '; (lit($v), $v, []) } ],
	[ 'only_space', sub { my $v = ' ' x (1 + (++$uniq % 200)); (lit($v), $v, []) } ],
	[ 'quotes',     sub { my $v = qq{it's "q" \\ %s %n %d \$1 ; --} . (++$uniq); (lit($v), $v, []) } ],
	[ 'control',    sub { my $v = "\x01\n\t\r\x1b[0m" . (++$uniq); (lit($v), $v, []) } ],
	[ 'bidi',       sub { my $v = "\x{202E}\x{200D}\x{FEFF}abc" . (++$uniq); (lit($v), $v, []) } ],
	[ 'sql_ish',    sub { my $v = "'); DROP TABLE idem_record; --" . (++$uniq); (lit($v), $v, []) } ],
	[ 'bad_utf8',   sub { (q{convert_from('\xc3'::bytea, 'UTF8')}, undef, ['22021']) } ],
);
my %name_class = map { $_->[0] => $_->[1] } @name_classes;
my @valid_names = grep { my ($s, $v) = $name_class{$_}->(); defined $v } map { $_->[0] } @name_classes;

# Fingerprints: class => sql.  Equality is by class.  At most 1024 bytes
# are accepted; longer ones are 22023 (%fp_err), whatever the record.
my %fp_sql = (
	null   => 'NULL::bytea',
	empty  => q{''::bytea},
	a      => q{'\x01'::bytea},
	b      => q{'\x02'::bytea},
	sha    => q{idem_fingerprint('x', 1)},
	fp65   => q{decode(repeat('c3', 65), 'hex')},
	fp1024 => q{decode(repeat('ab', 1024), 'hex')},
	fp1025 => q{decode(repeat('ab', 1025), 'hex')},
	big    => q{decode(repeat('ab', 5000), 'hex')},
	# 100 MB: used in a few calls only (%fp_rare)
	huge   => q{convert_to(repeat('f', 100000000), 'UTF8')},
);
my %fp_err = (fp1025 => '22023', big => '22023', huge => '22023');
my %fp_rare = (huge => 1);
my @fp_classes = grep { !$fp_rare{$_} } sort keys %fp_sql;    # for random picks
my @fp_ok = grep { !$fp_err{$_} } @fp_classes;                  # for record states

# Intervals: class => [sql, microseconds (30-day months, as interval
# comparison counts them) or undef when the server rejects the literal,
# server error].  Perl doubles hold these exactly enough for comparisons.
my $USEC_DAY = 86400 * 1e6;
my %iv = (
	null        => [ 'NULL', undef ],
	us1         => [ q{'1 microsecond'}, 1 ],
	us06        => [ q{'0.6 microseconds'}, 1 ],
	us04        => [ q{'0.4 microseconds'}, 0 ],
	day_minus   => [ q{'1 day -86399999999 microseconds'}, 1 ],
	zero        => [ q{'0'}, 0 ],
	neg_s       => [ q{'-1 s'}, -1e6 ],
	neg_us      => [ q{'-1 microsecond'}, -1 ],
	m59         => [ q{'59.999999 seconds'}, 59999999 ],
	m1          => [ q{'1 minute'}, 60e6 ],
	m1_hms      => [ q{'00:01:00'}, 60e6 ],
	m1_mix      => [ q{'1 hour -59 minutes'}, 60e6 ],
	m1_minus    => [ q{'1 minute -1 microsecond'}, 60e6 - 1 ],
	h1          => [ q{'1 hour'}, 3600e6 ],
	h23         => [ q{'23 hours'}, 23 * 3600e6 ],
	h24         => [ q{'24 hours'}, $USEC_DAY ],
	day1        => [ q{'1 day'}, $USEC_DAY ],
	h24_plus    => [ q{'24 hours 1 microsecond'}, $USEC_DAY + 1 ],
	month1      => [ q{'1 month'}, 30 * $USEC_DAY ],
	month_min30 => [ q{'1 month -30 days'}, 0 ],
	neg_month   => [ q{'-1 month 31 days'}, $USEC_DAY ],
	y100        => [ q{'100 years'}, 36000 * $USEC_DAY ],
	y1000000    => [ q{'1000000 years'}, 1000000 * 360 * $USEC_DAY ],
	y178m       => [ q{'178000000 years'}, 178000000 * 360 * $USEC_DAY ],
	neg_y178m   => [ q{'-178956970 years -8 months'}, -178956970.7 * 360 * $USEC_DAY ],
	days_max    => [ q{'2147483647 days'}, 2147483647 * $USEC_DAY ],
	days_min    => [ q{'-2147483648 days'}, -2147483648 * $USEC_DAY ],
	hours_max   => [ q{'2562047788 hours'}, 2562047788 * 3600e6 ],
	days_over   => [ q{'2147483648 days'}, undef, '22015' ],
);
my @iv_classes = sort keys %iv;
my $MAX_IV = 36500 * $USEC_DAY;    # the documented "100 years" limit
sub iv_sql { my ($c) = @_; return $c eq 'null' ? 'NULL' : "$iv{$c}[0]::interval"; }
sub tiny { my ($us) = @_; return defined $us && $us > 0 && $us <= 1; }

# the policy is case-insensitive (as the setting idempotency.in_flight is):
# only other words are 22023
my @policies = (
	[ 'null', 'NULL', undef ], [ 'wait', q{'wait'}, 'wait' ], [ 'raise', q{'raise'}, 'raise' ],
	(map { [ "case:$_", lit($_), lc $_ ] } ('WAIT', 'Wait', 'wAiT', 'RAISE', 'Raise', 'rAISE')),
	map { [ "bad:$_", lit($_), 'bad' ] } (' wait', 'wait ', '', 'rais', 'rasie', 'wiat',
		'waitraise', "wait\n", "\x{ff57}\x{ff41}\x{ff49}\x{ff54}", "WA\x{130}T", "RA\x{130}SE",
		"wa\x{131}t", 'raise;', 'NULL'),
);
push @policies, [ 'bad:huge', q{repeat('w', 100000)}, 'bad' ];

# Responses: class => sql; sizes and md5 of the text form come from the server
my %resp_sql = (
	null       => 'NULL::jsonb',
	obj        => q{'{"charge": "ch_1", "n": [1, 2.5, null, true]}'::jsonb},
	empty_obj  => q{'{}'::jsonb},
	json_null  => q{'null'::jsonb},
	arr        => q{'[]'::jsonb},
	str        => q{'""'::jsonb},
	zero       => q{'0'::jsonb},
	unicode    => lit(qq{{"k": "\x{e9}\x{1F600}\x{202E}"}}) . '::jsonb',
	escapes    => q{'"\\u0001\\n\\t\\"\\\\"'::jsonb},
	at_limit   => q{to_jsonb(repeat('x', 65524))},
	over_limit => q{to_jsonb(repeat('x', 65525))},
	huge       => q{to_jsonb(repeat('x', 1000000))},
	deep1000   => q{(repeat('[', 1000) || repeat(']', 1000))::jsonb},
	deep10000  => q{(repeat('[', 10000) || repeat(']', 10000))::jsonb},
	deep100000 => q{(repeat('[', 100000) || repeat(']', 100000))::jsonb},
	wide       => q{(SELECT jsonb_object_agg('k' || i, i) FROM generate_series(1, 10000) i)},
	bad_json   => "'{'::jsonb",
	# small stored, over the limit as text (what a replay sends)
	num_1e100000 => q{'[1e100000]'::jsonb},
	ctl_many     => q{to_jsonb(repeat(chr(1), 20000))},
	# a string of 10922 control characters (\u0001 each) and 2 letters is
	# 65536 bytes as text, with its quotes: at the limit; one more is over
	ctl_at_limit   => q{to_jsonb(repeat(chr(1), 10922) || 'xx')},
	ctl_over_limit => q{to_jsonb(repeat(chr(1), 10922) || 'xxx')},
);
my (%resp_md5, %resp_err, %resp_size);
for my $c (sort keys %resp_sql)
{
	next if $c eq 'null';
	my ($rc, $out, $err) = $node->psql('postgres',
		"SELECT pg_column_size(x) || '|' || octet_length(x::text) || '|' || md5(x::text) FROM (SELECT $resp_sql{$c} AS x) s",
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	if ($rc == 0)
	{
		my ($size, $text_size, $md5) = split /\|/, $out;
		$resp_md5{$c} = $md5;
		$resp_size{$c} = "$size/$text_size";
		$resp_err{$c} = ($size > 65536 || $text_size > 65536) ? '54000' : undef;
	}
	else
	{
		my ($code) = $err =~ /ERROR:\s+([0-9A-Z]{5}):/;
		$resp_err{$c} = $code;
	}
}
is_deeply({ map { $_ => $resp_err{$_} } qw(at_limit over_limit deep10000 deep100000 bad_json) },
	{ at_limit => undef, over_limit => '54000', deep10000 => '54000', deep100000 => '54001', bad_json => '22P02' },
	'response classes: at the 64kB limit, one byte over, 10,000 nesting levels (80 kB), 100,000 levels (server: stack depth), bad JSON');
is_deeply({ map { $_ => $resp_size{$_} } qw(num_1e100000 ctl_many ctl_at_limit ctl_over_limit) },
	{ num_1e100000 => '22/100003', ctl_many => '20012/120002', ctl_at_limit => '10936/65536', ctl_over_limit => '10937/65537' },
	'response classes small stored but large as text: stored/text sizes');
is_deeply({ map { $_ => $resp_err{$_} } qw(num_1e100000 ctl_many ctl_at_limit ctl_over_limit) },
	{ num_1e100000 => '54000', ctl_many => '54000', ctl_at_limit => undef, ctl_over_limit => '54000' },
	'so over the limit as text: [1e100000], 20,000 control characters, one byte past the limit; at it: fine');
my @resp_classes = sort keys %resp_sql;
my @good_resps = grep { $_ ne 'null' && !defined $resp_err{$_} } @resp_classes;

my %fp_md5;
for my $c (sort keys %fp_sql)
{
	# a refused fingerprint is never stored
	$fp_md5{$c} = $c eq 'null' ? 'N' : $fp_err{$c} ? "refused:$c"
	  : $node->safe_psql('postgres', "SELECT md5($fp_sql{$c})");
}
is($node->safe_psql('postgres', 'SELECT ' . join(" || '|' || ",
			map { "octet_length($fp_sql{$_})" } qw(fp65 fp1024 fp1025 big huge))),
	'65|1024|1025|5000|100000000', 'fingerprint classes: 65 bytes, 1024 (the limit), 1025, 5000, 100 MB');


# ---------------------------------------------------------------- script

my @script;          # psql input lines
my @calls;           # one per call
my %model;           # "role\0op\0key" => record
my @batches;         # model snapshots to compare with the table
my $ncall = 0;
my %targets;         # function => number of target calls

my $script_lines = 0;
sub emit
{
	for (@_)
	{
		push @script, $_;
		$script_lines += 1 + tr/\n//;
	}
	return;
}

sub mkey { return join("\0", @_); }

# Add a call.  %c: fn, role, sql (prints R|i|...), expect => { ok => sub
# (result, calls) } or { err => [codes] } or both, checksum => 0/1, target.
sub add_call
{
	my (%c) = @_;
	my $i = ++$ncall;
	$c{i} = $i;
	$c{label} //= $c{fn};
	my $sql = $c{sql};
	$sql =~ s/\@I\@/$i/g;
	$c{checksum} = 1 if $c{target};
	$c{line} = $script_lines + 1;
	if ($c{checksum})
	{
		# right after the previous call's "after" checksum: the same value
		if (@script && $script[-1] =~ /^SELECT 'A\|(\d+)\|' \|\| idemtest_checksum\(\);$/)
		{
			$c{before_from} = $1;
		}
		else
		{
			emit("SELECT 'B|$i|' || idemtest_checksum();");
		}
	}
	emit("SET ROLE $c{role};") if $c{role} ne 'postgres';
	emit($sql);
	emit("\\echo 'S|$i|' :SQLSTATE");
	emit(@{ $c{post} }) if $c{post};
	emit('RESET ROLE;') if $c{role} ne 'postgres';
	emit("SELECT 'A|$i|' || idemtest_checksum();") if $c{checksum};
	$targets{ $c{fn} }++ if $c{target};
	push @calls, \%c;
	return \%c;
}

my %other = (alice => 'bob', bob => 'alice');

# ---- idem_begin ----

# Returns the call; its token variable is v<i>_tok.
sub begin_call
{
	my (%a) = @_;    # role op key fp policy lease ttl target label
	my ($op_sql, $op, $op_err) = @{ $a{op} };
	my ($key_sql, $key, $key_err) = @{ $a{key} };
	my $pol = $a{policy} // $policies[0];
	my $lease = $a{lease} // 'null';
	my $ttl = $a{ttl} // 'null';
	my @err = (@$op_err, @$key_err);
	push @err, '22023' if defined $pol->[2] && $pol->[2] eq 'bad';
	push @err, $fp_err{ $a{fp} } if $fp_err{ $a{fp} };

	my $lease_us = $lease eq 'null' ? 3600e6 : $iv{$lease}[1];
	my $ttl_us = $ttl eq 'null' ? $USEC_DAY : $iv{$ttl}[1];
	if ($lease ne 'null' && !defined $lease_us) { push @err, $iv{$lease}[2]; }
	if ($ttl ne 'null' && !defined $ttl_us) { push @err, $iv{$ttl}[2]; }
	if (defined $lease_us && ($lease_us <= 0 || $lease_us > $MAX_IV)) { push @err, '22023'; }
	if (defined $ttl_us && ($ttl_us < 60e6 || $ttl_us > $MAX_IV)) { push @err, '22023'; }
	if (defined $lease_us && defined $ttl_us && $lease_us > $ttl_us) { push @err, '22023'; }

	my $sql = sprintf(
		"SELECT 'R|\@I\@|' || b.status || '|' || coalesce(b.token::text, '') || '|' "
		  . "|| coalesce(md5(b.response::text), '') AS line, b.token AS tok "
		  . "FROM idem_begin(%s, %s, %s, %s, %s, %s) b \\gset v\@I\@_\n\\echo :v\@I\@_line",
		$op_sql, $key_sql, $fp_sql{ $a{fp} }, $pol->[1], iv_sql($lease), iv_sql($ttl));

	my %expect;
	my $k = mkey($a{role}, $op // '', $key // '');
	my $rec = $model{$k};
	my $effect;
	if (@err)
	{
		%expect = (err => \@err);
	}
	elsif ($rec && ($rec->{unknown}))
	{
		die 'scenario uses a record of unknown state';
	}
	elsif ($rec && !$rec->{lapsed} && !$rec->{expired})
	{
		if ($rec->{fp} ne $a{fp}) { %expect = (err => ['IK422']); }
		elsif ($rec->{state} eq 'completed')
		{
			my $md5 = $resp_md5{ $rec->{resp} };
			%expect = (ok => sub { $_[0] eq "replay||$md5" }, want => "replay||$md5");
		}
		elsif ($a{in_xact}) { %expect = (err => ['IK409']); }
		elsif (($pol->[2] // 'wait') eq 'raise') { %expect = (err => ['IK409']); }
		else { %expect = (err => ['55P03']); }
	}
	else
	{
		%expect = (ok => sub { $_[0] =~ /^new\|\d+\|$/ }, want => 'new|<token>|', changes => 1);
		$effect = sub {
			my ($c) = @_;
			$model{$k} = {
				role => $a{role}, op => $op, key => $key, tokvar => "v$c->{i}_tok",
				fp => $a{fp}, state => 'pending', lapsed => tiny($lease_us),
				ttl_us => $ttl_us, in_xact => $a{in_xact},
			};
		};
	}
	my $c = add_call(fn => 'idem_begin', role => $a{role}, sql => $sql, %expect,
		target => $a{target}, post => $a{post}, label => "idem_begin $a{label}");
	$effect->($c) if $effect;
	return $c;
}

# token classes: a sub(rec of this role, other role's rec) returning
# (sql, holds-the-key?, arg error)
sub token_sql
{
	my ($class, $rec, $orec) = @_;
	return ('NULL', 0, '22004') if $class eq 'null';
	return (':' . $rec->{tokvar}, 1, undef) if $class eq 'own' && $rec && $rec->{tokvar};
	return ("(:$rec->{tokvar} + 1000000)", 0, undef) if $class eq 'own_plus' && $rec && $rec->{tokvar};
	return (':' . $orec->{tokvar}, 0, undef) if $class eq 'other' && $orec && $orec->{tokvar};
	return ('9000000000000000000', 0, undef) if $class eq 'never';
	return ('-1', 0, undef) if $class eq 'neg';
	return ('0', 0, undef) if $class eq 'zero';
	return ('9223372036854775807', 0, undef) if $class eq 'max';
	return ('(-9223372036854775807 - 1)', 0, undef) if $class eq 'min';
	return ('9000000000000000000', 0, undef);
}
my @token_classes = qw(own own own own_plus other never neg zero max min null);

# ---- idem_finish / idem_abort / idem_renew on one key ----

sub act_call
{
	my (%a) = @_;    # fn role op key token(class) resp lease old(rec for stale own) target label
	my ($op_sql, $op, $op_err) = @{ $a{op} };
	my ($key_sql, $key, $key_err) = @{ $a{key} };
	my @err = (@$op_err, @$key_err);
	my $k = mkey($a{role}, $op // '', $key // '');
	my $rec = $model{$k};
	my $tokrec = $a{tokrec} // $rec;    # whose token 'own' names
	my $orec = defined $op && defined $key ? $model{ mkey($other{ $a{role} } // 'bob', $op, $key) } : undef;
	$orec = $a{orec} if $a{orec};
	my ($tok_sql, $holds, $tok_err) = token_sql($a{token}, $tokrec, $orec);
	push @err, $tok_err if $tok_err;
	$holds = $holds && $rec && $rec->{state} eq 'pending' && $tokrec
	  && $rec->{tokvar} eq $tokrec->{tokvar};

	my ($sql, %expect, $effect);
	my $fn = $a{fn};
	if ($fn eq 'idem_finish')
	{
		my $r = $a{resp};
		push @err, '22004' if $r eq 'null';
		push @err, $resp_err{$r} if $r ne 'null' && $resp_err{$r};
		$sql = "SELECT 'R|\@I\@|' || coalesce(idem_finish($op_sql, $key_sql, $tok_sql, $resp_sql{$r})::text, 'void');";
		if (@err) { %expect = (err => \@err); }
		elsif ($holds)
		{
			%expect = (ok => sub { $_[0] eq '' }, want => '', changes => 1);
			$effect = sub { $rec->{state} = 'completed'; $rec->{resp} = $r; $rec->{lapsed} = 0; $rec->{expired} = 0; };
		}
		else { %expect = (err => ['IK412']); }
	}
	elsif ($fn eq 'idem_abort')
	{
		$sql = "SELECT 'R|\@I\@|' || idem_abort($op_sql, $key_sql, $tok_sql)::text;";
		if (@err) { %expect = (err => \@err); }
		elsif ($holds)
		{
			%expect = (ok => sub { $_[0] eq 'true' }, want => 'true', changes => 1);
			$effect = sub { delete $model{$k}; };
		}
		else { %expect = (ok => sub { $_[0] eq 'false' }, want => 'false'); }
	}
	else    # idem_renew
	{
		my $lease = $a{lease};
		my $us = $lease eq 'null' ? undef : $iv{$lease}[1];
		if ($lease eq 'null') { push @err, '22004'; }
		elsif (!defined $us) { push @err, $iv{$lease}[2]; }
		elsif ($us <= 0 || $us > $MAX_IV) { push @err, '22023'; }
		$sql = "SELECT 'R|\@I\@|' || round(extract(epoch FROM idem_renew($op_sql, $key_sql, $tok_sql, "
		  . iv_sql($lease) . ") - clock_timestamp())::numeric, 1);";
		if (@err) { %expect = (err => \@err); }
		elsif ($holds && $us > $rec->{ttl_us}) { %expect = (err => ['22023']); }
		elsif ($holds)
		{
			my $secs = $us / 1e6;
			my $check = sub { $_[0] =~ /^-?[\d.]+$/ && $_[0] >= $secs - 10 && $_[0] <= $secs + 1 };
			if ($rec->{lapsed})
			{
				# the contract does not say whether a lapsed claim may be
				# renewed: accept both, with a lease that keeps it lapsed
				die 'renew of a lapsed claim needs a tiny lease' unless tiny($us);
				%expect = (ok => $check, err => ['IK412'], want => "~$secs or IK412", changes => 1);
			}
			else
			{
				%expect = (ok => $check, want => "~$secs", changes => 1);
				$effect = sub { $rec->{lapsed} = tiny($us); };
			}
		}
		else { %expect = (err => ['IK412']); }
	}
	my $c = add_call(fn => $fn, role => $a{role}, sql => $sql, %expect,
		target => $a{target}, label => "$fn $a{label}");
	$effect->() if $effect;
	return $c;
}

sub inspect_call
{
	my (%a) = @_;
	my ($op_sql, $op, $op_err) = @{ $a{op} };
	my ($key_sql, $key, $key_err) = @{ $a{key} };
	my $sql = "SELECT 'R|\@I\@|' || i.state || '|' || i.token || '|' || coalesce(md5(i.fingerprint), 'N') "
	  . "|| '|' || coalesce(md5(i.response::text), 'N') FROM idem_inspect($op_sql, $key_sql) i;";
	my %expect;
	my @null = grep { $_ eq '22004' } (@$op_err, @$key_err);
	my @other = grep { $_ ne '22004' } (@$op_err, @$key_err);
	if (@null)
	{
		# not STRICT (1.3): 22004, or another argument's error
		%expect = (err => [ '22004', @other ]);
	}
	elsif (@other) { %expect = (err => \@other); }
	else
	{
		my $rec = $model{ mkey($a{role}, $op, $key) };
		if (!$rec) { %expect = (ok => sub { !defined $_[0] }, want => 'no row'); }
		else
		{
			my $state = $rec->{state} eq 'pending'
			  ? ($rec->{lapsed} ? 'lapsed' : 'pending')
			  : ($rec->{expired} ? 'expired' : 'completed');
			my $resp = $rec->{state} eq 'completed' ? $resp_md5{ $rec->{resp} } : 'N';
			my $tokvar = $rec->{tokvar};
			%expect = (
				ok => sub {
					my ($r, $tokens) = @_;
					defined $r && $r eq "$state|" . ($tokens->{$tokvar} // '?') . "|$fp_md5{$rec->{fp}}|$resp";
				},
				want => "$state|<$tokvar>|$fp_md5{$rec->{fp}}|$resp");
		}
	}
	return add_call(fn => 'idem_inspect', role => $a{role}, sql => $sql, %expect,
		checksum => 1, target => 1, label => "idem_inspect $a{label}");
}

# ---- record states ----

sub pick { return $_[ int(rand(@_)) ]; }
sub name_of { my ($class) = @_; return [ $name_class{$class}->() ]; }

my @resp_small = qw(obj empty_obj json_null arr str zero unicode escapes);

# Put (role, op, key) in state $state for a call with fingerprint $fp.
# Returns the records involved: (mine, old token's record, other role's).
sub setup_state
{
	my ($state, $role, $op, $key, $fp, %o) = @_;
	return () unless defined $op->[1] && defined $key->[1];
	# the record is made with a fingerprint the contract accepts: for a
	# call with a refused one, any (it must not matter)
	$fp = pick(@fp_ok) if $fp_err{$fp};
	my $diff = pick(grep { $_ ne $fp } @fp_ok);
	my $ttl = $o{ttl} // 'null';
	my %b = (role => $role, op => $op, key => $key, ttl => $ttl, label => "setup $state");
	# a live lease that fits the ttl (1 minute outlasts any batch)
	my $long = $ttl eq 'm1' ? 'm1' : 'h1';
	my ($mine, $old, $oth);
	my $rec = sub { $model{ mkey($_[0], $op->[1], $key->[1]) } };
	if ($state eq 'completed' || $state eq 'completed_diff' || $state eq 'expired')
	{
		begin_call(%b, fp => $state eq 'completed_diff' ? $diff : $fp, lease => $long);
		act_call(fn => 'idem_finish', role => $role, op => $op, key => $key, token => 'own',
			resp => pick(@resp_small), label => 'setup');
		$old = $rec->($role);
		if ($state eq 'expired')
		{
			# in whichever table the durability mode keeps the record
			emit(sprintf("UPDATE $_ SET expires_at = clock_timestamp() - interval '1 s'"
				  . " WHERE role_id = '%s'::regrole AND operation = %s AND key = %s;",
				$role, $op->[0], $key->[0]))
			  for qw(idem_record idem_result);
			$old->{expired} = 1;
		}
	}
	elsif ($state eq 'pending' || $state eq 'pending_diff')
	{
		begin_call(%b, fp => $state eq 'pending_diff' ? $diff : $fp, lease => $long);
	}
	elsif ($state eq 'lapsed' || $state eq 'lapsed_diff')
	{
		begin_call(%b, fp => $state eq 'lapsed_diff' ? $diff : $fp, lease => 'us1');
	}
	elsif ($state eq 'aborted')
	{
		begin_call(%b, fp => $fp, lease => $long);
		$old = { %{ $rec->($role) } };
		act_call(fn => 'idem_abort', role => $role, op => $op, key => $key, token => 'own', label => 'setup');
	}
	elsif ($state eq 'taken_over')
	{
		begin_call(%b, fp => $fp, lease => 'us1');
		$old = { %{ $rec->($role) } };
		begin_call(%b, fp => $fp, lease => $long);
	}
	elsif ($state eq 'other_completed' || $state eq 'other_pending')
	{
		my $r2 = $other{$role};
		begin_call(%b, role => $r2, fp => $fp, lease => $long);
		act_call(fn => 'idem_finish', role => $r2, op => $op, key => $key, token => 'own',
			resp => pick(@resp_small), label => 'setup')
		  if $state eq 'other_completed';
	}
	elsif ($state eq 'both_pending')
	{
		begin_call(%b, role => $other{$role}, fp => $fp, lease => $long);
		begin_call(%b, fp => $fp, lease => $long);
	}
	elsif ($state ne 'fresh') { die "unknown state $state"; }
	$mine = $rec->($role);
	$oth = $rec->($other{$role});
	return ($mine, $old, $oth);
}

my @begin_states = qw(fresh completed completed_diff pending pending_diff lapsed lapsed_diff
  expired other_completed other_pending);
my @act_states = qw(fresh pending lapsed completed aborted taken_over other_pending both_pending);
# random plans: mostly states where some token holds the key
my @act_states_weighted = (@act_states, qw(pending pending lapsed both_pending));

# pick a class: mostly valid ones, so that states matter
sub pick_name { return name_of(rand() < 0.8 ? pick(@valid_names) : pick(map { $_->[0] } @name_classes)); }

# ---- batches: compare the table with the model, then start afresh ----

my $batch = 0;
my $in_batch = 0;
sub end_batch
{
	$batch++;
	my %snap;
	for my $k (keys %model)
	{
		my $r = $model{$k};
		next if $r->{unknown};
		$snap{ join('|', $r->{role}, md5_hex(encode('UTF-8', $r->{op})), md5_hex(encode('UTF-8', $r->{key}))) } = {
			tokvar => $r->{tokvar},
			rest => join('|', $r->{state} eq 'pending' ? 'true' : 'false', $fp_md5{ $r->{fp} },
				$r->{state} eq 'completed' ? $resp_md5{ $r->{resp} } : 'N',
				($r->{lapsed} || $r->{expired}) ? 'true' : 'false'),
		};
	}
	my %unknown = map { (join('|', $_->{role}, md5_hex(encode('UTF-8', $_->{op})), md5_hex(encode('UTF-8', $_->{key}))) => 1) }
	  grep { $_->{unknown} } values %model;
	my %stats;
	for my $r (grep { !$_->{unknown} } values %model)
	{
		my $s = $stats{ $r->{role} }{ md5_hex(encode('UTF-8', $r->{op})) } //= [ 0, 0, 0, 0 ];
		$s->[ ($r->{state} eq 'pending' ? 0 : 2) + (($r->{lapsed} || $r->{expired}) ? 1 : 0) ]++;
	}
	push @batches, { snap => \%snap, unknown => \%unknown, stats => \%stats,
		has_unknown => scalar(keys %unknown) };
	emit("SELECT 'D|$batch|' || r.rolname || '|' || md5(operation) || '|' || md5(key) || '|' || token || '|' "
		  . "|| (completed_at IS NULL) || '|' || coalesce(md5(fingerprint), 'N') || '|' "
		  . "|| coalesce(md5(response::text), 'N') || '|' || (expires_at <= clock_timestamp()) "
		  . "FROM idemtest_records JOIN pg_roles r ON r.oid = role_id;");
	for my $role (qw(alice bob))
	{
		emit("SET ROLE $role;",
			"SELECT 'T|$batch|$role|' || md5(operation) || '|' || pending || '|' || lapsed || '|' "
			  . "|| completed || '|' || expired FROM idem_stats;",
			'RESET ROLE;');
	}
	emit('DELETE FROM idem_record;', 'DELETE FROM idem_result;');
	%model = ();
	$in_batch = 0;
	return;
}
sub tick { end_batch() if ++$in_batch >= 60; return; }

# time stamps per section, for the log
sub section { my ($name) = @_; emit("SELECT 'M|$name|' || extract(epoch FROM clock_timestamp());"); return; }

# ---------------------------------------------------------------- generate

emit('\set ON_ERROR_STOP 0', '\set QUIET 1', '\pset tuples_only on', '\pset format unaligned',
	q{SET idempotency.lease = '1h';}, q{SET idempotency.in_flight = 'wait';},
	q{SET lock_timeout = '20ms';}, q{SET statement_timeout = '60s';},
	q{SET client_min_messages = error;});

# ---- idem_begin: one factor at a time, then random combinations ----
section('idem_begin');
{
	my @plans;
	my %base = (op => 'plain', key => 'plain', fp => 'a', policy => 0, lease => 'null', ttl => 'null', state => 'fresh');
	push @plans, { %base, op => $_->[0] } for @name_classes;
	push @plans, { %base, key => $_->[0] } for @name_classes;
	push @plans, { %base, fp => $_ } for @fp_classes, sort keys %fp_rare;
	push @plans, { %base, policy => $_ } for 0 .. $#policies;
	push @plans, { %base, lease => $_ } for @iv_classes;
	push @plans, { %base, ttl => $_ } for @iv_classes;
	for my $st (@begin_states)
	{
		for my $pol (0 .. 2)
		{
			push @plans, { %base, state => $st, policy => $pol, fp => $_ } for @fp_classes;
		}
		# a 100 MB fingerprint against every record state
		push @plans, { %base, state => $st, policy => int(rand(3)), fp => $_ } for sort keys %fp_rare;
	}
	while (@plans < 1500 * $scale)
	{
		push @plans, {
			op => rand() < 0.9 ? pick(@valid_names) : pick(map { $_->[0] } @name_classes),
			key => rand() < 0.9 ? pick(@valid_names) : pick(map { $_->[0] } @name_classes),
			fp => pick(@fp_classes),
			policy => rand() < 0.9 ? int(rand(3)) : int(rand(@policies)),
			lease => rand() < 0.8 ? pick(qw(null h1 us1 us06 day_minus h23 day1 neg_month)) : pick(@iv_classes),
			ttl => rand() < 0.8 ? pick(qw(null day1 y100 month1 h24)) : pick(@iv_classes),
			state => pick(@begin_states),
		};
	}
	for my $p (@plans)
	{
		my $role = pick('alice', 'bob');
		my $op = name_of($p->{op});
		my $key = name_of($p->{key});
		setup_state($p->{state}, $role, $op, $key, $p->{fp});
		begin_call(role => $role, op => $op, key => $key, fp => $p->{fp}, policy => $policies[ $p->{policy} ],
			lease => $p->{lease}, ttl => $p->{ttl}, target => 1,
			label => "op=$p->{op} key=$p->{key} fp=$p->{fp} policy=$policies[$p->{policy}][0] lease=$p->{lease} ttl=$p->{ttl} state=$p->{state}");
		tick();
	}
}

# ---- same transaction: re-begin is IK409 at once; finish then replay ----
section('same transaction');
for my $n (1 .. 20 * $scale)
{
	my $role = pick('alice', 'bob');
	my ($op, $key) = (pick_name(), name_of('plain'));
	$op = name_of('plain') unless defined $op->[1];
	my $pol = $policies[ int(rand(3)) ];
	emit('BEGIN;');
	begin_call(role => $role, op => $op, key => $key, fp => 'a', lease => 'h1', label => 'in transaction', in_xact => 1);
	emit('SAVEPOINT sp;');
	begin_call(role => $role, op => $op, key => $key, fp => 'a', policy => $pol, target => 1,
		label => "same transaction re-begin policy=$pol->[0]", in_xact => 1, post => ['ROLLBACK TO sp;']);
	act_call(fn => 'idem_finish', role => $role, op => $op, key => $key, token => 'own', resp => 'obj',
		label => 'in transaction');
	begin_call(role => $role, op => $op, key => $key, fp => 'a', policy => $pol, target => 1,
		label => 'same transaction after finish: replay');
	emit($n % 2 ? 'COMMIT;' : 'ROLLBACK;');
	delete $model{ mkey($role, $op->[1], $key->[1]) } unless $n % 2;
	tick();
}

# ---- idem_finish, idem_abort, idem_renew ----
for my $fn ('idem_finish', 'idem_abort', 'idem_renew')
{
	section($fn);
	my $n = ($fn eq 'idem_finish' ? 1200 : 1000) * $scale;
	my @plans;
	# one factor at a time around a held claim
	my %base = (op => 'plain', key => 'plain', token => 'own', resp => 'obj', lease => 'h1', state => 'pending');
	push @plans, { %base, op => $_->[0] } for @name_classes;
	push @plans, { %base, key => $_->[0] } for @name_classes;
	push @plans, { %base, token => $_ } for @token_classes;
	push @plans, { %base, state => $_ } for @act_states;
	if ($fn eq 'idem_finish') { push @plans, { %base, resp => $_ } for @resp_classes; }
	if ($fn eq 'idem_renew') { push @plans, { %base, lease => $_ } for @iv_classes; }
	for my $st (@act_states)
	{
		push @plans, { %base, state => $st, token => $_ } for @token_classes;
	}
	while (@plans < $n)
	{
		push @plans, {
			op => rand() < 0.85 ? pick(@valid_names) : pick(map { $_->[0] } @name_classes),
			key => rand() < 0.85 ? pick(@valid_names) : pick(map { $_->[0] } @name_classes),
			token => rand() < 0.5 ? 'own' : pick(@token_classes),
			resp => rand() < 0.7 ? pick(@good_resps) : pick(@resp_classes),
			lease => rand() < 0.7 ? pick(qw(h1 us1 h23 day1 m1)) : pick(@iv_classes),
			state => pick(@act_states_weighted),
			ttl => pick(qw(null m1 y100)),
		};
	}
	for my $p (@plans)
	{
		my $role = pick('alice', 'bob');
		my $op = name_of($p->{op});
		my $key = name_of($p->{key});
		my ($mine, $old, $oth) = setup_state($p->{state}, $role, $op, $key, 'a', ttl => $p->{ttl});
		my $lease = $p->{lease};
		# a lapsed claim renewed: only with a lease that keeps it lapsed (see top)
		if ($fn eq 'idem_renew' && $mine && $mine->{lapsed} && $p->{token} eq 'own')
		{
			$lease = pick(qw(us1 us06 day_minus zero neg_s null days_over y1000000));
		}
		act_call(fn => $fn, role => $role, op => $op, key => $key, token => $p->{token},
			tokrec => $old // $mine, orec => $oth, resp => $p->{resp}, lease => $lease, target => 1,
			label => "op=$p->{op} key=$p->{key} token=$p->{token} state=$p->{state}"
			  . ($fn eq 'idem_finish' ? " resp=$p->{resp}" : '') . ($fn eq 'idem_renew' ? " lease=$lease ttl=" . ($p->{ttl} // 'null') : ''));
		tick();
	}
}

# ---- idem_inspect ----
section('idem_inspect');
{
	my @plans;
	push @plans, { op => $_->[0], key => 'plain', state => 'completed' } for @name_classes;
	push @plans, { op => 'plain', key => $_->[0], state => 'pending' } for @name_classes;
	while (@plans < 1000 * $scale)
	{
		push @plans, { op => pick(map { $_->[0] } @name_classes), key => pick(@valid_names),
			state => pick(@begin_states, 'aborted', 'taken_over') };
	}
	for my $p (@plans)
	{
		my $role = pick('alice', 'bob');
		my $op = name_of($p->{op});
		my $key = name_of($p->{key});
		setup_state($p->{state}, $role, $op, $key, pick(@fp_classes));
		inspect_call(role => $role, op => $op, key => $key, label => "op=$p->{op} key=$p->{key} state=$p->{state}");
		tick();
	}
}

# ---- idem_fingerprint: the contract's encoding, for any arguments ----
section('idem_fingerprint');
{
	my @args = (
		'NULL', 'NULL::text', 'NULL::int', q{''}, q{'a'}, q{'bc'}, q{'ab'}, q{'c'}, '1', '0', '-1',
		'1.5::float8', q{'NaN'::float8}, 'true', q{'\x00'::bytea}, q{''::bytea}, q{'{}'::jsonb},
		q{'{"a": [1, null]}'::jsonb}, 'ARRAY[1, 2]', 'ARRAY[NULL]::text[]', q{ROW(1, 'a')},
		q{'2020-01-01'::date}, q{repeat('x', 100000)}, lit("\x{1F600}\x{e9}"), q{E'\n'}, q{'null'},
		q{'NULL'}, q{'\x00'}, lit("\x01"), q{' '}, q{'9223372036854775807'::int8}, q{'a,b'},
		q{'{a,b}'::text[]}, q{'(1,2)'::point}, q{'192.168.0.1'::inet}, q{'1 day'::interval},
	);
	my @plans;
	push @plans, [$_] for @args;
	push @plans, [ q{'a'}, q{'bc'} ], [ q{'ab'}, q{'c'} ], [ 'NULL', q{''} ], [ q{''}, 'NULL' ],
	  [ ('NULL') x 100 ], [ (q{'x'}) x 100 ];
	while (@plans < 1000 * $scale)
	{
		push @plans, [ map { pick(@args) } 1 .. 1 + int(rand(rand() < 0.9 ? 6 : 99)) ];
	}
	for my $p (@plans)
	{
		my $list = join(', ', @$p);
		# text forms are what the types' output functions print (format's
		# %s), not casts to text: true::text is 'true', its output 't'
		my $texts = join(', ', map { "CASE WHEN ($_) IS NOT DISTINCT FROM NULL THEN NULL ELSE format('%s', $_) END" } @$p);
		my $sql = "SELECT 'R|\@I\@|' || (octet_length(idem_fingerprint($list)) = 32 "
		  . "AND idem_fingerprint($list) = ref_fp(VARIADIC ARRAY[$texts]::text[]))::text;";
		add_call(fn => 'idem_fingerprint', role => pick('alice', 'bob'), sql => $sql,
			ok => sub { $_[0] eq 'true' }, want => 'true', checksum => 1, target => 1,
			label => 'idem_fingerprint(' . (length($list) > 80 ? substr($list, 0, 80) . '...' : $list) . ')');
	}
	# the VARIADIC array forms
	for my $p ([ "VARIADIC ARRAY['a', 'bc']", q{'a', 'bc'} ], [ 'VARIADIC ARRAY[NULL, 1]', 'NULL::int, 1' ],
		[ "VARIADIC '{}'::text[]", undef ], [ 'VARIADIC NULL::text[]', undef ])
	{
		my ($var, $plain) = @$p;
		my $sql = defined $plain
		  ? "SELECT 'R|\@I\@|' || (idem_fingerprint($var) = idem_fingerprint($plain))::text;"
		  : "SELECT 'R|\@I\@|' || coalesce(encode(idem_fingerprint($var), 'hex'), 'NULL');";
		my $want = !defined $plain && $var =~ /NULL/ ? 'NULL'
		  : !defined $plain ? 'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'
		  : 'true';
		add_call(fn => 'idem_fingerprint', role => 'alice', sql => $sql, ok => sub { $_[0] eq $want },
			want => $want, checksum => 1, target => 1, label => "idem_fingerprint($var)");
	}
}

# ---- idem_purge ----
section('idem_purge');
{
	my @max = ([ 'NULL', undef, '22004' ], [ '0', 0, '22023' ], [ '-1', -1, '22023' ],
		[ '(-2147483647 - 1)', -2147483648, '22023' ], [ '1', 1 ], [ '2', 2 ], [ '5', 5 ],
		[ '10000', 10000 ], [ '2147483647', 2147483647 ], [ '2147483648::int', undef, '22003' ]);
	for my $n (1 .. 1000 * $scale)
	{
		my $m = $max[ $n <= @max * 3 ? ($n - 1) % @max : int(rand(@max)) ];
		my $role = $n <= @max * 3 ? (qw(alice admin postgres))[ int(($n - 1) / @max) ] : pick(qw(alice admin postgres));
		# only the records set up here are expired: forget any other
		emit('DELETE FROM idem_record WHERE expires_at <= clock_timestamp();',
			'DELETE FROM idem_result WHERE expires_at <= clock_timestamp();');
		delete $model{$_} for grep { $model{$_}{lapsed} || $model{$_}{expired} || $model{$_}{unknown} } keys %model;
		my $k = int(rand(4));
		my @lapsed;
		for (1 .. $k)
		{
			my $r = pick('alice', 'bob');
			my ($op, $key) = (name_of('plain'), name_of(pick(@valid_names)));
			if (rand() < 0.5) { setup_state('lapsed', $r, $op, $key, 'a'); }
			else { setup_state('expired', $r, $op, $key, 'a'); }
			push @lapsed, mkey($r, $op->[1], $key->[1]);
		}
		setup_state('pending', pick('alice', 'bob'), name_of('plain'), name_of('plain'), 'b') if rand() < 0.5;
		my %expect;
		# the privilege check comes before the call; a bad literal before both
		if ($m->[2] && $m->[2] eq '22003') { %expect = (err => ['22003']); }
		elsif ($role eq 'alice') { %expect = (err => ['42501']); }
		elsif (defined $m->[2]) { %expect = (err => [ $m->[2] ]); }
		else
		{
			my $want = $m->[1] < $k ? $m->[1] : $k;
			%expect = (ok => sub { $_[0] eq $want }, want => $want, changes => $want > 0);
			if ($m->[1] < $k) { $model{$_}{unknown} = 1 for @lapsed; }
			else { delete $model{$_} for @lapsed; }
		}
		add_call(fn => 'idem_purge', role => $role, sql => "SELECT 'R|\@I\@|' || idem_purge($m->[0]);",
			%expect, target => 1,
			label => "idem_purge($m->[0]) as $role with $k expired");
		tick();
	}
}

# ---- idem_set_logged, idem_stats_reset, a superuser-only setting ----
section('idem_set_logged');
{
	my $persistence = 'u';
	for my $n (1 .. 1000 * $scale)
	{
		my $role = pick(qw(alice admin postgres));
		my $arg = pick(qw(true false NULL));
		setup_state(pick(qw(completed pending lapsed)), pick('alice', 'bob'), name_of('plain'), name_of(pick(@valid_names)), 'a')
		  if $n % 5 == 0;
		my %expect;
		# not STRICT (1.3): NULL is 22004, after the EXECUTE check
		if ($role eq 'alice') { %expect = (err => ['42501']); }
		elsif ($arg eq 'NULL') { %expect = (err => ['22004']); }
		else
		{
			%expect = (ok => sub { $_[0] eq '' }, want => '');
			$persistence = $arg eq 'true' ? 'p' : 'u';
		}
		add_call(fn => 'idem_set_logged', role => $role,
			sql => "SELECT 'R|\@I\@|' || coalesce(idem_set_logged($arg)::text, 'null');",
			%expect, checksum => 1, target => 1, label => "idem_set_logged($arg) as $role");
		emit("SELECT 'P|$ncall|' || relpersistence::text FROM pg_class WHERE oid = 'idem_record'::regclass;");
		$calls[-1]{persistence} = $persistence;
		tick();
	}
	section('idem_stats_reset');
	for my $n (1 .. 100 * $scale)
	{
		my $role = pick(qw(alice bob admin postgres));
		add_call(fn => 'idem_stats_reset', role => $role,
			sql => "SELECT 'R|\@I\@|' || coalesce(idem_stats_reset()::text, 'void');",
			$role =~ /^(alice|bob)$/ ? (err => ['42501']) : (ok => sub { $_[0] eq '' }, want => ''),
			checksum => 1, target => 1, label => "idem_stats_reset() as $role");
		add_call(fn => 'idem_counters', role => $role,
			sql => "SELECT 'R|\@I\@|' || (claims >= 0 AND purged >= 0)::text FROM idem_counters();",
			ok => sub { $_[0] eq 'true' }, want => 'true', checksum => 1, target => 1,
			label => "idem_counters() as $role");
		add_call(fn => 'SET idempotency.max_response_size', role => pick(qw(alice bob admin)),
			sql => q{SET idempotency.max_response_size = '1GB';}, err => ['42501'],
			checksum => 1, target => 1, label => 'SET idempotency.max_response_size as a plain role');
	}
}
end_batch() if $in_batch;
section('end');

# ---------------------------------------------------------------- run

my $file = $node->basedir . '/hostile.sql';
open(my $fh, '>:encoding(UTF-8)', $file) or die "cannot write $file: $!";
print $fh join("\n", @script), "\n";
close $fh;
note(sprintf('generated %d calls (%s) in %d lines', $ncall,
	join(', ', map { "$_ $targets{$_}" } sort keys %targets), scalar @script));

my ($stdout, $stderr) = ('', '');
my $t0 = time;
my $ok = IPC::Run::run(
	[ 'psql', '-X', '-q', '-A', '-t', '-v', 'ON_ERROR_STOP=0', '-v', 'VERBOSITY=terse',
		'-h', $node->host, '-p', $node->port, '-d', 'postgres', '-f', $file ],
	'>', \$stdout, '2>', \$stderr,
	IPC::Run::timeout(600));
note(sprintf('psql ran the script in %.1f s', time - $t0));
ok($ok, 'psql ran the whole script') or diag(substr($stderr, -2000));

# ---------------------------------------------------------------- check

# psql's errors, by script line, for diagnostics
my %errors_at;
for (split /\n/, $stderr)
{
	$errors_at{$1} .= "$2\n" if /^psql:[^:]*:(\d+): (.*)$/;
}

my (%res, %state, %before, %after, %pers, @dump, @stats, @sections);
for (split /\n/, $stdout)
{
	if (/^R\|(\d+)\|(.*)$/s) { $res{$1} = $2; }
	elsif (/^S\|(\d+)\| (\w+)$/) { $state{$1} = $2; }
	elsif (/^B\|(\d+)\|(.*)$/) { $before{$1} = $2; }
	elsif (/^A\|(\d+)\|(.*)$/) { $after{$1} = $2; }
	elsif (/^P\|(\d+)\|(.*)$/) { $pers{$1} = $2; }
	elsif (/^D\|(\d+)\|(.*)$/) { push @{ $dump[$1] }, $2; }
	elsif (/^T\|(\d+)\|(.*)$/) { push @{ $stats[$1] }, $2; }
	elsif (/^M\|(.*)\|([\d.]+)$/) { push @sections, [ $1, $2 ]; }
}

note('time per section: ' . join(', ', map { sprintf('%s %.1fs', $sections[$_ - 1][0], $sections[$_][1] - $sections[$_ - 1][1]) } 1 .. $#sections));

# tokens handed out, in order
my %tokens;
my ($last_token, @token_order) = (0);
for my $c (@calls)
{
	next unless $c->{fn} eq 'idem_begin' && defined $res{ $c->{i} };
	if ($res{ $c->{i} } =~ /^new\|(\d+)\|/)
	{
		$tokens{"v$c->{i}_tok"} = $1;
		push @token_order, $1;
	}
}

$before{ $_->{i} } //= $after{ $_->{before_from} } for grep { $_->{before_from} } @calls;

my (@bad, %by_fn, %codes_seen);
for my $c (@calls)
{
	my $i = $c->{i};
	my $st = $state{$i} // 'none';
	my $r = $res{$i};
	my $why;
	$codes_seen{ $c->{fn} }{$st}++ if $c->{target};
	if ($st eq '00000')
	{
		if (!$c->{ok}) { $why = 'succeeded (' . ($r // 'no row') . '), expected ' . join('/', @{ $c->{err} }); }
		elsif (!$c->{ok}->($r, \%tokens)) { $why = 'returned ' . ($r // 'no row') . ', expected ' . ($c->{want} // '?'); }
	}
	else
	{
		if (!$c->{err} || !grep { $_ eq $st } @{ $c->{err} })
		{
			$why = "failed with $st, expected " . ($c->{err} ? join('/', @{ $c->{err} }) . ($c->{ok} ? ' or success' : '') : ($c->{want} // 'success'));
		}
	}
	if (!$why && $c->{checksum} && ($st ne '00000' || !$c->{changes}))
	{
		if (!defined $before{$i} || !defined $after{$i}) { $why = 'checksum missing'; }
		elsif ($before{$i} ne $after{$i}) { $why = "changed the record table ($before{$i} -> $after{$i}) although it " . ($st eq '00000' ? 'should change nothing' : "failed with $st"); }
	}
	if (!$why && defined $c->{persistence} && $st eq '00000' && ($pers{$i} // '') ne $c->{persistence})
	{
		$why = "relpersistence is " . ($pers{$i} // '?') . ", expected $c->{persistence}";
	}
	$by_fn{ $c->{fn} }{ $why ? 'bad' : 'good' }++ if $c->{target};
	if ($why)
	{
		my $err = join('', map { $errors_at{$_} // '' } $c->{line} .. $c->{line} + 6);
		push @bad, { c => $c, text => "call $i ($c->{role}) $c->{label}: $why" . ($err ? "\n    server said: $err" : '') };
	}
}

for my $fn (sort keys %by_fn)
{
	my $n = ($by_fn{$fn}{good} // 0) + ($by_fn{$fn}{bad} // 0);
	my @mine = map { $_->{text} } grep { $_->{c}{target} && $_->{c}{fn} eq $fn } @bad;
	ok(!@mine, "$fn: $n generated calls behave per contract")
	  or diag(join("\n", @mine[ 0 .. ($#mine < 25 ? $#mine : 24) ]) . (@mine > 25 ? "\n... " . (@mine - 25) . ' more' : ''));
	note("$fn outcomes: " . join(', ', map { "$_ x$codes_seen{$fn}{$_}" } sort keys %{ $codes_seen{$fn} }));
}
for my $fn (qw(idem_begin idem_finish idem_abort idem_renew idem_inspect idem_fingerprint idem_purge idem_set_logged))
{
	cmp_ok($targets{$fn} // 0, '>=', 1000, "$fn: at least 1,000 argument combinations");
}
my @setup_bad = map { $_->{text} } grep { !$_->{c}{target} } @bad;
ok(!@setup_bad, 'the calls setting up record states behave per contract too')
  or diag(join("\n", @setup_bad[ 0 .. ($#setup_bad < 25 ? $#setup_bad : 24) ]));

# tokens strictly increase
my @dec = grep { $token_order[$_] <= $token_order[ $_ - 1 ] } 1 .. $#token_order;
ok(!@dec, sprintf('%d new tokens, strictly increasing', scalar @token_order))
  or diag("token $token_order[$dec[0]] after $token_order[$dec[0]-1]");

# each batch: the table is the model, idem_stats shows each role's own
my (@table_bad, @stats_bad);
for my $b (1 .. $#batches + 1)
{
	my $m = $batches[ $b - 1 ];
	my %seen;
	for my $row (@{ $dump[$b] // [] })
	{
		my ($role, $op, $key, $token, $rest) = $row =~ /^(\w+)\|(\w+)\|(\w+)\|(\d+)\|(.*)$/;
		my $id = "$role|$op|$key";
		next if $m->{unknown}{$id};
		$seen{$id} = 1;
		my $want = $m->{snap}{$id};
		if (!$want) { push @table_bad, "batch $b: unexpected record $row"; next; }
		my $wtok = $tokens{ $want->{tokvar} } // "<$want->{tokvar}>";
		push @table_bad, "batch $b: record $id is $token|$rest, model says $wtok|$want->{rest}"
		  if "$token|$rest" ne "$wtok|$want->{rest}";
	}
	push @table_bad, map { "batch $b: record $_ missing" } grep { !$seen{$_} } keys %{ $m->{snap} };

	next if $m->{has_unknown};
	my %got;
	for my $row (@{ $stats[$b] // [] })
	{
		my ($role, $op, @n) = split /\|/, $row;
		$got{$role}{$op} = join('|', @n);
	}
	for my $role (qw(alice bob))
	{
		my %w = map { $_ => join('|', @{ $m->{stats}{$role}{$_} }) } keys %{ $m->{stats}{$role} // {} };
		my %g = %{ $got{$role} // {} };
		my $ws = join(',', map { "$_=$w{$_}" } sort keys %w);
		my $gs = join(',', map { "$_=$g{$_}" } sort keys %g);
		push @stats_bad, "batch $b, $role: idem_stats $gs; model $ws" if $ws ne $gs;
	}
}
ok(!@table_bad, sprintf('after each of %d batches the record table is exactly the model', scalar @batches))
  or diag(join("\n", @table_bad[ 0 .. ($#table_bad < 20 ? $#table_bad : 19) ]));
ok(!@stats_bad, 'idem_stats of each role counts exactly that role\'s records')
  or diag(join("\n", @stats_bad[ 0 .. ($#stats_bad < 10 ? $#stats_bad : 9) ]));

# ---------------------------------------------------------------- direct checks

# As alice, verbose: (SQLSTATE or 00000, stdout, stderr)
sub as_alice
{
	my ($sql) = @_;
	my ($rc, $out, $err) = $node->psql('postgres', "SET ROLE alice;\n$sql",
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	my ($code) = $err =~ /ERROR:  ([0-9A-Z]{5}):/;
	return ($rc == 0 ? '00000' : $code // "rc $rc", $out, $err);
}
sub checksum { return $node->safe_psql('postgres', 'SELECT idemtest_checksum()'); }

# IK422's DETAIL: both fingerprints in hex, whole up to 64 bytes; beyond,
# the first 64 bytes, "..." and the size
my %detail_fp = (
	null => [ 'NULL::bytea', 'NULL' ],
	one  => [ q{'\x01'::bytea}, '\\x01' ],
	b64  => [ q{decode(repeat('ab', 64), 'hex')}, '\\x' . ('ab' x 64) ],
	b65  => [ q{decode(repeat('c3', 65), 'hex')}, '\\x' . ('c3' x 64) . '... (65 bytes)' ],
	b1024 => [ q{decode(repeat('ab', 1024), 'hex')}, '\\x' . ('ab' x 64) . '... (1024 bytes)' ],
	c1024 => [ q{decode(repeat('cd', 1023) || 'ef', 'hex')}, '\\x' . ('cd' x 64) . '... (1024 bytes)' ],
);
for my $case ([ 'b64', 'one' ], [ 'one', 'b64' ], [ 'b65', 'one' ], [ 'b1024', 'c1024' ],
	[ 'null', 'b65' ], [ 'b1024', 'null' ])
{
	my ($stored, $req) = @$case;
	my $key = "detail-$stored-$req";
	my ($st) = as_alice("SELECT status FROM idem_begin('detail', '$key', $detail_fp{$stored}[0], lease => '1h')");
	is($st, '00000', "claim $key");
	my $before = checksum();
	my ($code, undef, $err) = as_alice("SELECT status FROM idem_begin('detail', '$key', $detail_fp{$req}[0])");
	is($code, 'IK422', "$key: another fingerprint is IK422");
	my $want = "DETAIL:  Stored fingerprint: $detail_fp{$stored}[1]. Request fingerprint: $detail_fp{$req}[1].\n";
	ok(index($err, $want) >= 0, "$key: DETAIL shows the fingerprints ($stored, $req)")
	  or diag("want: ${want}got: $err");
	is(checksum(), $before, "$key: and changes nothing");
}

# a 100 MB fingerprint, on a key with a record and on a fresh one: 22023 at
# once, with a message of a few hundred bytes (not the fingerprint in hex)
for my $key ('detail-b64-one', 'fresh-100mb')
{
	my $before = checksum();
	my $t0 = time;
	my ($code, undef, $err) = as_alice(
		"SELECT status FROM idem_begin('detail', '$key', convert_to(repeat('f', 100000000), 'UTF8'))");
	my $took = time - $t0;
	is($code, '22023', "$key: a 100 MB fingerprint is 22023");
	like($err, qr/ERROR:  22023: argument "fingerprint" is too long\nDETAIL:  It has 100000000 bytes; at most 1024 are allowed\./,
		"$key: \"argument \\\"fingerprint\\\" is too long\", with its size");
	cmp_ok(length($err), '<', 2000, "$key: the message is short (" . length($err) . ' bytes)');
	cmp_ok($took, '<', 30, sprintf('%s: and comes quickly (%.1f s)', $key, $took));
	is(checksum(), $before, "$key: and changes nothing");
}
# 1024 bytes is fine, 1025 is not
my ($code1024, $out1024) = as_alice("SELECT status FROM idem_begin('detail', 'fp1024', decode(repeat('ab', 1024), 'hex'))");
is("$code1024|$out1024", '00000|new', 'a 1024-byte fingerprint is accepted');
($code1024, $out1024) = as_alice("SELECT status FROM idem_begin('detail', 'fp1024', decode(repeat('ab', 1024), 'hex'), in_flight => 'RAISE')");
is($code1024, 'IK409', 'and matches itself (the claim is in progress: IK409 with in_flight RAISE)');
my $before = checksum();
my ($code1025, undef, $err1025) = as_alice("SELECT status FROM idem_begin('detail', 'fp1025', decode(repeat('ab', 1025), 'hex'))");
is($code1025, '22023', 'a 1025-byte fingerprint is 22023');
like($err1025, qr/It has 1025 bytes; at most 1024 are allowed\./, 'with its size');
is(checksum(), $before, 'and changes nothing');

# a response small stored but over the limit as text
{
	my (undef, $tok) = as_alice("SELECT token FROM idem_begin('detail', 'resp', NULL, lease => '1h')");
	my $before = checksum();
	my ($code, undef, $err) = as_alice("SELECT idem_finish('detail', 'resp', $tok, '[1e100000]')");
	is($code, '54000', 'a response of 100,003 bytes as text is 54000');
	like($err, qr/DETAIL:  Its text form takes 100003 bytes; idempotency.max_response_size is 65536 bytes\./,
		'its DETAIL gives the size of the text form');
	($code, undef, $err) = as_alice(q{SELECT idem_finish('detail', 'resp', } . $tok . q{, to_jsonb(repeat(chr(1), 20000)))});
	is($code, '54000', '20,000 control characters (120,002 bytes as text): 54000');
	is(checksum(), $before, 'and change nothing');
}

# NULL where a value is needed: 22004, also for idem_inspect and idem_set_logged
is((as_alice(q{SELECT * FROM idem_inspect(NULL, 'k')}))[0], '22004', 'idem_inspect(NULL, \'k\'): 22004');
is((as_alice(q{SELECT * FROM idem_inspect('detail', NULL)}))[0], '22004', 'idem_inspect(\'detail\', NULL): 22004');
{
	my $before = checksum();
	my ($rc, $out, $err) = $node->psql('postgres', 'SELECT idem_set_logged(NULL)',
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	like($err, qr/ERROR:  22004:/, 'idem_set_logged(NULL) as superuser: 22004');
	is(checksum(), $before, 'and changes nothing');
	is($node->safe_psql('postgres', q{SELECT relpersistence FROM pg_class WHERE oid = 'idem_record'::regclass}),
		(grep { defined $_->{persistence} } reverse @calls)[0]{persistence}, 'the table keeps its persistence');
}
# in_flight case-insensitive, and only the two words
{
	my (undef, $tok) = as_alice("SELECT token FROM idem_begin('detail', 'policy', NULL, lease => '1h')");
	for my $pol ('RAISE', 'Raise', 'raise')
	{
		is((as_alice("SELECT status FROM idem_begin('detail', 'policy', NULL, in_flight => '$pol')"))[0],
			'IK409', "in_flight => '$pol' raises");
	}
	for my $pol ('rasie', '', 'wait ')
	{
		my ($code, undef, $err) = as_alice("SELECT status FROM idem_begin('detail', 'policy', NULL, in_flight => '$pol')");
		is($code, '22023', "in_flight => '$pol': 22023");
		like($err, qr/unknown in_flight policy/, "in_flight => '$pol': unknown policy");
	}
}
$node->safe_psql('postgres', 'DELETE FROM idem_record; DELETE FROM idem_result');

is($node->safe_psql('postgres', 'SELECT 1'), '1', 'the server is up');
my $log = slurp_file($node->logfile);
unlike($log, qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed (server log)');

$node->stop;
done_testing();
