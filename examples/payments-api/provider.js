// A simulated payment provider: the external call the Idempotency-Key
// protects.  It takes `delayMs` to answer (300 ms in the scenarios of
// README, "Quick start") and then records the charge in the `charges` table,
// through its own connection pool and outside any transaction of the API: to
// the API it is as external as a real provider's HTTP endpoint.
//
// The API passes the Idempotency-Key on (README, "Using it from your
// application": "call the provider, passing the key on").  A real provider
// deduplicates on it; this one deliberately does not (charges.provider_key
// is not unique), so a double charge made by the API shows up as two rows
// and the test can count them.
//
// flakyCustomers: for these customers the first call with a given key
// fails after the delay without charging (a provider timeout), so the test
// can show that errors are not cached: the retry runs the charge again.

export class ProviderError extends Error {}

export function createProvider({ pool, delayMs = 300, flakyCustomers = [] }) {
	const flaky = new Set(flakyCustomers);
	const failedOnce = new Set();

	return {
		async charge({ idempotencyKey, customer, amount, currency }) {
			await new Promise((resolve) => setTimeout(resolve, delayMs));
			if (flaky.has(customer) && !failedOnce.has(idempotencyKey)) {
				failedOnce.add(idempotencyKey);
				throw new ProviderError(`provider timed out charging ${customer}`);
			}
			const { rows } = await pool.query(
				`INSERT INTO charges (provider_key, customer, amount, currency)
				 VALUES ($1, $2, $3, $4)
				 RETURNING id, created_at`,
				[idempotencyKey, customer, amount, currency]);
			return { id: `ch_${rows[0].id}`, created: rows[0].created_at.toISOString() };
		},
	};
}
