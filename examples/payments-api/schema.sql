-- The tables of the payments example.  Run once per database, as the role
-- the service connects as, after a superuser created the extension in that
-- database (it is untrusted: only a superuser may create it), see README.md:
--   psql -v ON_ERROR_STOP=1 -f schema.sql

-- The API's record of each charge the provider made, written in the
-- statement that stores the request's response (idem_finish).
CREATE TABLE charges (
	id				text PRIMARY KEY,		-- the provider's charge id, ch_...
	idempotency_key	text NOT NULL,
	customer		text NOT NULL,
	amount			bigint NOT NULL CHECK (amount > 0),
	currency		text NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
	created_at		timestamptz NOT NULL
);

-- POST /orders, the in-transaction shape: the order row is the effect.
CREATE TABLE orders (
	id				bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	idempotency_key	text NOT NULL,
	customer		text NOT NULL,
	amount			bigint NOT NULL CHECK (amount > 0),
	currency		text NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
	created_at		timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The simulated payment provider's ledger (provider.js), which a real
-- provider keeps on its side: one row per Idempotency-Key it was passed
-- (it deduplicates by key), with the number of calls that carried the key.
CREATE TABLE provider_charges (
	id				bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	provider_key	text NOT NULL UNIQUE,
	customer		text NOT NULL,
	amount			bigint NOT NULL CHECK (amount > 0),
	currency		text NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
	calls			integer NOT NULL DEFAULT 1,
	created_at		timestamptz NOT NULL DEFAULT clock_timestamp()
);
