
# Copyright (c) 2024, idempotency authors
#
# The alerting rules of monitoring/alerts.yaml, with Prometheus' own rule
# checker (promtool, Debian's prometheus package): the file is valid
# (promtool check rules), and the rules fire on what they are about
# (promtool test rules, which evaluates them over series given here):
#
#  - IdempotencyNotPurged fires on expired records piling up, and not on
#    remembered keys (state="remembered"), however many: purge keeps those
#    on purpose, until the end of remember;
#  - IdempotencyClaimStuck fires on a claim pending for over 10 minutes,
#    not on a lapsed one.
#
# test/run installs promtool (test/lib.sh, missing_packages).

use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use Cwd ();

my $promtool = '/usr/bin/promtool';
BAIL_OUT("$promtool is missing: install prometheus (test/run does)")
  unless -x $promtool;
my $rules = ($ENV{TESTDIR} // '.') . '/monitoring/alerts.yaml';
BAIL_OUT("$rules is missing") unless -f $rules;
$rules = Cwd::abs_path($rules);
note('promtool: ' . (join '', run_command([ $promtool, '--version' ])) =~ s/\n.*//sr);

my ($out, $err) = run_command([ $promtool, 'check', 'rules', $rules ]);
like($out, qr/SUCCESS: 14 rules found/, 'promtool check rules: the file is valid, 5 alerts and 9 dashboard series')
  or diag("stdout:\n$out\nstderr:\n$err");

# Series one scrape a minute for two hours; the alerts are looked at
# after 90 minutes (past every rule's "for").
my $tests = PostgreSQL::Test::Utils::tempdir() . '/alerts-test.yaml';
open my $fh, '>', $tests or die "$tests: $!";
print $fh <<"YAML";
rule_files:
  - $rules
evaluation_interval: 1m
tests:
  # remembered keys only, many of them, and a few expired records: quiet
  - interval: 1m
    input_series:
      - series: 'idempotency_store_records{role="app",operation="payment.charge",state="remembered"}'
        values: '500000x120'
      - series: 'idempotency_store_records{role="app",operation="payment.charge",state="expired"}'
        values: '10x120'
    alert_rule_test:
      - eval_time: 90m
        alertname: IdempotencyNotPurged
        exp_alerts: []
  # expired records piling up, over two operations: it fires
  - interval: 1m
    input_series:
      - series: 'idempotency_store_records{role="app",operation="payment.charge",state="expired"}'
        values: '60000x120'
      - series: 'idempotency_store_records{role="app",operation="payment.refund",state="expired"}'
        values: '60000x120'
    alert_rule_test:
      - eval_time: 90m
        alertname: IdempotencyNotPurged
        exp_alerts:
          - exp_labels: {}
  # a claim pending for 20 minutes fires; a lapsed one as old does not
  - interval: 1m
    input_series:
      - series: 'idempotency_store_oldest_age_seconds{role="app",operation="payment.charge",state="pending"}'
        values: '1200x120'
      - series: 'idempotency_store_oldest_age_seconds{role="app",operation="payment.refund",state="lapsed"}'
        values: '1200x120'
    alert_rule_test:
      - eval_time: 90m
        alertname: IdempotencyClaimStuck
        exp_alerts:
          - exp_labels:
              role: app
              operation: payment.charge
              state: pending
  # the dashboard's replay ratio: 3 claims and 1 replay a second -> 0.25
  - interval: 1m
    input_series:
      - series: 'idempotency_claims_total{instance="db"}'
        values: '0+180x120'
      - series: 'idempotency_replays_total{instance="db"}'
        values: '0+60x120'
    promql_expr_test:
      - expr: idempotency:replay_ratio:rate5m
        eval_time: 90m
        exp_samples:
          - labels: 'idempotency:replay_ratio:rate5m{instance="db"}'
            value: 0.25
YAML
close $fh;
($out, $err) = run_command([ $promtool, 'test', 'rules', $tests ]);
like($out, qr/SUCCESS/, 'promtool test rules: NotPurged ignores remembered keys, fires on expired ones; ClaimStuck on a pending claim; the replay ratio of the dashboard')
  or diag("stdout:\n$out\nstderr:\n$err");
unlike("$out$err", qr/FAILED/, 'promtool test rules: no test failed');

done_testing();
