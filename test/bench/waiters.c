/*
 * waiters.c: the bench measurements pgbench cannot make -- many clients on
 * one key, and how fast / how cheaply duplicates wait.
 *
 *   waiters hotkey N ACTION_MS SHAPE TRIALS
 *       N clients send the same new key at the same moment in wait mode.
 *       SHAPE ext: idem_begin commits the claim (external-call shape); the
 *       owner "acts" for ACTION_MS on the client side, then idem_finish.
 *       SHAPE tx: one statement per client, bench_hot_tx() (setup.sql):
 *       claim, pg_sleep(ACTION_MS), an INSERT as the effect, finish, all
 *       in the statement's transaction.
 *       Checks: exactly one action, every client gets that action's
 *       response; measures from the first request to the last response.
 *
 *   waiters wakeup TRIALS
 *       A duplicate sleeps on a committed claim; the owner calls
 *       idem_finish.  Measures from the moment the owner's idem_finish
 *       returns to the moment the duplicate's idem_begin returns.
 *
 *   waiters exit TRIALS
 *       A duplicate sleeps on a claim committed with takeover => 'session'
 *       (lease 60 s); the owner's client disconnects.  Measures from the
 *       disconnect to the moment the duplicate's idem_begin returns 'new'.
 *
 *   waiters idle N SECONDS
 *       N duplicates wait SECONDS on one committed claim (after a round
 *       unmeasured, so that each backend has waited before).  Sums the CPU
 *       time of their N server backends (/proc/PID/sched, ns precision;
 *       /proc/PID/stat ticks as a cross-check) and their voluntary context
 *       switches over the wait: sleepers use neither, pollers both.
 *
 * Connects with libpq defaults (PGHOST, PGPORT, PGDATABASE, PGUSER).
 * WAITERS_EDITION=portable measures the portable edition (portable/), whose
 * sleeping duplicate pg_locks shows otherwise (see sleeping_locks).
 * Wall times come from clock_gettime(CLOCK_MONOTONIC).  One thread drives
 * every connection with poll(), so "at once" means within the few
 * microseconds it takes to hand N queries to the kernel, and every reply is
 * time-stamped as soon as its socket becomes readable.
 *
 * Output: human-readable lines, plus "RESULT name=value ..." lines that
 * test/bench/run parses.
 */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#define FP "\\x3a1f0c6e9b2d4f8a7c5e3b1d9f7a5c3e1b9d7f5a3c1e9b7d5f3a1c9e7b5d3f1a"
/*
 * The pg_locks rows of sleeping duplicates.  The C edition: the waiter lock
 * class of locks.c (objsubid 0x494C), granted while the duplicate sleeps on
 * its latch.  The portable edition: a request for the claiming backend's
 * wake lock (classid 0x494B0001, objsubid 2), not granted while it sleeps.
 */
#define SLEEPING_C "locktype = 'advisory' AND objsubid = 18764 AND granted"
#define SLEEPING_PORTABLE "locktype = 'advisory' AND classid = 1229651969 AND objsubid = 2 AND NOT granted"
static const char *sleeping_locks = SLEEPING_C;

static void
die(const char *fmt,...)
{
	va_list		ap;

	va_start(ap, fmt);
	fprintf(stderr, "waiters: ");
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(2);
}

static double
now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void
sleep_ms(double ms)
{
	struct timespec ts;

	ts.tv_sec = (time_t) (ms / 1000);
	ts.tv_nsec = (long) ((ms - ts.tv_sec * 1000.0) * 1e6);
	while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
		;
}

static PGconn *
connect_one(void)
{
	PGconn	   *c = PQconnectdb("application_name=bench_waiters");

	if (PQstatus(c) != CONNECTION_OK)
		die("connection failed: %s", PQerrorMessage(c));
	return c;
}

/* Run a query synchronously; die unless it succeeds. */
static PGresult *
run(PGconn *c, const char *sql, int nparams, const char *const *params)
{
	PGresult   *r = PQexecParams(c, sql, nparams, NULL, params, NULL, NULL, 0);

	if (PQresultStatus(r) != PGRES_TUPLES_OK && PQresultStatus(r) != PGRES_COMMAND_OK)
		die("query failed: %s\n  %s", PQerrorMessage(c), sql);
	return r;
}

static void
send_or_die(PGconn *c, const char *sql, int nparams, const char *const *params)
{
	if (!PQsendQueryParams(c, sql, nparams, NULL, params, NULL, NULL, 0))
		die("send failed: %s", PQerrorMessage(c));
}

/*
 * Collect a finished query's result once its socket is readable.  Returns
 * the (single) result when the query is complete, NULL while it is not.
 * Dies on a failed query.
 */
static PGresult *
try_result(PGconn *c)
{
	PGresult   *res = NULL,
			   *r;

	if (!PQconsumeInput(c))
		die("connection lost: %s", PQerrorMessage(c));
	if (PQisBusy(c))
		return NULL;
	while ((r = PQgetResult(c)) != NULL)
	{
		if (PQresultStatus(r) != PGRES_TUPLES_OK && PQresultStatus(r) != PGRES_COMMAND_OK)
			die("query failed: %s", PQresultErrorMessage(r));
		if (res)
			PQclear(res);
		res = r;
		if (PQisBusy(c))
		{
			/* more to come: wait for it like for the first part */
			while (PQisBusy(c))
			{
				struct pollfd p = {PQsocket(c), POLLIN, 0};

				poll(&p, 1, 1000);
				if (!PQconsumeInput(c))
					die("connection lost: %s", PQerrorMessage(c));
			}
		}
	}
	if (res == NULL)
		die("query returned no result");
	return res;
}

static int
cmp_double(const void *a, const void *b)
{
	double		x = *(const double *) a,
				y = *(const double *) b;

	return x < y ? -1 : x > y;
}

/* Percentile by nearest rank of a sorted array */
static double
pct(const double *sorted, int n, double p)
{
	int			i = (int) (p / 100.0 * n + 0.999999) - 1;

	if (i < 0)
		i = 0;
	if (i >= n)
		i = n - 1;
	return sorted[i];
}

/*
 * Load the library, plpgsql and the relation caches in a backend before it
 * is measured, as in any long-lived (pooled) connection: a first call per
 * backend pays for dlopen and catalog look-ups that are not what we measure.
 */
static void
warm(PGconn *c, int tx)
{
	char		key[64];
	const char *p[1] = {key};

	snprintf(key, sizeof(key), "warm-%d-%d", (int) getpid(), PQbackendPID(c));
	if (tx)
		PQclear(run(c, "SELECT public.bench_hot_tx($1, 0)", 1, p));
	else
		PQclear(run(c, "SELECT status FROM idem_begin('bench.warm', $1, '" FP "'::bytea, 'wait')", 1, p));
}

/* ---------------------------------------------------------------- hotkey */

enum
{
	HK_BEGIN, HK_ACTING, HK_FINISH, HK_DONE
};

static void
hotkey(int n, int action_ms, const char *shape, int trials)
{
	PGconn	  **conns = calloc(n, sizeof(PGconn *));
	PGconn	   *mon = connect_one();
	int		   *state = calloc(n, sizeof(int));
	double	   *done_t = calloc(n, sizeof(double));
	char	  **resp = calloc(n, sizeof(char *));
	char	  **tokens = calloc(n, sizeof(char *));
	double	   *due = calloc(n, sizeof(double));
	struct pollfd *pfd = calloc(n, sizeof(struct pollfd));
	double	   *spans = calloc(trials, sizeof(double));
	int			bad_trials = 0;
	int			tx = strcmp(shape, "tx") == 0;
	char		action_s[32];

	if (!tx && strcmp(shape, "ext") != 0)
		die("hotkey shape must be ext or tx");
	snprintf(action_s, sizeof(action_s), "%d", action_ms);
	for (int i = 0; i < n; i++)
	{
		conns[i] = connect_one();
		warm(conns[i], tx);
	}

	for (int t = 0; t < trials; t++)
	{
		char		key[64];
		const char *p[4];
		double		t0,
					first_done = 1e300,
					last_done = 0;
		int			left = n,
					actions = 0,
					same = 1;
		const char *owner_resp = NULL;

		snprintf(key, sizeof(key), "hot-%d-%s-%d", (int) getpid(), shape, t);
		p[0] = key;
		p[1] = action_s;

		sleep_ms(50);

		t0 = now_ms();
		for (int i = 0; i < n; i++)
		{
			if (tx)
				send_or_die(conns[i], "SELECT public.bench_hot_tx($1, $2::int)::text", 2, p);
			else
				send_or_die(conns[i], "SELECT status, token, response::text FROM idem_begin('bench.hot', $1, '" FP "'::bytea, 'wait')", 1, p);
			state[i] = HK_BEGIN;
			resp[i] = NULL;
		}

		while (left > 0)
		{
			int			np = 0;
			int			timeout = 1000;
			double		now = now_ms();

			/* owner's action done: finish the claim */
			for (int i = 0; i < n; i++)
			{
				if (state[i] == HK_ACTING && due[i] <= now)
				{
					char		r[64];
					const char *fp[4];

					snprintf(r, sizeof(r), "{\"charge\": \"ch_%s\"}", tokens[i]);
					fp[0] = key;
					fp[1] = tokens[i];
					fp[2] = r;
					send_or_die(conns[i], "SELECT idem_finish('bench.hot', $1, $2::int8, $3::jsonb), $3::jsonb::text", 3, fp);
					state[i] = HK_FINISH;
				}
				else if (state[i] == HK_ACTING)
				{
					int			ms = (int) (due[i] - now) + 1;

					if (ms < timeout)
						timeout = ms;
				}
			}
			for (int i = 0; i < n; i++)
				if (state[i] == HK_BEGIN || state[i] == HK_FINISH)
				{
					pfd[np].fd = PQsocket(conns[i]);
					pfd[np].events = POLLIN;
					pfd[np].revents = 0;
					np++;
				}
			if (np > 0 && poll(pfd, np, timeout) < 0 && errno != EINTR)
				die("poll: %s", strerror(errno));
			if (np == 0)
			{
				sleep_ms(timeout > 0 ? timeout : 0);
				continue;
			}
			now = now_ms();
			np = 0;
			for (int i = 0; i < n; i++)
			{
				PGresult   *r;

				if (state[i] != HK_BEGIN && state[i] != HK_FINISH)
					continue;
				if (!(pfd[np++].revents & (POLLIN | POLLHUP | POLLERR)))
					continue;
				if ((r = try_result(conns[i])) == NULL)
					continue;
				if (tx)
				{
					resp[i] = strdup(PQgetvalue(r, 0, 0));
					state[i] = HK_DONE;
				}
				else if (state[i] == HK_BEGIN)
				{
					if (strcmp(PQgetvalue(r, 0, 0), "new") == 0)
					{
						actions++;
						free(tokens[i]);
						tokens[i] = strdup(PQgetvalue(r, 0, 1));
						due[i] = now + action_ms;
						state[i] = HK_ACTING;
					}
					else
					{
						resp[i] = strdup(PQgetvalue(r, 0, 2));
						state[i] = HK_DONE;
					}
				}
				else
				{
					resp[i] = strdup(PQgetvalue(r, 0, 1));
					owner_resp = resp[i];
					state[i] = HK_DONE;
				}
				PQclear(r);
				if (state[i] == HK_DONE)
				{
					done_t[i] = now;
					left--;
				}
			}
		}

		if (tx)
		{
			PGresult   *r = run(mon, "SELECT count(*), max('{\"charge\": \"ch_' || token || '\"}') FROM public.bench_action WHERE key = $1", 1, p);

			actions = atoi(PQgetvalue(r, 0, 0));
			owner_resp = actions == 1 ? strdup(PQgetvalue(r, 0, 1)) : NULL;
			PQclear(r);
		}
		for (int i = 0; i < n; i++)
		{
			if (owner_resp == NULL || resp[i] == NULL || strcmp(resp[i], owner_resp) != 0)
				same = 0;
			if (done_t[i] < first_done)
				first_done = done_t[i];
			if (done_t[i] > last_done)
				last_done = done_t[i];
		}
		spans[t] = last_done - t0;
		if (actions != 1 || !same)
			bad_trials++;
		printf("hotkey %s trial %d: %d clients, actions %d, all got the action's response: %s, "
			   "first response %.1f ms, last response %.1f ms after the first request\n",
			   shape, t + 1, n, actions, same ? "yes" : "NO",
			   first_done - t0, last_done - t0);
		for (int i = 0; i < n; i++)
		{
			free(resp[i]);
			resp[i] = NULL;
		}
		if (tx)
			free((char *) owner_resp);
		fflush(stdout);
	}

	qsort(spans, trials, sizeof(double), cmp_double);
	printf("RESULT hotkey_%s clients=%d action_ms=%d trials=%d bad_trials=%d span_median_ms=%.1f span_max_ms=%.1f\n",
		   shape, n, action_ms, trials, bad_trials, pct(spans, trials, 50), spans[trials - 1]);

	for (int i = 0; i < n; i++)
		PQfinish(conns[i]);
	PQfinish(mon);
}

/* ---------------------------------------------------------------- wakeup */

/* Wait until count duplicates (or backend pid) sleep: sleeping_locks shows them */
static double
wait_until_sleeping(PGconn *mon, int pid, int count)
{
	char		pid_s[16],
				count_s[16];
	const char *p[2] = {pid_s, count_s};
	char		sql[512];
	double		t0 = now_ms();

	snprintf(sql, sizeof(sql),
			 "SELECT count(*) >= $2::int FROM pg_locks"
			 " WHERE %s AND ($1::int = 0 OR pid = $1::int)", sleeping_locks);

	snprintf(pid_s, sizeof(pid_s), "%d", pid);
	snprintf(count_s, sizeof(count_s), "%d", count);
	for (;;)
	{
		PGresult   *r = run(mon, sql, 2, p);
		int			ok = PQgetvalue(r, 0, 0)[0] == 't';

		PQclear(r);
		if (ok)
			return now_ms() - t0;
		if (now_ms() - t0 > 10000)
			die("duplicates did not start waiting within 10 s");
		sleep_ms(1);
	}
}

static void
wakeup(int trials)
{
	PGconn	   *owner = connect_one(),
			   *dup = connect_one(),
			   *mon = connect_one();
	double	   *lat = calloc(trials, sizeof(double));
	int			dup_pid = PQbackendPID(dup);
	int			bad = 0;

	warm(owner, 0);
	warm(dup, 0);

	for (int t = 0; t < trials; t++)
	{
		char		key[64];
		char		token[32];
		char		r_s[64];
		const char *p[3];
		PGresult   *r;
		double		t_owner = 0,
					t_dup = 0;
		int			owner_done = 0,
					dup_done = 0;

		snprintf(key, sizeof(key), "wake-%d-%d", (int) getpid(), t);
		p[0] = key;
		r = run(owner, "SELECT status, token FROM idem_begin('bench.wake', $1, '" FP "'::bytea, 'wait', '30 s')", 1, p);
		if (strcmp(PQgetvalue(r, 0, 0), "new") != 0)
			die("wakeup: claim was not new");
		snprintf(token, sizeof(token), "%s", PQgetvalue(r, 0, 1));
		PQclear(r);

		send_or_die(dup, "SELECT status, response::text FROM idem_begin('bench.wake', $1, '" FP "'::bytea, 'wait')", 1, p);
		wait_until_sleeping(mon, dup_pid, 1);
		sleep_ms(2);			/* well inside WaitLatch by now */

		snprintf(r_s, sizeof(r_s), "{\"charge\": \"ch_%s\"}", token);
		p[1] = token;
		p[2] = r_s;
		send_or_die(owner, "SELECT idem_finish('bench.wake', $1, $2::int8, $3::jsonb)", 3, p);
		while (!owner_done || !dup_done)
		{
			struct pollfd pfd[2];
			int			np = 0;
			double		now;

			if (!owner_done)
				pfd[np++] = (struct pollfd) {PQsocket(owner), POLLIN, 0};
			if (!dup_done)
				pfd[np++] = (struct pollfd) {PQsocket(dup), POLLIN, 0};
			if (poll(pfd, np, 5000) <= 0)
				die("wakeup: nothing happened within 5 s");
			now = now_ms();
			np = 0;
			if (!owner_done && (pfd[np++].revents & (POLLIN | POLLHUP | POLLERR)) &&
				(r = try_result(owner)) != NULL)
			{
				owner_done = 1;
				t_owner = now;
				PQclear(r);
			}
			if (!dup_done && (pfd[np++].revents & (POLLIN | POLLHUP | POLLERR)) &&
				(r = try_result(dup)) != NULL)
			{
				dup_done = 1;
				t_dup = now;
				if (strcmp(PQgetvalue(r, 0, 0), "replay") != 0 ||
					strcmp(PQgetvalue(r, 0, 1), r_s) != 0)
					bad++;
				PQclear(r);
			}
		}
		lat[t] = t_dup - t_owner;
	}

	for (int t = 0; t < trials; t++)
		printf("wakeup trial %d: duplicate returned %.3f ms after the owner's idem_finish\n", t + 1, lat[t]);
	qsort(lat, trials, sizeof(double), cmp_double);
	printf("RESULT wakeup trials=%d bad=%d p50_ms=%.3f p95_ms=%.3f max_ms=%.3f min_ms=%.3f\n",
		   trials, bad, pct(lat, trials, 50), pct(lat, trials, 95), lat[trials - 1], lat[0]);
	PQfinish(owner);
	PQfinish(dup);
	PQfinish(mon);
}

/* ------------------------------------------------------------------ exit */

static void
session_exit(int trials)
{
	PGconn	   *dup = connect_one(),
			   *mon = connect_one();
	double	   *lat = calloc(trials, sizeof(double));
	int			dup_pid = PQbackendPID(dup);
	int			bad = 0;

	warm(dup, 0);
	for (int t = 0; t < trials; t++)
	{
		PGconn	   *owner = connect_one();
		char		key[64];
		long long	token;
		const char *p[1];
		PGresult   *r;
		struct pollfd pfd;
		double		t0;

		snprintf(key, sizeof(key), "exit-%d-%d", (int) getpid(), t);
		p[0] = key;
		r = run(owner, "SELECT status, token FROM idem_begin('bench.exit', $1, '" FP "'::bytea,"
				" 'wait', '60 s', takeover => 'session')", 1, p);
		if (strcmp(PQgetvalue(r, 0, 0), "new") != 0)
			die("exit: claim was not new");
		token = strtoll(PQgetvalue(r, 0, 1), NULL, 10);
		PQclear(r);

		send_or_die(dup, "SELECT status, token FROM idem_begin('bench.exit', $1, '" FP "'::bytea, 'wait')", 1, p);
		wait_until_sleeping(mon, dup_pid, 1);
		sleep_ms(2);			/* well inside WaitLatch by now */

		t0 = now_ms();
		PQfinish(owner);		/* the client goes away: its session ends */
		for (;;)
		{
			pfd = (struct pollfd) {PQsocket(dup), POLLIN, 0};
			if (poll(&pfd, 1, 5000) <= 0)
				die("exit: the duplicate was not woken within 5 s");
			if ((r = try_result(dup)) != NULL)
				break;
		}
		lat[t] = now_ms() - t0;
		if (strcmp(PQgetvalue(r, 0, 0), "new") != 0 ||
			strtoll(PQgetvalue(r, 0, 1), NULL, 10) <= token)
			bad++;
		PQclear(r);
	}

	for (int t = 0; t < trials; t++)
		printf("exit trial %d: duplicate took the key %.3f ms after the owner disconnected\n", t + 1, lat[t]);
	qsort(lat, trials, sizeof(double), cmp_double);
	printf("RESULT exit trials=%d bad=%d p50_ms=%.3f p95_ms=%.3f max_ms=%.3f min_ms=%.3f\n",
		   trials, bad, pct(lat, trials, 50), pct(lat, trials, 95), lat[trials - 1], lat[0]);
	PQfinish(dup);
	PQfinish(mon);
}

/* ------------------------------------------------------------------ idle */

typedef struct CpuSample
{
	double		sched_ms;		/* se.sum_exec_runtime, -1 if unreadable */
	long		ticks;			/* utime + stime */
	long		vcsw;			/* voluntary context switches */
} CpuSample;

static CpuSample
cpu_of(int pid)
{
	CpuSample	s = {-1, 0, 0};
	char		path[64],
				line[512];
	FILE	   *f;

	snprintf(path, sizeof(path), "/proc/%d/sched", pid);
	if ((f = fopen(path, "r")) != NULL)
	{
		while (fgets(line, sizeof(line), f))
			if (strncmp(line, "se.sum_exec_runtime", 19) == 0)
				s.sched_ms = atof(strchr(line, ':') + 1);
		fclose(f);
	}
	snprintf(path, sizeof(path), "/proc/%d/stat", pid);
	if ((f = fopen(path, "r")) != NULL)
	{
		if (fgets(line, sizeof(line), f))
		{
			/* fields after the command's closing parenthesis; utime is 14th */
			char	   *q = strrchr(line, ')');
			long		utime = 0,
						stime = 0;

			if (q && sscanf(q + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %ld %ld",
							&utime, &stime) == 2)
				s.ticks = utime + stime;
		}
		fclose(f);
	}
	else
		die("cannot read %s: %s", path, strerror(errno));
	snprintf(path, sizeof(path), "/proc/%d/status", pid);
	if ((f = fopen(path, "r")) != NULL)
	{
		while (fgets(line, sizeof(line), f))
			if (strncmp(line, "voluntary_ctxt_switches:", 24) == 0)
				s.vcsw = atol(line + 24);
		fclose(f);
	}
	return s;
}

static void
idle(int n, double seconds)
{
	PGconn	   *owner = connect_one(),
			   *mon = connect_one();
	PGconn	  **conns = calloc(n, sizeof(PGconn *));
	int		   *pids = calloc(n, sizeof(int));
	CpuSample  *before = calloc(n, sizeof(CpuSample)),
			   *mid = calloc(n, sizeof(CpuSample)),
			   *after = calloc(n, sizeof(CpuSample));
	char		key[64],
				token[32],
				r_s[64],
				sql[512];
	const char *p[3];
	PGresult   *r;
	double		t0,
				sched_ms = 0,
				sleep_ms_cpu = 0,
				ready_ms;
	long		ticks = 0,
				vcsw = 0;
	int			sched_ok = 1,
				returned_early = 0,
				replays = 0,
				sleeping;
	long		clk = sysconf(_SC_CLK_TCK);

	for (int i = 0; i < n; i++)
	{
		conns[i] = connect_one();
		pids[i] = PQbackendPID(conns[i]);
		warm(conns[i], 0);
	}

	/*
	 * One round unmeasured: every duplicate's backend has waited once
	 * before, as in a pool (the portable edition compiles its PL/pgSQL
	 * wait functions at a backend's first wait)
	 */
	snprintf(key, sizeof(key), "idle-warm-%d", (int) getpid());
	p[0] = key;
	r = run(owner, "SELECT token FROM idem_begin('bench.idle', $1, '" FP "'::bytea, 'wait', '10 min')", 1, p);
	snprintf(token, sizeof(token), "%s", PQgetvalue(r, 0, 0));
	PQclear(r);
	for (int i = 0; i < n; i++)
		send_or_die(conns[i], "SELECT status FROM idem_begin('bench.idle', $1, '" FP "'::bytea, 'wait')", 1, p);
	wait_until_sleeping(mon, 0, n);
	p[1] = token;
	p[2] = "{}";
	PQclear(run(owner, "SELECT idem_finish('bench.idle', $1, $2::int8, $3::jsonb)", 3, p));
	for (int i = 0; i < n; i++)
	{
		while ((r = try_result(conns[i])) == NULL)
		{
			struct pollfd pfd = {PQsocket(conns[i]), POLLIN, 0};

			poll(&pfd, 1, 1000);
		}
		PQclear(r);
	}

	snprintf(key, sizeof(key), "idle-%d", (int) getpid());
	p[0] = key;
	r = run(owner, "SELECT status, token FROM idem_begin('bench.idle', $1, '" FP "'::bytea, 'wait', '10 min')", 1, p);
	if (strcmp(PQgetvalue(r, 0, 0), "new") != 0)
		die("idle: claim was not new");
	snprintf(token, sizeof(token), "%s", PQgetvalue(r, 0, 1));
	PQclear(r);

	for (int i = 0; i < n; i++)
		before[i] = cpu_of(pids[i]);
	t0 = now_ms();
	for (int i = 0; i < n; i++)
		send_or_die(conns[i], "SELECT status, response::text FROM idem_begin('bench.idle', $1, '" FP "'::bytea, 'wait')", 1, p);
	ready_ms = wait_until_sleeping(mon, 0, n);
	for (int i = 0; i < n; i++)
		mid[i] = cpu_of(pids[i]);
	sleep_ms(seconds * 1000.0 - (now_ms() - t0));
	for (int i = 0; i < n; i++)
		after[i] = cpu_of(pids[i]);

	/* still all waiting? */
	snprintf(sql, sizeof(sql), "SELECT count(*) FROM pg_locks WHERE %s", sleeping_locks);
	r = run(mon, sql, 0, NULL);
	sleeping = atoi(PQgetvalue(r, 0, 0));
	PQclear(r);
	for (int i = 0; i < n; i++)
	{
		if (!PQconsumeInput(conns[i]))
			die("connection lost: %s", PQerrorMessage(conns[i]));
		if (!PQisBusy(conns[i]))
			returned_early++;
	}

	for (int i = 0; i < n; i++)
	{
		if (before[i].sched_ms < 0 || after[i].sched_ms < 0)
			sched_ok = 0;
		sched_ms += after[i].sched_ms - before[i].sched_ms;
		sleep_ms_cpu += after[i].sched_ms - mid[i].sched_ms;
		ticks += after[i].ticks - before[i].ticks;
		vcsw += after[i].vcsw - before[i].vcsw;
	}

	/* let them go and check that every one replays the result */
	snprintf(r_s, sizeof(r_s), "{\"charge\": \"ch_%s\"}", token);
	p[1] = token;
	p[2] = r_s;
	PQclear(run(owner, "SELECT idem_finish('bench.idle', $1, $2::int8, $3::jsonb)", 3, p));
	for (int i = 0; i < n; i++)
	{
		PGresult   *res;

		while ((res = try_result(conns[i])) == NULL)
		{
			struct pollfd pfd = {PQsocket(conns[i]), POLLIN, 0};

			poll(&pfd, 1, 1000);
		}
		if (strcmp(PQgetvalue(res, 0, 0), "replay") == 0 && strcmp(PQgetvalue(res, 0, 1), r_s) == 0)
			replays++;
		PQclear(res);
	}

	printf("idle: %d duplicates all sleeping %.1f ms after their requests; over %.1f s from the "
		   "requests they used %.4f CPU-s in total (/proc/PID/sched; stat ticks say %.2f s), "
		   "%.4f CPU-s of it once all were asleep; %ld voluntary context switches; "
		   "still sleeping at the end: %d, returned early: %d; replayed after finish: %d\n",
		   n, ready_ms, seconds, sched_ok ? sched_ms / 1000.0 : -1.0,
		   (double) ticks / clk, sched_ok ? sleep_ms_cpu / 1000.0 : -1.0,
		   vcsw, sleeping, returned_early, replays);
	printf("RESULT idle waiters=%d seconds=%.1f cpu_s=%.4f cpu_asleep_s=%.4f cpu_ticks_s=%.2f vcsw=%ld sleeping=%d returned_early=%d replays=%d\n",
		   n, seconds, sched_ok ? sched_ms / 1000.0 : (double) ticks / clk,
		   sched_ok ? sleep_ms_cpu / 1000.0 : -1.0,
		   (double) ticks / clk, vcsw, sleeping, returned_early, replays);

	for (int i = 0; i < n; i++)
		PQfinish(conns[i]);
	PQfinish(owner);
	PQfinish(mon);
}

int
main(int argc, char **argv)
{
	const char *edition = getenv("WAITERS_EDITION");

	setvbuf(stdout, NULL, _IOLBF, 0);
	if (edition != NULL && strcmp(edition, "portable") == 0)
		sleeping_locks = SLEEPING_PORTABLE;
	else if (edition != NULL && edition[0] != '\0' && strcmp(edition, "c") != 0)
		die("WAITERS_EDITION must be c or portable, not \"%s\"", edition);
	if (argc == 6 && strcmp(argv[1], "hotkey") == 0)
		hotkey(atoi(argv[2]), atoi(argv[3]), argv[4], atoi(argv[5]));
	else if (argc == 3 && strcmp(argv[1], "wakeup") == 0)
		wakeup(atoi(argv[2]));
	else if (argc == 3 && strcmp(argv[1], "exit") == 0)
		session_exit(atoi(argv[2]));
	else if (argc == 4 && strcmp(argv[1], "idle") == 0)
		idle(atoi(argv[2]), atof(argv[3]));
	else
	{
		fprintf(stderr,
				"usage: waiters hotkey N ACTION_MS ext|tx TRIALS\n"
				"       waiters wakeup TRIALS\n"
				"       waiters exit TRIALS\n"
				"       waiters idle N SECONDS\n");
		return 2;
	}
	return 0;
}
