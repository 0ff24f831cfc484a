/*-------------------------------------------------------------------------
 *
 * demo.c
 *	  Replays the scenarios of README, "Quick start", against a real server
 *	  with real concurrent clients, and prints what happened next to what
 *	  must happen.
 *
 * Every client request is a forked process with its own connections, so a
 * client can really die (SIGKILL) in the middle of a request.  The payment
 * provider is simulated honestly: provider.charge() takes 300 ms and records
 * every charge it makes in provider.charges.  Charges are counted there;
 * responses are what each client received.
 *
 * Read "Handling a request" as the example of using the extension from an
 * application: charge_external() claims the key in its own transaction and
 * calls the provider outside any transaction; charge_in_transaction() makes
 * claim, effect and response one transaction; error_map is the SQLSTATE to
 * HTTP mapping.  charge_with_result_cache() is the usual first attempt, shown
 * for contrast.  Everything after that section is the stage: starting
 * clients, killing them, counting charges, printing the table.
 *
 * Usage: demo (connects with the usual PG* environment variables; drops and
 * recreates the database idem_demo, and drops it again when every scenario
 * behaved as expected).  Exit status: 0 all as expected, 1 a scenario
 * deviated, 2 the demo itself could not run.
 *
 *-------------------------------------------------------------------------
 */
#define _DEFAULT_SOURCE			/* MAP_ANONYMOUS, clock_nanosleep */

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#define DEMO_DB			"idem_demo"
#define RETRY_AFTER_MS	50		/* the client retries 50 ms after its request */
#define PROVIDER_TIMEOUT "1s"	/* how long a client waits for the provider */
#define SHORT_LEASE		"2 s"	/* rows 8-10: idempotency.lease is 30 s */
#define SHORT_LEASE_MS	2000
#define MAX_CLIENTS		2		/* per run_clients() call */
#define MAX_HISTORY		8		/* per scenario */
#define DIE_AFTER_MS	150		/* rows 9-10: into the provider's 300 ms */

/*
 * The database side of the stage.  The provider records the idempotency key
 * it is given with each charge, and answers charge_of(key): the charge made
 * with that key, waiting for a charge with that key still in progress, as a
 * real provider's "retrieve by idempotency key" does.  It does not refuse a
 * second charge with the same key: a real provider should (README, "From
 * an application": "call the provider, passing the key on"), but this one
 * does not, so that the layer under test is all that stands between a
 * retry and a second charge.  Charge ids are gapless (a counter row, rolled
 * back with a failed transaction), so the first charge of every scenario is
 * ch_1.
 */
static const char *const setup_sql =
"CREATE EXTENSION idempotency;\n"
"CREATE SCHEMA provider;\n"
"CREATE TABLE provider.charges (\n"
"    id          text PRIMARY KEY,\n"
"    idem_key    text NOT NULL,\n"
"    amount      int NOT NULL,\n"
"    charged_at  timestamptz NOT NULL DEFAULT clock_timestamp());\n"
"CREATE TABLE provider.last_charge (n int NOT NULL);\n"
"INSERT INTO provider.last_charge VALUES (0);\n"
"CREATE FUNCTION provider.charge(idem_key text, amount int,\n"
"                                takes interval DEFAULT '300 ms')\n"
"RETURNS text LANGUAGE plpgsql AS $$\n"
"DECLARE\n"
"    charge_id text;\n"
"BEGIN\n"
"    PERFORM pg_advisory_xact_lock(hashtext(idem_key));\n"
"    PERFORM pg_sleep_for(takes);\n"
"    UPDATE provider.last_charge SET n = n + 1 RETURNING 'ch_' || n INTO charge_id;\n"
"    INSERT INTO provider.charges (id, idem_key, amount)\n"
"         VALUES (charge_id, idem_key, amount);\n"
"    RETURN charge_id;\n"
"END $$;\n"
"CREATE FUNCTION provider.charge_of(idem_key text) RETURNS text\n"
"LANGUAGE plpgsql AS $$\n"
"BEGIN\n"
"    PERFORM pg_advisory_xact_lock(hashtext(idem_key));\n"
"    RETURN (SELECT id FROM provider.charges c WHERE c.idem_key = charge_of.idem_key\n"
"             ORDER BY charged_at LIMIT 1);\n"
"END $$;\n"
"-- the usual first implementation, for contrast: a result cache\n"
"CREATE TABLE result_cache (idem_key text PRIMARY KEY, response jsonb NOT NULL);\n";

static const char *const reset_sql =
"TRUNCATE provider.charges, result_cache;\n"
"UPDATE provider.last_charge SET n = 0;\n";

/* ---- a request and its response ---- */

typedef enum Shape
{
	RESULT_CACHE,				/* look up, else charge and store (no claim) */
	EXTERNAL_CALL,				/* README, "Two usage shapes": external call */
	IN_TRANSACTION				/* README, "Two usage shapes": in-transaction */
} Shape;

/* What goes wrong during a request (the stage's doing, not the client's) */
typedef enum Fault
{
	NO_FAULT,
	PROVIDER_HANGS,				/* the provider does not answer in time */
	DIE_AFTER_CLAIM,			/* the worker is killed once it holds the key */
	DIE_MID_CHARGE,				/* ... while the provider is charging */
	DIE_BEFORE_COMMIT			/* the client is killed just before COMMIT */
} Fault;

/* POST /charges {order, amount} with an Idempotency-Key header */
typedef struct Request
{
	const char *key;
	const char *order;
	int			amount;
	Shape		shape;
	const char *in_flight;		/* 'wait' or 'raise'; NULL: the setting */
	const char *lease;			/* NULL: idempotency.lease (30 s) */
	const char *takeover;		/* 'lease' or 'session'; NULL: the setting */
	const char *remember;		/* NULL: idempotency.remember (off) */
	bool		checkpoint;		/* record "provider called with key" first */
	int			send_at_ms;		/* after the scenario starts */
	bool		retry;			/* and not before the first request's claim */
	Fault		fault;
} Request;

typedef struct Response
{
	int			http;			/* 201 charged, 200 replayed, 4xx/5xx */
	char		charge[16];		/* the charge id in the body, if any */
	char		sqlstate[6];	/* the error behind a 4xx/5xx, if any */
	char		message[256];
	char		detail[256];

	/* what the stage saw of the request */
	char		label;			/* A, B, C: order of sending */
	char		shown[24];		/* the response in the table */
	long long	token;			/* the claim's token, 0 if it got none */
	bool		released;		/* idem_abort returned true */
	bool		recovered;		/* idem_begin said 'recover' */
	char		provider_charge[16];	/* what the provider answered */
	double		sent_ms;		/* times since the scenario started */
	double		claimed_ms;		/* idem_begin (or the cache look-up) returned */
	double		answered_ms;
	double		died_ms;
	bool		killed;
	bool		broken;			/* the client process itself failed */
} Response;

/* A client process's connections */
typedef struct Client
{
	PGconn	   *db;				/* the application's database */
	PGconn	   *provider;		/* "HTTP" to the payment provider */
} Client;

static double since_start(void);
static void die_if(const Request *req, Fault where, Response *resp);

/* ---- handling a request ---- */

/*
 * SQLSTATE -> HTTP status, as in docs/errors.md, "Errors and HTTP".  Anything else
 * is a 500.
 */
static const struct
{
	const char *sqlstate;
	int			http;
}			error_map[] =
{
	{"IK409", 409},				/* in progress: another attempt holds the key */
	{"IK422", 422},				/* the key was used for a different request */
	{"IK412", 500},				/* this worker lost the key: its lease lapsed */
	{"22023", 400},				/* invalid key, operation, policy, lease, ttl */
	{"22004", 400},				/* a required value is NULL */
	{"54000", 500},				/* response too large: store a reference */
	{"40001", 503},				/* serialization failure: retry */
	{"IK410", 410},				/* done, its response expired: do not retry */
};

static void
respond_error(Response *resp, const PGresult *res)
{
	const char *sqlstate = PQresultErrorField(res, PG_DIAG_SQLSTATE);
	const char *message = PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY);
	const char *detail = PQresultErrorField(res, PG_DIAG_MESSAGE_DETAIL);

	resp->http = 500;
	for (size_t i = 0; sqlstate && i < sizeof(error_map) / sizeof(error_map[0]); i++)
		if (strcmp(sqlstate, error_map[i].sqlstate) == 0)
			resp->http = error_map[i].http;
	snprintf(resp->sqlstate, sizeof(resp->sqlstate), "%s", sqlstate ? sqlstate : "");
	snprintf(resp->message, sizeof(resp->message), "%s",
			 message ? message : PQresultErrorMessage(res));
	snprintf(resp->detail, sizeof(resp->detail), "%s", detail ? detail : "");
}

static void
respond_charge(Response *resp, int http, const char *charge)
{
	resp->http = http;
	snprintf(resp->charge, sizeof(resp->charge), "%s", charge);
}

static bool
ok(const PGresult *res)
{
	return PQresultStatus(res) == PGRES_TUPLES_OK ||
		PQresultStatus(res) == PGRES_COMMAND_OK;
}

/*
 * The payment provider.  Copies the charge id and returns true, or answers
 * the client with 504 (timeout) or 502 and returns false.  On the provider
 * connection the client waits at most PROVIDER_TIMEOUT (statement_timeout).
 */
static bool
call_provider(PGconn *conn, const Request *req, char *charge_id, Response *resp)
{
	char		amount[16];
	const char *takes = req->fault == PROVIDER_HANGS ? "10 s" : "300 ms";
	const char *params[3] = {req->key, amount, takes};
	PGresult   *res;
	const char *sqlstate;
	bool		charged;

	snprintf(amount, sizeof(amount), "%d", req->amount);
	if (req->fault == DIE_MID_CHARGE)
	{
		/* the request reaches the provider, the worker dies meanwhile */
		if (PQsendQueryParams(conn, "SELECT provider.charge($1, $2::int, $3::interval)",
							  3, NULL, params, NULL, NULL, 0))
			usleep(DIE_AFTER_MS * 1000);
		die_if(req, DIE_MID_CHARGE, resp);
	}
	res = PQexecParams(conn, "SELECT provider.charge($1, $2::int, $3::interval)",
					   3, NULL, params, NULL, NULL, 0);
	charged = ok(res);
	if (charged)
	{
		snprintf(charge_id, 16, "%s", PQgetvalue(res, 0, 0));
		snprintf(resp->provider_charge, sizeof(resp->provider_charge), "%s", charge_id);
	}
	else
	{
		sqlstate = PQresultErrorField(res, PG_DIAG_SQLSTATE);
		resp->http = sqlstate && strcmp(sqlstate, "57014") == 0 ? 504 : 502;
		snprintf(resp->message, sizeof(resp->message), "provider: %s",
				 PQresultErrorMessage(res));
	}
	PQclear(res);
	return charged;
}

/*
 * Reserve the key (or replay, or wait, or fail: see error_map).  A
 * 'recover' means this request took over a claim whose worker died after
 * its checkpoint: response is that checkpoint.
 */
static const char *const claim_sql =
"SELECT status, token, coalesce(response->>'charge', response->>'provider_key')"
"  FROM idem_begin('payment.charge', $1, idem_fingerprint($2::text, $3::int),"
"                  in_flight => $4, lease => $5::interval,"
"                  takeover => $6, remember => $7::interval)";

/* "the provider is being called with this key", before calling it */
static const char *const checkpoint_sql =
"SELECT idem_checkpoint('payment.charge', $1, $2::bigint,"
"                       jsonb_build_object('provider_key', $1::text))";

/* the charge the provider made with this key, if any */
static const char *const charge_of_sql =
"SELECT provider.charge_of($1)";

static const char *const finish_sql =
"SELECT idem_finish('payment.charge', $1, $2::bigint,"
"                   jsonb_build_object('charge', $3::text))";

static const char *const abort_sql =
"SELECT idem_abort('payment.charge', $1, $2::bigint)";

/*
 * External effect (README, "Two usage shapes"): the claim is committed
 * first, so that a duplicate sees it while the provider works; the provider
 * is called outside any transaction; the response is stored with
 * idem_finish, or the claim is released with idem_abort when the charge
 * failed.
 */
static void
charge_external(Client *c, const Request *req, Response *resp)
{
	char		amount[16];
	char		token[24];
	char		charge_id[16];
	const char *claim[7] = {req->key, req->order, amount, req->in_flight, req->lease,
	req->takeover, req->remember};
	const char *settle[3] = {req->key, token, charge_id};
	PGresult   *res;
	bool		recover;

	snprintf(amount, sizeof(amount), "%d", req->amount);

	/* 1. reserve the key (autocommit: the claim commits at once) */
	res = PQexecParams(c->db, claim_sql, 7, NULL, claim, NULL, NULL, 0);
	resp->claimed_ms = since_start();
	if (!ok(res))
	{
		respond_error(resp, res);	/* IK409 in progress, IK422 key reused */
		PQclear(res);
		return;
	}
	if (strcmp(PQgetvalue(res, 0, 0), "replay") == 0)
	{
		respond_charge(resp, 200, PQgetvalue(res, 0, 2));
		PQclear(res);
		return;
	}
	snprintf(token, sizeof(token), "%s", PQgetvalue(res, 0, 1));
	resp->token = strtoll(token, NULL, 10);
	recover = strcmp(PQgetvalue(res, 0, 0), "recover") == 0;
	PQclear(res);

	die_if(req, DIE_AFTER_CLAIM, resp);

	/*
	 * 2a. 'recover': the worker before us died after calling the provider
	 * with this key.  Ask the provider what that call did; if it charged,
	 * that charge is the answer.
	 */
	charge_id[0] = '\0';
	if (recover)
	{
		resp->recovered = true;
		res = PQexecParams(c->provider, charge_of_sql, 1, NULL, &req->key, NULL, NULL, 0);
		if (ok(res) && !PQgetisnull(res, 0, 0))
			snprintf(charge_id, sizeof(charge_id), "%s", PQgetvalue(res, 0, 0));
		PQclear(res);
	}
	else if (req->checkpoint)
	{
		res = PQexecParams(c->db, checkpoint_sql, 2, NULL, settle, NULL, NULL, 0);
		PQclear(res);
	}

	/* 2b. the action, passing the key on */
	if (!charge_id[0] && !call_provider(c->provider, req, charge_id, resp))
	{
		/* 3a. errors are not cached: release the key for a retry */
		res = PQexecParams(c->db, abort_sql, 2, NULL, settle, NULL, NULL, 0);
		resp->released = ok(res) && strcmp(PQgetvalue(res, 0, 0), "t") == 0;
		PQclear(res);
		return;
	}

	/* 3b. store the response; duplicates waiting for it get it now */
	res = PQexecParams(c->db, finish_sql, 3, NULL, settle, NULL, NULL, 0);
	if (ok(res))
		respond_charge(resp, 201, charge_id);
	else
		respond_error(resp, res);	/* IK412: we lost the key */
	PQclear(res);
}

/*
 * Effect in the same database (README, "Two usage shapes"): claim, charge
 * and response commit or roll back together.  A client that dies before
 * COMMIT leaves nothing behind, and a duplicate waiting for it gets the key
 * at once.
 */
static void
charge_in_transaction(Client *c, const Request *req, Response *resp)
{
	char		amount[16];
	char		token[24];
	char		charge_id[16];
	const char *claim[7] = {req->key, req->order, amount, req->in_flight, req->lease,
	req->takeover, req->remember};
	const char *settle[3] = {req->key, token, charge_id};
	PGresult   *res;

	snprintf(amount, sizeof(amount), "%d", req->amount);
	PQclear(PQexec(c->db, "BEGIN"));

	/* 1. reserve the key, in this transaction */
	res = PQexecParams(c->db, claim_sql, 7, NULL, claim, NULL, NULL, 0);
	resp->claimed_ms = since_start();
	if (!ok(res))
		respond_error(resp, res);	/* IK409 in progress, IK422 key reused */
	else if (strcmp(PQgetvalue(res, 0, 0), "replay") == 0)
		respond_charge(resp, 200, PQgetvalue(res, 0, 2));
	else
	{
		snprintf(token, sizeof(token), "%s", PQgetvalue(res, 0, 1));
		resp->token = strtoll(token, NULL, 10);

		/* 2. the charge, a write in this same transaction */
		if (call_provider(c->db, req, charge_id, resp))
		{
			die_if(req, DIE_BEFORE_COMMIT, resp);

			/* 3. store the response */
			PQclear(res);
			res = PQexecParams(c->db, finish_sql, 3, NULL, settle, NULL, NULL, 0);
			if (ok(res))
				respond_charge(resp, 201, charge_id);
			else
				respond_error(resp, res);
		}
	}
	PQclear(res);

	/* 4. all of it or nothing: a failed charge rolls the claim back too */
	res = PQexec(c->db, resp->charge[0] ? "COMMIT" : "ROLLBACK");
	if (!ok(res))
		respond_error(resp, res);
	PQclear(res);
}

/*
 * For contrast, the usual first implementation: look the key up, replay a
 * stored response, else charge and store the result.  It reserves nothing,
 * so a retry that arrives while the first attempt runs charges again.
 */
static void
charge_with_result_cache(Client *c, const Request *req, Response *resp)
{
	const char *lookup = "SELECT response->>'charge' FROM result_cache WHERE idem_key = $1";
	char		charge_id[16];
	const char *store[2] = {req->key, charge_id};
	PGresult   *res;

	res = PQexecParams(c->db, lookup, 1, NULL, &req->key, NULL, NULL, 0);
	resp->claimed_ms = since_start();
	if (ok(res) && PQntuples(res) == 1)
	{
		respond_charge(resp, 200, PQgetvalue(res, 0, 0));
		PQclear(res);
		return;
	}
	PQclear(res);

	if (!call_provider(c->provider, req, charge_id, resp))
		return;

	/* the first result stored wins; answer with the winner's */
	res = PQexecParams(c->db,
					   "INSERT INTO result_cache VALUES ($1, jsonb_build_object('charge', $2::text))"
					   " ON CONFLICT (idem_key) DO NOTHING",
					   2, NULL, store, NULL, NULL, 0);
	if (ok(res))
	{
		PQclear(res);
		res = PQexecParams(c->db, lookup, 1, NULL, &req->key, NULL, NULL, 0);
	}
	if (ok(res) && PQntuples(res) == 1)
		respond_charge(resp, 201, PQgetvalue(res, 0, 0));
	else
		respond_error(resp, res);
	PQclear(res);
}

/* ---- the stage: clients as processes ---- */

/* Shared with the client processes */
typedef struct Stage
{
	double		t0;				/* CLOCK_MONOTONIC, ms: the scenario's start */
	Response	resp[MAX_CLIENTS];
} Stage;

static Stage *stage;
static PGconn *admin;			/* the stage's own connection to idem_demo */
static Response history[MAX_HISTORY];	/* this scenario's responses */
static int	nhistory;

static void
fail(const char *fmt,...)
{
	va_list		ap;

	va_start(ap, fmt);
	fprintf(stderr, "demo: ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\n");
	va_end(ap);
	exit(2);
}

static double
now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static double
since_start(void)
{
	return now_ms() - stage->t0;
}

static void
sleep_until(double ms)
{
	struct timespec ts;

	ts.tv_sec = (time_t) (ms / 1e3);
	ts.tv_nsec = (long) ((ms - ts.tv_sec * 1e3) * 1e6);
	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
		;
}

/*
 * A retry is meant to arrive while the first attempt runs.  Sent 50 ms after
 * it, it does, unless the first client's process was not scheduled in time
 * (a loaded machine): then hold the retry until the first request's claim
 * (or cache look-up) has returned, so the two never swap roles.
 */
static void
wait_for_first_claim(void)
{
	volatile Response *first = &stage->resp[0];
	struct timespec ms = {0, 1000000};

	for (int i = 0; i < 10000 && first->claimed_ms == 0; i++)
		nanosleep(&ms, NULL);
}

/* A client that dies here dies for real: no ROLLBACK, no goodbye. */
static void
die_if(const Request *req, Fault where, Response *resp)
{
	if (req->fault != where)
		return;
	resp->died_ms = since_start();
	raise(SIGKILL);
}

static PGconn *
connect_to(const char *dbname, const char *options, const char *app_name)
{
	const char *keywords[] = {"dbname", "options", "application_name", NULL};
	const char *values[] = {dbname, options, app_name, NULL};

	return PQconnectdbParams(keywords, values, 0);
}

/*
 * One client process: connect, report ready, wait for the start, send the
 * request at its time, record the response in shared memory.
 */
static void
client_main(const Request *req, Response *resp, int ready_fd, int go_fd)
{
	Client		c = {NULL, NULL};
	char		name[32];
	char		byte = 0;

	snprintf(name, sizeof(name), "idem-demo %c", resp->label);
	/* a safety net: no wait in this demo should come near 10 s */
	c.db = connect_to(DEMO_DB, "-c statement_timeout=10s", name);
	if (req->shape != IN_TRANSACTION)
		c.provider = connect_to(DEMO_DB, "-c statement_timeout=" PROVIDER_TIMEOUT, name);
	if (PQstatus(c.db) != CONNECTION_OK ||
		(c.provider && PQstatus(c.provider) != CONNECTION_OK))
	{
		resp->broken = true;
		snprintf(resp->message, sizeof(resp->message), "connection failed: %s",
				 PQerrorMessage(PQstatus(c.db) != CONNECTION_OK ? c.db : c.provider));
	}
	if (write(ready_fd, &byte, 1) != 1 || resp->broken)
		_exit(1);
	if (read(go_fd, &byte, 1) != 1)
		_exit(1);

	sleep_until(stage->t0 + req->send_at_ms);
	if (req->retry)
		wait_for_first_claim();
	resp->sent_ms = since_start();
	switch (req->shape)
	{
		case RESULT_CACHE:
			charge_with_result_cache(&c, req, resp);
			break;
		case EXTERNAL_CALL:
			charge_external(&c, req, resp);
			break;
		case IN_TRANSACTION:
			charge_in_transaction(&c, req, resp);
			break;
	}
	resp->answered_ms = since_start();
	PQfinish(c.db);
	if (c.provider)
		PQfinish(c.provider);
	_exit(0);
}

/* The response as the table shows it: a charge id, an IK error, a status */
static void
describe(Response *r)
{
	char		shown[sizeof(r->shown)];

	if (r->killed)
		snprintf(shown, sizeof(shown), "(killed)");
	else if (r->broken)
		snprintf(shown, sizeof(shown), "(broken)");
	else if (r->charge[0])
		snprintf(shown, sizeof(shown), "%s", r->charge);
	else if (r->sqlstate[0] == 'I')
		snprintf(shown, sizeof(shown), "%s", r->sqlstate);
	else
		snprintf(shown, sizeof(shown), "%d", r->http);
	memcpy(r->shown, shown, sizeof(shown));
}

/*
 * Run n requests concurrently, each in its own process, sent at its
 * send_at_ms after a common start (all connections are made before the
 * start).  Fills out[] with what each received.
 */
static void
run_clients(const Request *req, int n, Response *out)
{
	int			ready[2], go[2];
	pid_t		pid[MAX_CLIENTS];
	char		bytes[MAX_CLIENTS] = {0};
	struct pollfd pfd;
	int			got = 0;

	if (n > MAX_CLIENTS || nhistory + n > MAX_HISTORY)
		fail("too many clients");
	if (pipe(ready) != 0 || pipe(go) != 0)
		fail("pipe: %s", strerror(errno));
	memset(stage->resp, 0, sizeof(stage->resp));
	stage->t0 = now_ms();
	fflush(stdout);
	fflush(stderr);
	for (int i = 0; i < n; i++)
	{
		stage->resp[i].label = 'A' + nhistory + i;
		pid[i] = fork();
		if (pid[i] < 0)
			fail("fork: %s", strerror(errno));
		if (pid[i] == 0)
		{
			close(ready[0]);
			close(go[1]);
			client_main(&req[i], &stage->resp[i], ready[1], go[0]);
		}
	}
	close(ready[1]);
	close(go[0]);

	/* everyone connected (or failed): start the clock */
	pfd.fd = ready[0];
	pfd.events = POLLIN;
	while (got < n && poll(&pfd, 1, 30000) > 0)
	{
		ssize_t		r = read(ready[0], bytes, n - got);

		if (r <= 0)
			break;
		got += r;
	}
	stage->t0 = now_ms();
	if (write(go[1], bytes, n) != n)
	{
		/* a client is gone: waitpid below says so */
	}
	close(go[1]);
	close(ready[0]);

	for (int i = 0; i < n; i++)
	{
		int			status;
		Response   *r = &stage->resp[i];

		if (waitpid(pid[i], &status, 0) != pid[i])
			fail("waitpid: %s", strerror(errno));
		r->killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
		if (!r->killed && !(WIFEXITED(status) && WEXITSTATUS(status) == 0))
		{
			r->broken = true;
			if (!r->message[0])
				snprintf(r->message, sizeof(r->message), "client process failed (status %d)", status);
		}
		describe(r);
		out[i] = *r;
		history[nhistory++] = *r;
	}
}

/* ---- counting and checking ---- */

static PGresult *
query(const char *sql, int nparams, const char *const *params)
{
	PGresult   *res = PQexecParams(admin, sql, nparams, NULL, params, NULL, NULL, 0);

	if (!ok(res))
		fail("%s\n%s", sql, PQresultErrorMessage(res));
	return res;
}

static void
run_sql(const char *sql)
{
	PGresult   *res = PQexec(admin, sql);

	if (!ok(res))
		fail("%s\n%s", sql, PQresultErrorMessage(res));
	PQclear(res);
}

/* The provider's charges, "ch_1, ch_2" or "none" */
static void
charges(char *list, size_t size)
{
	PGresult   *res = query("SELECT coalesce(string_agg(id, ', ' ORDER BY charged_at), 'none')"
							"  FROM provider.charges", 0, NULL);

	snprintf(list, size, "%s", PQgetvalue(res, 0, 0));
	PQclear(res);
}

static bool
is(const char *a, const char *b)
{
	return strcmp(a, b) == 0;
}

/* A request for key, amount 10, in the external-call shape */
static Request
request(const char *key)
{
	Request		r = {
		.key = key,
		.order = "order-42",
		.amount = 10,
		.shape = EXTERNAL_CALL,
	};

	return r;
}

/* The same request again, sent RETRY_AFTER_MS after the first */
static Request
retry_of(Request first)
{
	first.send_at_ms = RETRY_AFTER_MS;
	first.retry = true;
	return first;
}

/* ---- the scenarios ---- */

/* Each fills "observed" from what happened and says whether it was expected */
typedef bool (*ScenarioFn) (char *observed, size_t size);

static bool
result_cache(char *observed, size_t size)
{
	Request		req[2] = {request("key-1"), retry_of(request("key-1"))};
	Response	r[2];
	char		ch[64];

	req[0].shape = req[1].shape = RESULT_CACHE;
	run_clients(req, 2, r);
	charges(ch, sizeof(ch));
	snprintf(observed, size, "responses %s, %s; charges %s",
			 r[0].shown, r[1].shown, ch);
	return is(r[0].charge, "ch_1") && is(r[1].charge, "ch_1") &&
		is(ch, "ch_1, ch_2");
}

static bool
in_flight_wait(char *observed, size_t size)
{
	Request		req[2] = {request("key-2"), retry_of(request("key-2"))};
	Response	r[2];
	char		ch[64];

	req[0].in_flight = req[1].in_flight = "wait";
	run_clients(req, 2, r);
	charges(ch, sizeof(ch));
	snprintf(observed, size,
			 "responses %s, %s; charges %s. B waited %.0f ms, then replayed A's response",
			 r[0].shown, r[1].shown, ch, r[1].claimed_ms - r[1].sent_ms);
	return is(r[0].charge, "ch_1") && r[0].http == 201 &&
		is(r[1].charge, "ch_1") && r[1].http == 200 &&
		r[1].sent_ms < r[0].answered_ms &&
		is(ch, "ch_1");
}

static bool
in_flight_raise(char *observed, size_t size)
{
	Request		req[2] = {request("key-3"), retry_of(request("key-3"))};
	Response	r[2];
	char		ch[64];

	req[0].in_flight = req[1].in_flight = "raise";
	run_clients(req, 2, r);
	charges(ch, sizeof(ch));
	snprintf(observed, size,
			 "responses %s, %s; charges %s. B was refused (HTTP %d) after %.0f ms, while A was still charging",
			 r[0].shown, r[1].shown, ch, r[1].http, r[1].answered_ms - r[1].sent_ms);
	return is(r[0].charge, "ch_1") &&
		is(r[1].sqlstate, "IK409") && r[1].http == 409 &&
		r[1].answered_ms < r[0].answered_ms &&
		is(ch, "ch_1");
}

static bool
same_key_same_amount(char *observed, size_t size)
{
	Request		first = request("key-4");
	Request		retry = request("key-4");
	Response	r[2];
	char		ch[64];

	run_clients(&first, 1, &r[0]);
	run_clients(&retry, 1, &r[1]);
	charges(ch, sizeof(ch));
	snprintf(observed, size, "responses %s, %s (HTTP %d: replayed); charges %s",
			 r[0].shown, r[1].shown, r[1].http, ch);
	return is(r[0].charge, "ch_1") &&
		is(r[1].charge, "ch_1") && r[1].http == 200 &&
		is(ch, "ch_1");
}

static bool
same_key_amount_5(char *observed, size_t size)
{
	Request		first = request("key-5");
	Request		retry = request("key-5");
	Response	r[2];
	char		ch[64];
	char		stored[160], requested[160];
	PGresult   *res;

	retry.amount = 5;
	run_clients(&first, 1, &r[0]);
	run_clients(&retry, 1, &r[1]);
	charges(ch, sizeof(ch));

	/* the fingerprints both requests carried, as the DETAIL must show them */
	res = query("SELECT idem_fingerprint($1::text, 10)::text,"
				"       idem_fingerprint($1::text, 5)::text", 1, &first.order);
	snprintf(stored, sizeof(stored), "Stored fingerprint: %s.", PQgetvalue(res, 0, 0));
	snprintf(requested, sizeof(requested), "Request fingerprint: %s.", PQgetvalue(res, 0, 1));
	PQclear(res);

	snprintf(observed, size,
			 "responses %s, %s (HTTP %d); charges %s. DETAIL: \"%.30s... %.31s...\"",
			 r[0].shown, r[1].shown, r[1].http, ch, stored, requested);
	return is(r[0].charge, "ch_1") &&
		is(r[1].sqlstate, "IK422") && r[1].http == 422 &&
		strstr(r[1].detail, stored) && strstr(r[1].detail, requested) &&
		is(ch, "ch_1");
}

static bool
provider_timeout(char *observed, size_t size)
{
	Request		req[2] = {request("key-6"), retry_of(request("key-6"))};
	Response	r[2];
	char		ch[64];

	req[0].fault = PROVIDER_HANGS;
	run_clients(req, 2, r);
	charges(ch, sizeof(ch));
	snprintf(observed, size,
			 "responses %s, %s; charges %s. A's provider call timed out, "
			 "idem_abort released the claim (%s); B, waiting since %.0f ms, "
			 "then got the key",
			 r[0].shown, r[1].shown, ch, r[0].released ? "true" : "false",
			 r[1].sent_ms);
	return r[0].http == 504 && r[0].released &&
		is(r[1].charge, "ch_1") && r[1].http == 201 &&
		r[1].sent_ms < r[0].answered_ms &&
		is(ch, "ch_1");
}

static bool
client_dies_in_transaction(char *observed, size_t size)
{
	Request		req[2] = {request("key-7"), retry_of(request("key-7"))};
	Response	r[2];
	char		ch[64];
	double		freed_after;

	req[0].shape = req[1].shape = IN_TRANSACTION;
	req[0].fault = DIE_BEFORE_COMMIT;
	run_clients(req, 2, r);
	charges(ch, sizeof(ch));
	freed_after = r[1].claimed_ms - r[0].died_ms;
	snprintf(observed, size,
			 "responses %s, %s; charges %s. A charged %s in its transaction "
			 "and was killed before COMMIT; B, waiting since %.0f ms, got the "
			 "key %.0f ms after A died (not after its 30 s lease)",
			 r[0].shown, r[1].shown, ch,
			 r[0].provider_charge[0] ? r[0].provider_charge : "nothing",
			 r[1].sent_ms, freed_after);
	return r[0].killed &&
		is(r[1].charge, "ch_1") && r[1].http == 201 &&
		r[1].sent_ms < r[0].died_ms &&
		freed_after >= 0 && freed_after < 1000 &&
		is(ch, "ch_1");
}

static bool
worker_dies_after_claim(char *observed, size_t size)
{
	Request		req[2] = {request("key-8"), retry_of(request("key-8"))};
	Request		later = request("key-8");
	const char *late_finish[2];
	char		token[24];
	char		late[8];
	Response	r[3];
	char		ch[64];
	double		takeover;
	PGresult   *res;
	const char *sqlstate;

	req[0].lease = req[1].lease = SHORT_LEASE;
	req[0].fault = DIE_AFTER_CLAIM;
	run_clients(req, 2, r);
	takeover = r[1].claimed_ms - r[0].sent_ms;

	/* the dead worker's idem_finish, arriving late with its old token */
	snprintf(token, sizeof(token), "%lld", r[0].token);
	late_finish[0] = req[0].key;
	late_finish[1] = token;
	res = PQexecParams(admin,
					   "SELECT idem_finish('payment.charge', $1, $2::bigint, '{\"charge\": \"ch_late\"}')",
					   2, NULL, late_finish, NULL, NULL, 0);
	sqlstate = PQresultErrorField(res, PG_DIAG_SQLSTATE);
	snprintf(late, sizeof(late), "%s",
			 ok(res) ? "stored!" : sqlstate ? sqlstate : "error");
	PQclear(res);

	run_clients(&later, 1, &r[2]);
	charges(ch, sizeof(ch));
	snprintf(observed, size,
			 "responses %s, %s; charges %s. A claimed the key (token %lld) and "
			 "was killed; B waited %.2f s for A's %s lease to lapse, took the "
			 "key over (token %lld); a late idem_finish with A's token: %s; "
			 "a later retry C replays %s",
			 r[0].shown, r[1].shown, ch, r[0].token, (r[1].claimed_ms - r[1].sent_ms) / 1e3,
			 SHORT_LEASE, r[1].token, late, r[2].shown);
	return r[0].killed && r[0].token > 0 &&
		is(r[1].charge, "ch_1") && r[1].http == 201 && r[1].token > r[0].token &&
		takeover >= SHORT_LEASE_MS && takeover < SHORT_LEASE_MS + 1000 &&
		is(late, "IK412") &&
		is(r[2].charge, "ch_1") && r[2].http == 200 &&
		is(ch, "ch_1");
}

/* Rows 9 and 10: A is killed 150 ms into the provider's 300 ms charge */
static bool
killed_mid_charge(const char *key, bool session, Response *r, char *ch, size_t chsize)
{
	Request		req[2] = {request(key), retry_of(request(key))};

	req[0].lease = req[1].lease = SHORT_LEASE;
	if (session)
	{
		req[0].takeover = req[1].takeover = "session";
		req[0].checkpoint = req[1].checkpoint = true;
	}
	req[0].fault = DIE_MID_CHARGE;
	run_clients(req, 2, r);
	charges(ch, chsize);
	return r[0].killed;
}

static bool
lease_worker_killed_mid_charge(char *observed, size_t size)
{
	Response	r[2];
	char		ch[64];
	bool		killed = killed_mid_charge("key-9", false, r, ch, sizeof(ch));

	snprintf(observed, size,
			 "responses %s, %s; charges %s. A was killed %d ms into the charge; "
			 "B waited %.2f s for A's %s lease, took the key with 'new' and "
			 "charged again",
			 r[0].shown, r[1].shown, ch, DIE_AFTER_MS,
			 (r[1].claimed_ms - r[1].sent_ms) / 1e3, SHORT_LEASE);
	return killed && is(r[1].charge, "ch_2") && r[1].http == 201 &&
		r[1].claimed_ms - r[0].sent_ms >= SHORT_LEASE_MS &&
		is(ch, "ch_1, ch_2");
}

static bool
session_worker_killed_mid_charge(char *observed, size_t size)
{
	Response	r[2];
	char		ch[64];
	bool		killed = killed_mid_charge("key-10", true, r, ch, sizeof(ch));
	double		recovered_after = r[1].claimed_ms - r[0].died_ms;

	snprintf(observed, size,
			 "responses %s, %s; charges %s. A checkpointed, called the provider "
			 "and was killed %d ms into the charge; B got 'recover' %.0f ms after "
			 "A died (not after the lease), asked the provider for key-10's "
			 "charge and answered %s",
			 r[0].shown, r[1].shown, ch, DIE_AFTER_MS, recovered_after,
			 r[1].charge[0] ? r[1].charge : "nothing");
	return killed && r[1].recovered && is(r[1].charge, "ch_1") &&
		recovered_after >= 0 && recovered_after < 1000 &&
		is(ch, "ch_1");
}

static bool
retry_after_ttl(char *observed, size_t size)
{
	Request		first = request("key-11");
	Request		retry = request("key-11");
	Response	r[2];
	char		ch[64];

	first.remember = retry.remember = "30 days";
	run_clients(&first, 1, &r[0]);
	/* the stage moves the record past its ttl (at least a minute) */
	run_sql("UPDATE idem_result SET expires_at = now() - interval '1 s'"
			" WHERE key = 'key-11';"
			"UPDATE idem_record SET expires_at = now() - interval '1 s'"
			" WHERE key = 'key-11' AND completed_at IS NOT NULL");
	run_clients(&retry, 1, &r[1]);
	charges(ch, sizeof(ch));
	snprintf(observed, size, "responses %s, %s (HTTP %d); charges %s",
			 r[0].shown, r[1].shown, r[1].http, ch);
	return is(r[0].charge, "ch_1") &&
		is(r[1].sqlstate, "IK410") && r[1].http == 410 &&
		is(ch, "ch_1");
}

static const struct
{
	const char *scenario;
	const char *expected;
	ScenarioFn	run;
}			scenarios[] =
{
	{"1. result cache without reservation (plain SQL look-up-then-store, for contrast)",
		"responses ch_1, ch_1; charges ch_1, ch_2 -- the double charge",
	result_cache},
	{"2. in_flight => 'wait' (the default)",
		"responses ch_1, ch_1; charges ch_1",
	in_flight_wait},
	{"3. in_flight => 'raise'",
		"responses ch_1, IK409; charges ch_1",
	in_flight_raise},
	{"4. same key, same amount (B sent after A's response)",
		"replayed ch_1, 1 charge",
	same_key_same_amount},
	{"5. same key, amount 5 (A: amount 10)",
		"IK422 with both fingerprints, 1 charge",
	same_key_amount_5},
	{"6. first attempt fails (provider timeout)",
		"claim released; the retry charges once",
	provider_timeout},
	{"7. in-transaction: the client dies mid-transaction",
		"nothing charged, key free at once; the retry charges once",
	client_dies_in_transaction},
	{"8. external call: the worker dies after claiming",
		"the retry waits out the lease, takes over, charges once; "
		"the dead worker's late idem_finish is refused (IK412)",
	worker_dies_after_claim},
	{"9. external call, takeover => 'lease': the worker is killed mid-charge",
		"the retry waits out the lease and charges again: charges ch_1, ch_2 "
		"(unless the provider refuses a second charge with the key)",
	lease_worker_killed_mid_charge},
	{"10. external call, takeover => 'session' and a checkpoint: the worker is "
		"killed mid-charge",
		"the retry gets 'recover' at once, asks the provider by key and answers "
		"ch_1; charges ch_1",
	session_worker_killed_mid_charge},
	{"11. a retry after the ttl, remember => '30 days' (the stage moves the "
		"ttl into the past)",
		"IK410 (HTTP 410): done, its response expired; charges ch_1",
	retry_after_ttl},
};

/* ---- the table ---- */

#define NCOLS 4
static const int widths[NCOLS] = {24, 26, 42, 4};

/*
 * One table row, each cell word-wrapped to its column (cells are ASCII).
 */
static void
print_row(const char *cells[NCOLS])
{
	const char *p[NCOLS];
	bool		more = true;

	memcpy(p, cells, sizeof(p));
	while (more)
	{
		char		line[256];
		int			end = 0;

		more = false;
		for (int i = 0; i < NCOLS; i++)
		{
			int			w = widths[i];
			int			len = (int) strlen(p[i]);

			if (len > w)
			{
				len = w;
				while (len > 0 && p[i][len] != ' ')
					len--;
				if (len == 0)
					len = w;
			}
			end += snprintf(line + end, sizeof(line) - end, "%s%-*.*s",
							i == 0 ? "" : " | ", w, len, p[i]);
			p[i] += len;
			while (*p[i] == ' ')
				p[i]++;
			more |= *p[i] != '\0';
		}
		while (end > 0 && line[end - 1] == ' ')
			end--;
		printf("%.*s\n", end, line);
	}
}

static void
print_rule(char c)
{
	for (int i = 0; i < NCOLS; i++)
	{
		if (i > 0)
			printf("%c%c%c", c, c == '=' ? '=' : '+', c);
		for (int j = 0; j < widths[i]; j++)
			putchar(c);
	}
	printf("\n");
}

static void
print_history(void)
{
	for (int i = 0; i < nhistory; i++)
	{
		const Response *r = &history[i];

		printf("    %c: HTTP %d %s%s%s%s%s; token %lld; sent at %.0f ms, claimed %.0f, "
			   "answered %.0f%s\n",
			   r->label, r->http, r->charge, r->sqlstate[0] ? " " : "", r->sqlstate,
			   r->message[0] ? " " : "", r->message, r->token,
			   r->sent_ms, r->claimed_ms, r->answered_ms,
			   r->killed ? ", killed" : r->broken ? ", client broken" : "");
		if (r->detail[0])
			printf("       DETAIL: %s\n", r->detail);
	}
}

/* ---- main ---- */

static void
create_database(void)
{
	PGconn	   *conn = connect_to(NULL, "-c client_min_messages=warning", "idem-demo setup");
	PGresult   *res;

	if (PQstatus(conn) != CONNECTION_OK)
		fail("cannot connect: %s", PQerrorMessage(conn));
	res = PQexec(conn, "DROP DATABASE IF EXISTS " DEMO_DB " WITH (FORCE)");
	if (ok(res))
	{
		PQclear(res);
		res = PQexec(conn, "CREATE DATABASE " DEMO_DB);
	}
	if (!ok(res))
		fail("%s", PQresultErrorMessage(res));
	PQclear(res);
	PQfinish(conn);
}

static void
drop_database(void)
{
	PGconn	   *conn = connect_to(NULL, NULL, "idem-demo cleanup");

	PQclear(PQexec(conn, "DROP DATABASE IF EXISTS " DEMO_DB " WITH (FORCE)"));
	PQfinish(conn);
}

int
main(void)
{
	int			nscenarios = sizeof(scenarios) / sizeof(scenarios[0]);
	int			deviated = 0;
	double		start = now_ms();
	PGresult   *res;

	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGPIPE, SIG_IGN);
	stage = mmap(NULL, sizeof(Stage), PROT_READ | PROT_WRITE,
				 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (stage == MAP_FAILED)
		fail("mmap: %s", strerror(errno));

	create_database();
	admin = connect_to(DEMO_DB, NULL, "idem-demo stage");
	if (PQstatus(admin) != CONNECTION_OK)
		fail("cannot connect: %s", PQerrorMessage(admin));
	run_sql("SET client_min_messages = warning");
	run_sql(setup_sql);
	res = query("SELECT split_part(current_setting('server_version'), ' ', 1), extversion"
				"  FROM pg_extension WHERE extname = 'idempotency'", 0, NULL);
	printf("idempotency %s on PostgreSQL %s: the scenarios of README, \"Quick start\", replayed\n",
		   PQgetvalue(res, 0, 1), PQgetvalue(res, 0, 0));
	PQclear(res);
	printf("A is a client's POST /charges, B its retry with the same Idempotency-Key,\n"
		   "sent %d ms later (rows 4-5: after A's response); each is a process with its\n"
		   "own connections. The provider takes 300 ms per charge. Responses: what the\n"
		   "clients received. Charges: the rows of provider.charges.\n\n", RETRY_AFTER_MS);

	print_row((const char *[]) {"scenario", "expected", "observed", "ok"});
	print_rule('=');
	for (int i = 0; i < nscenarios; i++)
	{
		char		observed[640];
		bool		as_expected;

		run_sql(reset_sql);
		nhistory = 0;
		as_expected = scenarios[i].run(observed, sizeof(observed));
		print_row((const char *[]) {scenarios[i].scenario, scenarios[i].expected,
					observed, as_expected ? "ok" : "FAIL"});
		if (!as_expected)
		{
			deviated++;
			printf("    ^ deviates from the expected outcome; what each client saw:\n");
			print_history();
		}
		print_rule('-');
	}

	PQfinish(admin);
	printf("Rows 8-10 give their claims a %s lease so that the demo is quick; the default\n"
		   "(idempotency.lease) is 30 s.\n", SHORT_LEASE);
	if (deviated)
	{
		printf("%d of %d scenarios deviated from the expected outcome (%.1f s); "
			   "database %s kept for inspection\n",
			   deviated, nscenarios, (now_ms() - start) / 1e3, DEMO_DB);
		return 1;
	}
	drop_database();
	printf("all %d scenarios behaved as expected (%.1f s)\n",
		   nscenarios, (now_ms() - start) / 1e3);
	return 0;
}
