// Types of idempotency-pg (README.md of this package; the HTTP answers are
// docs/http.md's).  Checked with tsc --strict against test/types/options.ts.
import type { Pool, PoolClient } from 'pg';
import type { IncomingMessage, ServerResponse } from 'node:http';

/** An interval as PostgreSQL reads it ('30 s', '5 min'), or milliseconds. */
export type Duration = string | number;
export type FingerprintValue = string | number | bigint | boolean | null | undefined;
export type Outcome = 'new' | 'replay' | 'recover' | 'in_progress' | 'key_reuse' | 'expired';
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

export interface Logger {
  debug(message: string): void;
  error(...args: unknown[]): void;
}

export interface BeginOptions {
  inFlight?: 'wait' | 'raise';
  lease?: Duration;
  ttl?: Duration;
  takeover?: 'lease' | 'session';
  remember?: Duration;
  /** How long a duplicate waits for the attempt holding the key (then WaitTimeoutError, 409). */
  waitTimeout?: Duration;
  /** A state recorded by idem_checkpoint in the claim's own statement (not on a replay). */
  checkpoint?: Json;
  onOutcome?: (operation: string, outcome: Outcome) => void;
}

export interface ClientOptions extends Omit<BeginOptions, 'checkpoint' | 'onOutcome'> {
  /** Where a finish or abort runs when the claim's connection broke (default: the pool). */
  finishPool?: Pool;
  /** The type of claim.token: 'string' (default) or 'bigint'. */
  tokens?: 'string' | 'bigint';
  log?: Partial<Logger>;
  onOutcome?: (operation: string, outcome: Outcome) => void;
}

export interface Effect {
  /** A data-modifying statement run with idem_finish in one statement; parameters from $5. */
  text: string;
  values?: unknown[];
  /** A name, to make it a named prepared statement. */
  name?: string;
}

/** A response to store and send: the body as JSON (`body`), or as it is sent (`text`). */
export interface StoredResponse {
  status: number;
  /** Lower-case names; a header sent more than once as an array of its values. */
  headers?: Record<string, string | string[]>;
  body?: Json;
  text?: string;
  /** A body that is not UTF-8 text, in base64 (what the middleware stores for one). */
  base64?: string;
}

export interface InspectRow {
  state: 'pending' | 'lapsed' | 'completed' | 'remembered' | 'expired' | 'unknown';
  token: string;
  fingerprint: string | null;
  created_at: Date;
  lease_until: Date | null;
  completed_at: Date | null;
  expires_at: Date;
  uncommitted: boolean;
  response: Json;
}

export class Claim<Token = string | bigint> {
  readonly operation: string;
  readonly key: string;
  readonly fingerprint: Buffer | null;
  /** 'new' or 'recover': this attempt holds the key; 'replay': `response` is the stored one. */
  readonly status: 'new' | 'recover' | 'replay';
  /** replay: the stored response; recover: the last checkpoint's state; new: null. */
  readonly response: Json;
  /** The fencing token (null for a replay). */
  readonly token: Token | null;
  readonly pending: boolean;
  /** The claim's own connection while it is pending. */
  readonly connection: PoolClient | null;
  finish<R extends Json>(response: R, options?: { effect?: Effect }): Promise<Json>;
  abort(): Promise<boolean>;
  checkpoint(state: Json): Promise<void>;
  renew(lease: Duration): Promise<Date>;
  release(options?: { close?: boolean }): void;
}

export type Handler = (req: any, res: any, next: (err?: unknown) => void) => unknown;

export interface MiddlewareOptions extends Omit<BeginOptions, 'checkpoint'> {
  operation: string;
  /** Request parts ('body.amount', 'params.id', 'query.x', 'headers.x-tenant'), or a function. */
  fingerprint?: string[] | ((req: any) => FingerprintValue[] | Buffer | null) | null;
  /** true: { idempotency_key: key }; a function: its state.  Needs `recover`. */
  checkpoint?: boolean | ((req: any, key: string) => Json);
  /** The handler for a takeover with a checkpoint (req.idempotency.status 'recover'). */
  recover?: Handler;
  /** Response headers stored and replayed, besides Content-Type, Content-Encoding and Vary (default ['Location', 'ETag']). */
  replayHeaders?: string[];
  /** The name before 1.6 of replayHeaders. */
  headers?: string[];
  /** Which statuses are stored (default: below 500, except 408, 425, 429); others abort the claim. */
  store?: (status: number) => boolean;
  /** 'run': when the database cannot be reached, the handler runs without idempotency (default 'raise': 503). */
  onStoreError?: 'raise' | 'run';
  /** The problem "type" URI is problemTypeBase + name (default 'urn:idempotency:problem:'). */
  problemTypeBase?: string;
  /** Or a function of the name. */
  problemType?: (name: string) => string;
  header?: string;
  /** false: a request without the header runs without idempotency. */
  required?: boolean;
  log?: Partial<Logger>;
}

export interface ProblemTypeOptions {
  problemTypeBase?: string;
  problemType?: (name: string) => string;
}

export interface RequestIdempotency {
  key: string;
  operation: string;
  status: 'new' | 'recover';
  /** With status 'recover', the checkpoint state the dead attempt left. */
  recovered: Json;
  token: string | bigint;
  claim: Claim;
  /** Stores the response (and runs the effect with it), sends it; null when it was not stored. */
  respond(response: StoredResponse, options?: { effect?: Effect }): Promise<StoredResponse | null>;
  /** Needs a recover handler on the route. */
  checkpoint(state: Json): Promise<void>;
}

declare global {
  namespace Express {
    interface Request {
      /** null: no idempotency (a HEAD, no header with required: false, or onStoreError: 'run'). */
      idempotency?: RequestIdempotency | null;
      idempotencyKey?: string | null;
    }
  }
}

export type Middleware = (req: IncomingMessage & any, res: ServerResponse & any, next: (err?: unknown) => void) => void;

export class IdempotencyClient {
  constructor(pool: Pool, options?: ClientOptions);
  readonly pool: Pool;
  begin(operation: string, key: string, fingerprint: Buffer | FingerprintValue[] | null, options?: BeginOptions): Promise<Claim>;
  inspect(operation: string, key: string): Promise<InspectRow | null>;
  /** A 409's Retry-After: `expected` seconds per attempt less the holder's running time, within its lease; at least 1. */
  retryAfter(operation: string, key: string, expected?: number): Promise<number>;
  middleware(options: MiddlewareOptions): Middleware;
  sendError(res: ServerResponse, err: unknown,
    context: { operation?: string; key?: string; expected?: number; log?: Partial<Logger> } & ProblemTypeOptions): Promise<void>;
}

/** One declared route: idem.middleware(options) is new IdempotentRoute(idem, options).handler. */
export class IdempotentRoute {
  constructor(client: IdempotencyClient, options: MiddlewareOptions);
  readonly operation: string;
  readonly handler: Middleware;
  /** The mean seconds of the route's stored attempts (null before the first). */
  readonly expected: number | null;
}

export class IdempotencyError extends Error {
  readonly sqlstate: string;
  readonly code: string;
  readonly detail: string | null;
  readonly operation: string | null;
  readonly key: string | null;
}
/** IK409. */
export class InProgressError extends IdempotencyError {}
/** 57014: a wait that waitTimeout (statement_timeout) ended. */
export class WaitTimeoutError extends InProgressError {}
/** IK422.  The fingerprints in hex, null for NULL; one over 64 bytes (cut by the server) ends in "...". */
export class KeyReuseError extends IdempotencyError {
  readonly storedFingerprint: string | null;
  readonly requestFingerprint: string | null;
}
/** IK412. */
export class LostClaimError extends IdempotencyError {}
/** IK410. */
export class ResponseExpiredError extends IdempotencyError {}
/** 22023, 22004. */
export class InvalidRequestError extends IdempotencyError {}
/** 54000. */
export class ResponseTooLargeError extends IdempotencyError {}
/** The names before 1.6 of LostClaimError, ResponseExpiredError, InvalidRequestError. */
export { LostClaimError as FencedError, ResponseExpiredError as ExpiredError, InvalidRequestError as InputError };

export function translateError(err: unknown, context?: { operation?: string; key?: string }): unknown;
export function fingerprint(...values: FingerprintValue[]): Buffer;
export function textForm(value: FingerprintValue): string | null;
export const MAX_KEY_LENGTH: 255;
export function parseIdempotencyKey(value: string | string[] | undefined):
  { ok: true; key: string } | { ok: false; missing: boolean; reason: string };
export function idempotencyKey(options?: { header?: string; required?: boolean } & ProblemTypeOptions): Middleware;
export function middleware(client: IdempotencyClient, options: MiddlewareOptions): Middleware;
export function sendStored(res: ServerResponse, stored: StoredResponse, replayed: boolean): void;
export interface Problem { status: number; name: string; title: string; detail: string; extra: Record<string, unknown>; headers: Record<string, string> }
export function sendProblem(res: ServerResponse, problem: Problem, options?: ProblemTypeOptions): void;
export const PROBLEM_TYPE_BASE: 'urn:idempotency:problem:';
export function problemFor(err: unknown, options?: { retryAfter?: number }): Problem;
export function beginStatement(options: BeginOptions): { name: string; text: string; values: unknown[] };
export function finishStatement(effect?: Effect): { name?: string; text: string };
export const statements: Record<'FINISH' | 'ABORT' | 'CHECKPOINT' | 'RENEW' | 'INSPECT' | 'RETRY_AFTER', { name: string; text: string }>;
