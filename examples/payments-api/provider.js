// A simulated payment provider: the external call the Idempotency-Key
// protects.  It records the charge in its ledger, the `provider_charges`
// table, through its own connection pool and outside any transaction of the
// API: to the API it is as external as a real provider's HTTP endpoint.  The
// charge is made when the call arrives; the answer comes `delayMs` later (300
// ms in the scenarios of the README's Quick start), so an API process killed
// meanwhile leaves a charge it never heard of, as with a real provider.
//
// The API passes the Idempotency-Key on (docs/applications.md, "From an application": "call
// the provider, passing the key on"), and the provider deduplicates by it,
// as real payment providers do: a second call with the same key returns the
// first charge and charges nothing.  Each call with a key is counted
// (`calls`), so a test sees an API that called twice even though the
// customer was charged once; a call that reuses a key with other parameters
// is refused.  `find` answers whether a charge was made with a key (the
// service asks it after taking over a dead attempt's claim, app.js).
//
// flakyCustomers: for these customers the first call with a given key
// times out without charging, so a test can show that errors are not
// cached: the retry runs the charge again.  (To the API a timeout says
// nothing about whether the charge was made: it answers 504 and the retry,
// with the same key, finds out.)

export class ProviderError extends Error {}
export class ProviderTimeoutError extends ProviderError {}

const FIND_SQL = {
	name: 'provider_find',
	text: `SELECT id, created_at, customer, amount, currency FROM provider_charges WHERE provider_key = $1`,
};

const CHARGE_SQL = {
	name: 'provider_charge',
	text: `INSERT INTO provider_charges AS p (provider_key, customer, amount, currency)
	       VALUES ($1, $2, $3, $4)
	       ON CONFLICT (provider_key) DO UPDATE SET calls = p.calls + 1
	       RETURNING id, created_at, customer, amount, currency`,
};

export function createProvider({ pool, delayMs = 300, flakyCustomers = [] }) {
	const flaky = new Set(flakyCustomers);
	const failedOnce = new Set();

	// the provider's answer for its ledger row c
	function answer(c, { idempotencyKey, customer, amount, currency }) {
		if (c.customer !== customer || Number(c.amount) !== amount || c.currency !== currency) {
			throw new ProviderError(`provider: key ${idempotencyKey} was used for another charge`);
		}
		return { id: `ch_${c.id}`, created: c.created_at.toISOString() };
	}

	return {
		// the charge made with this key, or null (a real provider's "list
		// charges by idempotency key"); it charges nothing
		async find(request) {
			const { rows } = await pool.query({ ...FIND_SQL, values: [request.idempotencyKey] });
			return rows.length ? answer(rows[0], request) : null;
		},

		async charge(request) {
			const { idempotencyKey, customer, amount, currency } = request;
			if (flaky.has(customer) && !failedOnce.has(idempotencyKey)) {
				failedOnce.add(idempotencyKey);
				await sleep(delayMs);
				throw new ProviderTimeoutError(`provider timed out charging ${customer}`);
			}
			const { rows } = await pool.query({ ...CHARGE_SQL, values: [idempotencyKey, customer, amount, currency] });
			await sleep(delayMs);
			return answer(rows[0], request);
		},
	};
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
