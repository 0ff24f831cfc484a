# Short load with invariant checks: 16 pgbench clients for 10 s over a small,
# hot key set: 100 keys per 100 ms block, so each key is fought over, then
# replayed, and a fresh set comes ten times a second (ttl cannot be shorter
# than a minute, so keys cannot be recycled by expiry).  Four kinds of
# transaction are mixed:
#
#   intx   in-transaction claim, 'wait': effect row + idem_finish in the same
#          transaction, COMMIT -- or ROLLBACK one time in five
#   raise  the same with 'raise', in a PL/pgSQL function that catches IK409
#          (so the claim is made in a subtransaction)
#   ext    claim committed first (autocommit, 'wait'), then effect row +
#          idem_finish in a second transaction -- or idem_abort one time in
#          ten; duplicates sleep until woken by the finish / abort
#   abort  in-transaction claim released by idem_abort, COMMIT, no effect
#
# Every replay checks that the replayed effect_id is the key's effect row
# (else it divides by zero, which aborts pgbench).  At the end:
#   - at most one effect row per key;
#   - every completed record has exactly one effect row, and its response is
#     {"effect_id": <that row's id>} with the same token;
#   - no effect row without a completed record; no record left pending;
#   - no idempotency advisory lock left in pg_locks;
#   - no transaction waited anywhere near a lease (a lost wake-up);
#   - the server log shows no crash or assertion failure.
#
# It runs in the default durability mode of a new installation, 'completed':
# a finish moves the record from idem_record (claims, unlogged) to
# idem_result (logged), so the invariants read both tables.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $clients = 16;
my $seconds = 10;

my $node = PostgreSQL::Test::Cluster->new('stress');
$node->init;
# the load would write every statement to the log
$node->append_conf('postgresql.conf', "log_statement = none\n");
$node->start;

$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	-- no unique constraint: a second effect for a key must be possible, to be seen
	CREATE TABLE effect (id bigserial PRIMARY KEY, key text NOT NULL, token bigint NOT NULL);
	CREATE INDEX ON effect (key);

	-- claim in 'raise' mode: 1 new, 0 replay, 2 in progress (IK409)
	CREATE FUNCTION claim_raise(key text, OUT st int, OUT token bigint, OUT eid bigint)
	LANGUAGE plpgsql AS $$
	DECLARE
		c idem_claim;
	BEGIN
		c := idem_begin('stress', key, idem_fingerprint(key), in_flight => 'raise');
		st := CASE c.status WHEN 'new' THEN 1 ELSE 0 END;
		token := coalesce(c.token, 0);
		eid := coalesce((c.response->>'effect_id')::bigint, 0);
	EXCEPTION WHEN SQLSTATE 'IK409' THEN
		st := 2; token := 0; eid := 0;
	END $$;
});

# the key: 's' || :kk, with kk = the current 100ms block * 1000 + k
my $pick_key = q{
\set k random(1, 100)
\set r random(1, 10)
SELECT floor(extract(epoch FROM clock_timestamp()) * 10)::bigint * 1000 + :k AS kk \gset
};
my $check_replay = q{SELECT 1 / count(*) FROM effect WHERE id = :eid AND key = 's' || :kk;};
my $claim_wait = q{
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS token,
       coalesce(response->>'effect_id', '0') AS eid
  FROM idem_begin('stress', 's' || :kk, idem_fingerprint('s' || :kk)%s) b \gset
};
my $effect_and_finish = q{
INSERT INTO effect (key, token) VALUES ('s' || :kk, :token) RETURNING id AS new_eid \gset
SELECT idem_finish('stress', 's' || :kk, :token, jsonb_build_object('effect_id', :new_eid));
};

my %scripts = (
	'intx@5' => $pick_key . q{
BEGIN;
} . sprintf($claim_wait, '') . q{
\if :is_new
} . $effect_and_finish . q{
\if :r <= 2
ROLLBACK;
\else
COMMIT;
\endif
\else
} . $check_replay . q{
COMMIT;
\endif
},
	'raise@2' => $pick_key . q{
BEGIN;
SELECT st, token, eid FROM claim_raise('s' || :kk) \gset
\if :st = 1
} . $effect_and_finish . q{
COMMIT;
\elif :st = 0
} . $check_replay . q{
COMMIT;
\else
ROLLBACK;
\endif
},
	'ext@2' => $pick_key . sprintf($claim_wait, ", lease => '20s'") . q{
\if :is_new
\sleep 2 ms
\if :r = 1
SELECT idem_abort('stress', 's' || :kk, :token);
\else
BEGIN;
} . $effect_and_finish . q{
COMMIT;
\endif
\else
} . $check_replay . q{
\endif
},
	'abort@1' => $pick_key . q{
BEGIN;
} . sprintf($claim_wait, '') . q{
\if :is_new
SELECT idem_abort('stress', 's' || :kk, :token);
\else
} . $check_replay . q{
\endif
COMMIT;
},
);

my $log_prefix = $node->basedir . '/pgbench_log';
my $log_offset = -s $node->logfile;
$node->pgbench(
	"--no-vacuum --client=$clients --jobs=4 --time=$seconds --log --log-prefix=$log_prefix",
	0,
	[ qr{processed: \d+}, qr{number of failed transactions: 0 } ],
	[qr{^$}],
	"$clients clients for ${seconds}s of claims, effects, finishes, aborts and rollbacks",
	\%scripts);

# ---- invariants ----

# every record, in whichever table the durability mode keeps it
my $records = '(SELECT * FROM idem_record UNION ALL SELECT * FROM idem_result)';

my $counts = $node->safe_psql('postgres', qq{
	SELECT (SELECT count(*) FROM $records r WHERE completed_at IS NOT NULL),
	       (SELECT count(*) FROM $records r WHERE completed_at IS NULL),
	       (SELECT count(*) FROM effect),
	       (SELECT count(DISTINCT key) FROM effect),
	       (SELECT last_value & 33554431 FROM idem_token_seq)});    # this epoch's count
my ($completed, $pending, $effects, $effect_keys, $tokens) = split /\|/, $counts;

# transactions and the slowest one, from pgbench's per-transaction logs:
# "client_id transaction_no time_us script_no epoch epoch_us"
my ($transactions, $max_us, %per_script) = (0, 0);
my @script_names = sort keys %scripts;    # pgbench numbers them in this order
for my $f (glob("$log_prefix.*"))
{
	for my $line (split /\n/, slurp_file($f))
	{
		my ($client, $n, $us, $script) = split / /, $line;
		$transactions++;
		$per_script{ $script_names[$script] =~ s/\@\d+$//r }++;
		$max_us = $us if $us > $max_us;
	}
}
diag(sprintf(
	"%d transactions (%s); %d tokens issued; %d completed records, %d pending; "
	  . "%d effect rows over %d keys; slowest transaction %.3fs",
	$transactions,
	join(', ', map { "$_ $per_script{$_}" } sort keys %per_script),
	$tokens, $completed, $pending, $effects, $effect_keys, $max_us / 1e6));

cmp_ok($transactions, '>', 1000, 'the load ran');
cmp_ok($completed, '>', 100, 'many keys were completed');
cmp_ok($tokens, '>', $completed, 'more claims than completed records (rollbacks, aborts, takeovers of nothing)');
is($pending, '0', 'no record is left pending');
is( $node->safe_psql('postgres', q{
		SELECT idem_durability() || '|' || (SELECT count(*) FROM idem_record WHERE completed_at IS NOT NULL)}),
	'completed|0', 'mode completed: every completed record was moved to idem_result');
is($effects, $effect_keys, 'at most one effect row per key');
is( $node->safe_psql('postgres', qq{
		SELECT count(*) FROM $records r
		 WHERE r.completed_at IS NOT NULL
		   AND (SELECT count(*) FROM effect e WHERE e.key = r.key) <> 1}),
	'0', 'every completed record has exactly one effect row');
is( $node->safe_psql('postgres', qq{
		SELECT count(*) FROM $records r
		 WHERE r.completed_at IS NOT NULL AND NOT EXISTS (
			SELECT 1 FROM effect e
			 WHERE e.key = r.key AND e.token = r.token
			   AND r.response = jsonb_build_object('effect_id', e.id))}),
	'0', 'every completed record\'s response is its effect row\'s id, with the same token');
is( $node->safe_psql('postgres', qq{
		SELECT count(*) FROM effect e
		 WHERE NOT EXISTS (SELECT 1 FROM $records r
							WHERE r.key = e.key AND r.completed_at IS NOT NULL)}),
	'0', 'no effect row without a completed record');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM pg_locks
		 WHERE locktype = 'advisory' AND objsubid IN (18763, 18764)}),    # 0x494B, 0x494C
	'0', 'no idempotency lock is left');
# a lost wake-up would leave a duplicate of an 'ext' claim asleep until the
# 20s lease ends
cmp_ok($max_us / 1e6, '<', 5, 'no transaction waited anywhere near a lease (no lost wake-up)');

my $log = slurp_file($node->logfile, $log_offset);
unlike($log, qr/TRAP:|PANIC|(?:server process|client backend) .* was terminated by signal|out of shared memory|deadlock detected/,
	'server log: no crash, assertion failure, lock table exhaustion or deadlock');

$node->stop;
done_testing();
