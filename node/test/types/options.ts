// Compiled with tsc --strict (types.test.js): every documented option and
// export of idempotency-pg, used as README.md shows them.
import express from 'express';
import pg from 'pg';
import {
  IdempotencyClient, IdempotentRoute, Claim, IdempotencyError, InProgressError, WaitTimeoutError, KeyReuseError,
  LostClaimError, ResponseExpiredError, InvalidRequestError, ResponseTooLargeError, FencedError, ExpiredError,
  InputError, fingerprint, textForm, MAX_KEY_LENGTH, parseIdempotencyKey, idempotencyKey, middleware, sendStored,
  sendProblem, problemFor, PROBLEM_TYPE_BASE, beginStatement, finishStatement, statements, translateError,
  type Json, type Outcome, type StoredResponse,
} from 'idempotency-pg';

const pool = new pg.Pool();
const counts: Record<string, number> = {};
const idem = new IdempotencyClient(pool, {
  finishPool: new pg.Pool(),
  tokens: 'string',
  inFlight: 'wait',
  lease: '30 s',
  ttl: '24 h',
  takeover: 'session',
  remember: 60_000,
  waitTimeout: '2 s',
  log: { debug: (message: string) => void message, error: (...args: unknown[]) => void args },
  onOutcome: (operation: string, outcome: Outcome) => { counts[`${operation} ${outcome}`] = 1; },
});

// claim.token a BigInt
const bigIdem = new IdempotencyClient(pool, { tokens: 'bigint' });

const app = express();
app.use(express.json());

async function charge(req: express.Request, res: express.Response): Promise<void> {
  const attempt = req.idempotency;
  if (!attempt) {
    res.status(201).json({ unguarded: true });
    return;
  }
  const state: Json = attempt.status === 'recover' ? attempt.recovered : null;
  await attempt.checkpoint({ calling: 'provider', state });
  const token: string | bigint = attempt.token;
  const stored: StoredResponse | null = await attempt.respond(
    { status: 201, headers: { location: '/charges/ch_1' }, body: { id: 'ch_1', token: String(token) } },
    { effect: { name: 'record', text: 'INSERT INTO charges (id) VALUES ($5)', values: ['ch_1'] } });
  if (stored === null) {
    console.error(`not stored: ${attempt.key} ${attempt.operation} ${attempt.claim.status}`);
  }
}

app.post('/charges', idem.middleware({
  operation: 'payment.charge',
  fingerprint: ['body.customer', 'body.amount', 'params.account', 'query.page', 'headers.x-tenant'],
  inFlight: 'raise',
  lease: 30_000,
  ttl: '1 day',
  takeover: 'lease',
  remember: '30 days',
  waitTimeout: 5000,
  checkpoint: (req: express.Request, key: string) => ({ key, customer: String(req.body.customer) }),
  recover: charge,
  replayHeaders: ['Location', 'ETag'],
  store: (status: number) => status < 500,
  onStoreError: 'run',
  problemTypeBase: 'https://api.example.com/problems/',
  header: 'Idempotency-Key',
  required: false,
  onOutcome: (operation: string, outcome: Outcome) => void [operation, outcome],
  log: { error: () => {} },
}), charge);

app.post('/other', middleware(idem, {
  operation: 'other',
  fingerprint: (req: express.Request) => [String(req.body.a), 1, 2n, true, null, undefined],
  checkpoint: true,
  recover: (req, res) => { res.status(200).json({ recovered: true }); },
  headers: ['Location'],
  problemType: (name: string) => `/problems/${name}`,
}), charge);

const route = new IdempotentRoute(idem, { operation: 'third', fingerprint: null });
app.post('/third', route.handler, charge);
const measured: number | null = route.expected;

app.post('/orders', idempotencyKey({ header: 'Idempotency-Key', required: true, problemTypeBase: PROBLEM_TYPE_BASE }),
  async (req: express.Request, res: express.Response) => {
    const key = req.idempotencyKey;
    if (typeof key !== 'string') {
      sendProblem(res, problemFor(new Error('no key')), { problemType: (name: string) => `/p/${name}` });
      return;
    }
    try {
      const claim: Claim = await idem.begin('order.create', key, ['cus_1', 4200n], { inFlight: 'wait', checkpoint: { step: 1 } });
      if (claim.status === 'replay') {
        sendStored(res, claim.response as unknown as StoredResponse, true);
        return;
      }
      await claim.renew('10 s');
      await claim.checkpoint({ step: 2 });
      const conn = claim.connection;
      await conn?.query('SELECT 1');
      const response: Json = await claim.finish({ status: 201, text: '{"id":1}' }, { effect: { text: 'SELECT $5', values: [1] } });
      sendStored(res, response as unknown as StoredResponse, false);
      if (claim.pending) {
        claim.release({ close: true });
        await claim.abort();
      }
    } catch (err) {
      await idem.sendError(res, err, { operation: 'order.create', key, expected: measured ?? 0, problemTypeBase: '/problems/' });
    }
  });

async function inspect(): Promise<number> {
  const row = await idem.inspect('payment.charge', 'k');
  const seconds = await idem.retryAfter('payment.charge', 'k', 2);
  return (row?.lease_until?.getTime() ?? 0) + seconds;
}

function classify(err: unknown): string {
  const e = translateError(err, { operation: 'op', key: 'k' });
  if (e instanceof KeyReuseError) return `${e.storedFingerprint} ${e.requestFingerprint}`;
  if (e instanceof WaitTimeoutError || e instanceof InProgressError) return 'in progress';
  if (e instanceof LostClaimError || e instanceof FencedError) return 'lost';
  if (e instanceof ResponseExpiredError || e instanceof ExpiredError) return 'expired';
  if (e instanceof InvalidRequestError || e instanceof InputError) return 'invalid';
  if (e instanceof ResponseTooLargeError) return 'too large';
  if (e instanceof IdempotencyError) return `${e.sqlstate} ${e.code} ${e.detail} ${e.operation} ${e.key}`;
  return 'other';
}

const fp: Buffer = fingerprint('cus_1', 4200, 4200n, true, null);
const text: string | null = textForm(42);
const parsed = parseIdempotencyKey('"k"');
const key: string = parsed.ok ? parsed.key : parsed.reason;
const limit: 255 = MAX_KEY_LENGTH;
const begin = beginStatement({ lease: '30 s', checkpoint: { a: 1 } });
const finish = finishStatement({ text: 'SELECT 1' });
const names: string[] = [statements.FINISH.name, statements.RETRY_AFTER.text, begin.name, finish.text];

void [inspect, classify, fp, text, key, limit, names, bigIdem];
